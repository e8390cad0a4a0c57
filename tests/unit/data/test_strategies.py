"""The strategies: registry and pickling, and what each one promises (its traits included)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import yaml
from hypothesis import given, settings

from raypack.config import load
from raypack.data.strategies import STRATEGIES, check_strategies, get_strategy
from raypack.errors import ConfigError
from raypack.data.synthetic import sample_lengths

from planning import plan_for, problems


@settings(max_examples=40, deadline=None)
@given(problems())
def test_flatten_keeps_pads_minibatches(problem):
    lengths, budget, ranks, batch, seed = problem
    pad, flat = (plan_for(n, lengths, budget, ranks, batch, seed) for n in ("pad", "flatten"))
    assert pad.num_steps == flat.num_steps
    for field in ("example", "start", "end", "pack", "rank", "step"):
        assert np.array_equal(getattr(pad, field), getattr(flat, field))
    assert pad.padded and not flat.padded


def test_bfd_reaches_the_lower_bound_on_flan():
    lengths = sample_lengths("flan", 100_000, seed=0, max_length=4096)
    plan = plan_for("bfd", lengths, 4096, 1, 8, 0)
    assert plan.num_packs <= 1.001 * -(-lengths.sum() // 4096)


def test_registry_and_pickling():
    s = get_strategy("balanced", budget=2048, batch_size=4, seed=7)  # batch_size is not balanced's
    assert s.name == "balanced" and s.budget == 2048 and s.seed == 7
    assert pickle.loads(pickle.dumps(s)) == s
    assert get_strategy("pad", batch_size=4).batch_size == 4
    with pytest.raises(ValueError, match="unknown packing strategy"):
        get_strategy("nope")
    with pytest.raises(ValueError, match="exceeds budget"):
        plan_for("bfd", np.array([9]), 8, 1, 8, 0)
    assert len(plan_for("wrapped", np.array([20]), 8, 1, 8, 0).example) == 3  # wrapped splits instead


def test_padded_is_answered_by_the_strategy():
    """The one answer to "does this strategy pad?"; the plan, the prepared data and the loop's
    choice of attention all follow it."""
    assert {name for name, s in STRATEGIES.items() if s.padded} == {"pad", "pad_sorted"}
    assert plan_for("pad", np.array([3, 2]), 8, 1, 2, 0).padded
    assert not plan_for("flatten", np.array([3, 2]), 8, 1, 2, 0).padded


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_random_packs_is_the_truth_about_the_seed(name):
    """`random_packs` (what pack.repack_each_epoch relies on) says whether another seed or epoch
    changes which examples share a pack; checked on the packs, not trusted."""
    lengths = sample_lengths("flan", 2000, seed=0, max_length=512)

    def packs(**params):
        packing = get_strategy(name, budget=512, batch_size=4, **params).pack(lengths)
        groups: dict[int, list] = {}
        for e, s, p in zip(packing.example.tolist(), packing.start.tolist(), packing.pack.tolist()):
            groups.setdefault(p, []).append((e, s))
        return sorted(sorted(g) for g in groups.values())

    base = packs(seed=0)
    changed = packs(seed=1) != base and packs(seed=0, epoch=1) != base
    assert changed == STRATEGIES[name].random_packs
    assert packs(seed=0) == base and packs(seed=0, epoch=0) == base  # epoch 0 is the plan as ever


def _write(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_unknown_pack_strategy_is_refused_naming_field_choices_and_file(tmp_path):
    path = _write(tmp_path, {"pack": {"strategy": "bdf"}})
    with pytest.raises(ConfigError) as e:
        check_strategies(load(path), path)
    msg = str(e.value)
    assert path in msg and "pack.strategy: unknown packing strategy 'bdf'" in msg and "balanced" in msg
    with pytest.raises(ConfigError, match=r"tune.strategies: unknown packing strategy 'nope'"):
        check_strategies(load(None, ["tune.strategies=[bfd, nope]"]))


def test_the_command_line_refuses_an_unknown_strategy_before_any_import(tmp_path, capsys):
    from raypack.cli import main

    path = _write(tmp_path, {"pack": {"strategy": "bdf"}})
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path in err and "unknown packing strategy 'bdf'" in err


def test_repack_each_epoch_needs_a_strategy_whose_packs_depend_on_the_seed():
    for name, strategy in STRATEGIES.items():
        cfg = load(None, [f"pack.strategy={name}", "pack.repack_each_epoch=true"])
        if strategy.random_packs:
            check_strategies(cfg)
            assert cfg.pack.repack_each_epoch
        else:
            with pytest.raises(ConfigError, match=rf"pack.repack_each_epoch: {name} packs the same examples"):
                check_strategies(cfg)
    assert {n for n, s in STRATEGIES.items() if s.random_packs} == {"pad", "flatten", "wrapped", "wrapped_noreset", "random"}


def test_traits_are_answered_by_the_strategies():
    assert {n for n, s in STRATEGIES.items() if not s.bounded_rows} == {"pad", "pad_sorted", "flatten"}
    assert {n for n, s in STRATEGIES.items() if s.takes_batch_size} == {"pad", "pad_sorted", "flatten"}
    # a strategy that takes a batch size has the field its packs are built from
    for name, s in STRATEGIES.items():
        assert s.takes_batch_size == ("batch_size" in {f.name for f in dataclasses.fields(s)}), name
