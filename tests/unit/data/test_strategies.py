"""The strategies: registry and pickling, what each one promises, and the balance targets."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings

from raypack.data.strategies import STRATEGIES, get_strategy
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


@pytest.mark.parametrize("kind", ["flan", "orcamath", "wildchat"])
def test_balanced_meets_imbalance_targets(kind):
    lengths = sample_lengths(kind, 60_000, seed=3, max_length=4096)
    stats = plan_for("balanced", lengths, 4096, 8, 8, 0).stats()
    assert stats["token_imbalance"] <= 1.01
    assert stats["attention_imbalance"] <= 1.05
    assert stats["efficiency"] >= 0.985
    bfd = plan_for("bfd", lengths, 4096, 8, 8, 0).stats()
    assert stats["packs"] == bfd["packs"] and stats["attention_imbalance"] < bfd["attention_imbalance"]


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
