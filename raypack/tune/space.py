"""The `tune:` section as Ray Tune objects: the search space, the scheduler, the search algorithm,
and the checks a sweep config gets before any Ray work starts.

    tune:
      strategies: [pad, flatten, bfd, balanced]    # strategy_space: grid (or choice)
      budgets: [2048, 4096]                        # budget_space: grid (or choice)
      lrs: [1.0e-5, 1.0e-4]                        # lr_space: loguniform draws in [low, high]
      lr_space: loguniform
      num_samples: 3                               # the grid 3 times, lr drawn each time
      metric: eval_loss                            # what the scheduler / searcher rank by
      mode: min
      scheduler: asha                              # stops weak trials early
      asha: {time_attr: step, grace_period: 50, reduction_factor: 2}

The per-field checks live in raypack/config.py (TuneConfig, AshaConfig); `check` adds what needs
other modules or sections: strategy names against the registry (`strategies.check_strategies`),
the metric against what a run reports, and that a metric the scheduler or searcher reads is in
every report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray.tune
from ray.tune.schedulers import AsyncHyperBandScheduler
from ray.tune.search import BasicVariantGenerator

from raypack.config import Config
from raypack.data.strategies import check_split, check_strategies
from raypack.errors import ConfigError
from raypack.train.metrics import REPORTED
from raypack.train.preflight import Checked, preflight
from raypack.config.swept import OPTIONAL, get, set_field


def dimensions(cfg: Config) -> dict[str, tuple[Any, ...]]:
    """The swept values per trial parameter; an empty tune list keeps the base config's value
    (an optional parameter only where it applies: `lora_r` for a sweep with adapters, `beta` for one
    with train.objective: dpo, `router_aux_loss_coef` where listed; raypack/config/swept.py)."""
    dims = {
        "strategy": cfg.tune.strategies,
        "budget": cfg.tune.budgets or (cfg.pack.budget,),
        "lr": cfg.tune.lrs or (cfg.train.lr,),
    }
    for p in OPTIONAL:
        if p.applies(cfg):
            dims[p.name] = getattr(cfg.tune, p.values) or (get(cfg, p.sets),)
    return dims


def _space(cfg: Config) -> dict[str, str]:
    t = cfg.tune
    return {"strategy": t.strategy_space, "budget": t.budget_space, "lr": t.lr_space,
            **{p.name: getattr(t, p.space) for p in OPTIONAL}}


def check(cfg: Config) -> None:
    """Raise ConfigError (naming the key) for a sweep config Ray Tune would fail on later."""
    check_strategies(cfg)
    t = cfg.tune
    for name in t.strategies:
        check_split(name, cfg.train.sequence_parallel, "tune.strategies")
    for p in OPTIONAL:
        if getattr(t, p.values) and not p.applies(cfg):
            raise ConfigError(f"tune.{p.values}: {p.needs}")
    if any(c > 0 for c in t.router_aux_loss_coefs) and cfg.train.sequence_parallel > 1:
        # as router_loss.check_router_setting refuses each such trial at its setup
        raise ConfigError(f"tune.router_aux_loss_coefs: {list(t.router_aux_loss_coefs)} with train.sequence_parallel="
                          f"{cfg.train.sequence_parallel}: the router loss is not combined across a sequence-parallel "
                          "group yet; set train.sequence_parallel: 1, or sweep only 0")
    if t.metric not in REPORTED:
        raise ConfigError(f"tune.metric: expected one of {', '.join(REPORTED)}, got {t.metric!r}")
    ranks_by_metric = t.scheduler != "none" or t.search_alg != "basic"
    if ranks_by_metric and t.metric.startswith("eval_") and not _eval_in_every_report(cfg):
        raise ConfigError(
            f"tune.metric: {t.metric} with scheduler {t.scheduler!r} / search_alg {t.search_alg!r} needs an eval in "
            "every report: set train.report_every_steps and train.eval_every_steps so that it divides it "
            "(and train.checkpoint_every_steps), or rank by loss"
        )
    if t.scheduler == "asha" and t.asha.time_attr == "training_iteration" and t.asha.max_t is None:
        raise ConfigError("tune.asha.max_t: set it when time_attr is training_iteration (reports are not planned ahead)")
    if t.search_alg == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("tune.search_alg: optuna is not installed: pip install 'raypack[optuna]'") from None


def preflight_sweep(cfg: Config) -> Checked:
    """`preflight` (data, tokenizer, model: raypack/train/preflight.py) of the base config, with the
    largest swept router loss coefficient: a dense model (no router) refuses a number > 0 here,
    before Ray starts, not at every trial's setup (router_loss.check_router_setting). The config it
    returns keeps the base coefficient: every trial sets its own where it is swept."""
    coefs = cfg.tune.router_aux_loss_coefs
    if not coefs:
        return preflight(cfg)
    from raypack.model.routers import RouterNotFoundError  # torch: imported once a sweep needs it

    key = "train.router_aux_loss_coef"
    try:
        checked = preflight(set_field(cfg, key, max(coefs)))
    except RouterNotFoundError:  # its message would say to set train.router_aux_loss_coef, which trials replace
        raise RouterNotFoundError(
            f"tune.router_aux_loss_coefs: {list(coefs)}, but model.name {cfg.model.name!r} is not a "
            "mixture-of-experts model (no router); sweep only 0, or an MoE model") from None
    return dataclasses.replace(checked, cfg=set_field(checked.cfg, key, get(cfg, key)))


def _eval_in_every_report(cfg: Config) -> bool:
    tr = cfg.train
    every = tr.eval_every_steps
    reports = tr.report_every_steps  # None: chosen as the run goes, so not known to line up
    return every > 0 and reports is not None and reports % every == 0 and tr.checkpoint_every_steps % every == 0


def param_space(cfg: Config) -> dict[str, Any]:
    """Tune's param_space: one grid_search / choice / loguniform per swept parameter."""
    out = {}
    for name, values in dimensions(cfg).items():
        space = _space(cfg)[name]
        if space == "loguniform":
            out[name] = ray.tune.loguniform(values[0], values[1])
        elif len(values) == 1:
            out[name] = values[0]  # a constant: searchers (Optuna) cannot take a one-value grid
        elif space == "choice":
            out[name] = ray.tune.choice(list(values))
        else:
            out[name] = ray.tune.grid_search(list(values))
    return out


