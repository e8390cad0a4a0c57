"""The `tune:` section: checks before any Ray work, and the Tune objects built from it."""

from __future__ import annotations

import pytest
from ray.tune.schedulers import AsyncHyperBandScheduler
from ray.tune.search import BasicVariantGenerator
from ray.tune.search.sample import Categorical, Float

from raypack.config import load
from raypack.errors import ConfigError
from raypack.tune.space import check, pack_configs, param_space, planned_trials, scheduler, search_alg, tune_config


def cfg(*overrides):
    return load(None, list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["tune.metric=accuracy"], "tune.metric: expected one of"),
    (["tune.scheduler=asha", "tune.metric=eval_loss"], "tune.metric: eval_loss with scheduler 'asha'"),
    (["tune.scheduler=asha", "tune.metric=eval_loss", "train.eval_every_steps=4", "train.report_every_steps=10"],
     "needs an eval in every report"),
    (["tune.scheduler=asha", "tune.metric=eval_loss", "train.eval_every_steps=5"],  # reports chosen as it goes
     "needs an eval in every report"),
    (["tune.scheduler=asha", "tune.asha.time_attr=training_iteration"], "tune.asha.max_t: set it"),
])
def test_check_refuses_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(cfg(*overrides))


def test_check_accepts_what_works():
    check(cfg())
    check(cfg("tune.scheduler=asha", "tune.metric=eval_loss", "train.eval_every_steps=5", "train.report_every_steps=10"))
    check(cfg("tune.strategies=[wrapped, greedy]", "tune.metric=tokens_per_s", "tune.mode=max"))


def test_strategy_names_are_checked_with_the_sweep():
    with pytest.raises(ConfigError, match="tune.strategies: unknown packing strategy 'bfdd'"):
        check(cfg("tune.strategies=[pad, bfdd]"))


def test_field_checks_at_load():
    with pytest.raises(ConfigError, match="tune.lrs: expected \\[low, high\\]"):
        cfg("tune.lr_space=loguniform", "tune.lrs=[1e-2, 1e-4]")
    with pytest.raises(ConfigError, match="tune.strategy_space: expected choice"):
        cfg("tune.search_alg=optuna")  # the default strategies are a grid
    with pytest.raises(ConfigError, match="tune.asha.max_t"):
        cfg("tune.asha.grace_period=8", "tune.asha.max_t=4")
    with pytest.raises(ConfigError, match="tune.num_samples"):
        cfg("tune.num_samples=0")


def test_param_space_per_kind():
    space = param_space(cfg("tune.strategies=[pad, bfd]", "tune.budgets=[256, 512]", "tune.budget_space=choice",
                            "tune.lrs=[1e-4, 1e-2]", "tune.lr_space=loguniform"))
    assert space["strategy"] == {"grid_search": ["pad", "bfd"]}
    assert isinstance(space["budget"], Categorical) and space["budget"].categories == [256, 512]
    assert isinstance(space["lr"], Float) and (space["lr"].lower, space["lr"].upper) == (1e-4, 1e-2)
    # one value is a constant, and empty lists keep the base config's value
    space = param_space(cfg("tune.strategies=[bfd]", "pack.budget=333", "train.lr=0.5"))
    assert space == {"strategy": "bfd", "budget": 333, "lr": 0.5}