def planned_trials(cfg: Config) -> int:
    """How many trials the sweep runs: num_samples times the grid (random draws add none)."""
    n = cfg.tune.num_samples
    for name, values in dimensions(cfg).items():
        if _space(cfg)[name] == "grid" and len(values) > 1:
            n *= len(values)
    return n


def pack_configs(cfg: Config) -> list[tuple[str, int]]:
    """Every (strategy, budget) a trial may get: the packed data a sweep prepares up front."""
    dims = dimensions(cfg)
    return [(s, b) for s in dims["strategy"] for b in dims["budget"]]


def scheduler(cfg: Config, max_t: int):
    """ASHA (or None) over `tune.asha`; `max_t` is used when tune.asha.max_t is not set."""
    t = cfg.tune
    if t.scheduler == "none":
        return None
    a = t.asha
    return AsyncHyperBandScheduler(
        time_attr=a.time_attr,
        max_t=a.max_t or max(max_t, a.grace_period + 1),
        grace_period=a.grace_period,
        reduction_factor=a.reduction_factor,
        brackets=a.brackets,
    )


def search_alg(cfg: Config):
    t = cfg.tune
    if t.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=t.seed)
    # Seeded, so a resumed sweep (and a rerun) draws the same random dimensions. Tune ignores
    # TuneConfig.max_concurrent_trials when it is handed a BasicVariantGenerator: set it here.
    return BasicVariantGenerator(random_state=t.seed, max_concurrent=t.max_concurrent_trials)


def tune_config(cfg: Config, max_t: int) -> ray.tune.TuneConfig:
    t = cfg.tune
    return ray.tune.TuneConfig(
        metric=t.metric,
        mode=t.mode,
        num_samples=t.num_samples,
        # The basic generator carries the limit itself (search_alg); Tune wraps any other searcher.
        max_concurrent_trials=None if t.search_alg == "basic" else t.max_concurrent_trials,
        scheduler=scheduler(cfg, max_t),
        search_alg=search_alg(cfg),
        # A cached trial actor would keep a stopped trial's thread, and with it its Train run.
        reuse_actors=False,
    )