def test_dpo_beta_is_a_dimension_of_a_dpo_sweep():
    from raypack.runs import trial_config

    dpo = ("train.objective=dpo", "data.paths=[raypack/assets/sample/preference.jsonl]", "tune.strategies=[bfd]")
    space = param_space(cfg(*dpo, "tune.dpo_betas=[0.05, 0.5]"))
    assert space == {"strategy": "bfd", "budget": 1024, "lr": 1e-3, "beta": {"grid_search": [0.05, 0.5]}}
    assert param_space(cfg(*dpo, "dpo.beta=0.3"))["beta"] == 0.3  # no list: the base config's beta
    assert planned_trials(cfg(*dpo, "tune.dpo_betas=[0.05, 0.1, 0.5]")) == 3
    trial = trial_config(cfg(*dpo), {"strategy": "bfd", "budget": 512, "lr": 1e-3, "beta": 0.05}, "/tmp/runs", "t1")
    assert trial.dpo.beta == 0.05 and trial.run.name == "bfd-b512-lr0.001-beta0.05-t1"
    with pytest.raises(ConfigError, match="tune.dpo_betas: sweeps DPO's beta, so it needs train.objective: dpo"):
        check(cfg("tune.dpo_betas=[0.1]"))
    with pytest.raises(ConfigError, match="tune.strategies: wrapped cuts examples"):
        check(cfg(*dpo, "tune.strategies=[bfd, wrapped]"))
    with pytest.raises(ConfigError, match="eval_rewards/accuracies with scheduler 'asha'"):
        check(cfg(*dpo, "tune.scheduler=asha", "tune.metric=eval_rewards/accuracies", "tune.mode=max"))


def test_pack_configs_cover_every_draw():
    assert pack_configs(cfg("tune.strategies=[pad, bfd]", "tune.budgets=[256, 512]", "tune.budget_space=choice")) == [
        ("pad", 256), ("pad", 512), ("bfd", 256), ("bfd", 512)]


def test_scheduler_and_search():
    assert scheduler(cfg(), 100) is None
    asha = scheduler(cfg("tune.scheduler=asha", "tune.asha.grace_period=4", "tune.asha.reduction_factor=3"), 13)
    assert isinstance(asha, AsyncHyperBandScheduler) and asha._max_t == 13 and asha._time_attr == "step"
    assert scheduler(cfg("tune.scheduler=asha", "tune.asha.max_t=50"), 13)._max_t == 50
    basic = search_alg(cfg("tune.max_concurrent_trials=2"))
    assert isinstance(basic, BasicVariantGenerator) and basic.max_concurrent == 2  # Tune would not set it
    tc = tune_config(cfg("tune.num_samples=3", "tune.metric=eval_loss"), 10)
    assert (tc.num_samples, tc.metric, tc.mode, tc.reuse_actors) == (3, "eval_loss", "min", False)


def test_planned_trials():
    assert planned_trials(cfg("tune.strategies=[pad, bfd]", "tune.budgets=[1, 2, 3]", "tune.num_samples=2")) == 12
    assert planned_trials(cfg("tune.strategies=[pad, bfd]", "tune.strategy_space=choice", "tune.num_samples=5",
                              "tune.lrs=[1e-4, 1e-2]", "tune.lr_space=loguniform")) == 5


def test_optuna_draws_from_the_space():
    pytest.importorskip("optuna")
    c = cfg("tune.search_alg=optuna", "tune.strategies=[pad, bfd]", "tune.strategy_space=choice",
            "tune.lrs=[1e-4, 1e-2]", "tune.lr_space=loguniform", "tune.seed=3")
    check(c)
    searcher = search_alg(c)
    assert searcher.set_search_properties(c.tune.metric, c.tune.mode, param_space(c))
    drawn = [searcher.suggest(f"t{i}") for i in range(4)]
    assert all(d["strategy"] in ("pad", "bfd") and 1e-4 <= d["lr"] <= 1e-2 for d in drawn)  # constants: merged by Tune
    assert len({d["lr"] for d in drawn}) == 4


def test_lora_ranks_are_a_dimension_of_a_sweep_with_adapters():
    lora = cfg("tune.strategies=[bfd]", "model.peft.method=lora", "tune.lora_ranks=[4, 16]")
    assert param_space(lora)["lora_r"] == {"grid_search": [4, 16]} and planned_trials(lora) == 2
    assert param_space(cfg("tune.strategies=[bfd]", "model.peft.method=lora", "model.peft.r=8"))["lora_r"] == 8
    assert "lora_r" not in param_space(cfg("tune.strategies=[bfd]"))
    with pytest.raises(ConfigError, match="tune.lora_ranks: .* needs model.peft.method: lora"):
        check(cfg("tune.lora_ranks=[4, 16]"))
    from raypack.runs import trial_config

    trial = trial_config(lora, {"strategy": "bfd", "budget": 512, "lr": 0.01, "lora_r": 4}, "/tmp/runs")
    assert trial.model.peft.r == 4 and trial.run.name == "bfd-b512-lr0.01-r4"


def test_router_aux_loss_coefs_are_a_dimension_where_listed():
    """The coefficient is swept only where listed (the base config's `auto` names no trial), and every
    trial sets it; a negative one, and one > 0 beside sequence parallelism, are refused before Ray."""
    from raypack.runs import trial_config

    moe = ("model.name=tiny-qwen3_moe", "tune.strategies=[bfd]")
    swept = cfg(*moe, "tune.router_aux_loss_coefs=[0, 0.001, 0.01]")
    check(swept)
    assert param_space(swept)["router_aux_loss_coef"] == {"grid_search": [0.0, 0.001, 0.01]}
    assert planned_trials(swept) == 3
    assert param_space(cfg(*moe, "tune.router_aux_loss_coefs=[0, 0.01]",
                           "tune.router_aux_loss_coef_space=choice"))["router_aux_loss_coef"].categories == [0.0, 0.01]
    assert param_space(cfg(*moe, "tune.router_aux_loss_coefs=[0.01]"))["router_aux_loss_coef"] == 0.01
    assert "router_aux_loss_coef" not in param_space(cfg(*moe, "train.router_aux_loss_coef=0.01"))
    params = {"strategy": "bfd", "budget": 512, "lr": 1e-3, "router_aux_loss_coef": 0.0}
    trial = trial_config(swept, params, "/tmp/r", "t1")
    assert trial.train.router_aux_loss_coef == 0.0 and trial.run.name == "bfd-b512-lr0.001-aux0-t1"
    trial = trial_config(cfg("model.peft.method=lora", "train.objective=dpo"),
                         {"strategy": "bfd", "budget": 512, "lr": 1e-3, "lora_r": 4, "beta": 0.1,
                          "router_aux_loss_coef": 0.01}, "/tmp/r")
    assert (trial.model.peft.r, trial.dpo.beta, trial.train.router_aux_loss_coef) == (4, 0.1, 0.01)
    assert trial.run.name == "bfd-b512-lr0.001-r4-beta0.1-aux0.01"
    with pytest.raises(ConfigError, match=r"tune.router_aux_loss_coefs: expected numbers >= 0, got \(0.0, -0.01\)"):
        cfg(*moe, "tune.router_aux_loss_coefs=[0, -0.01]")
    with pytest.raises(ConfigError, match=r"tune.router_aux_loss_coefs: \[0.0, 0.01\] with train.sequence_parallel=2"):
        check(cfg(*moe, "train.sequence_parallel=2", "tune.router_aux_loss_coefs=[0, 0.01]"))
    check(cfg(*moe, "train.sequence_parallel=2", "tune.router_aux_loss_coefs=[0]"))
    with pytest.raises(ConfigError, match="tune.router_aux_loss_coef_space: expected choice"):
        cfg(*moe, "tune.search_alg=optuna", "tune.strategy_space=choice", "tune.router_aux_loss_coefs=[0, 0.01]")


def test_a_dense_model_refuses_a_swept_coefficient_before_ray(tmp_path):
    """The driver's preflight checks the largest coefficient and keeps the base one for the trials."""
    from raypack.model.routers import RouterNotFoundError
    from raypack.tune.space import preflight_sweep

    base = (f"run.storage_path={tmp_path}", "tune.router_aux_loss_coefs=[0, 0.01]")
    with pytest.raises(RouterNotFoundError, match=r"tune.router_aux_loss_coefs: \[0.0, 0.01\], but model.name "
                                                  r"'tiny-llama' is not a mixture-of-experts model"):
        preflight_sweep(cfg(*base))
    checked = preflight_sweep(cfg(*base, "model.name=tiny-qwen3_moe", "train.router_aux_loss_coef=0"))
    assert checked.vocab_size == 768 and checked.cfg.train.router_aux_loss_coef == 0.0
    assert preflight_sweep(cfg(f"run.storage_path={tmp_path}", "tune.router_aux_loss_coefs=[0]")).vocab_size == 768
