"""The equal-work rule: padded trials get the packed trials' tokens per optimizer step. Checked on
plans (no Ray): tokens per step of pad and flatten against bfd and balanced, within 15%."""

from __future__ import annotations

import numpy as np
import pytest

from raypack.config import PackConfig
from raypack.data.strategies import STRATEGIES, make_plan
from raypack.data.synthetic import sample_lengths
from raypack.tune.data import equal_work_batch_size


def tokens_per_step(lengths, strategy, budget, batch_size, ranks=1):
    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget, batch_size=batch_size), ranks)
    return lengths.sum() / plan.num_steps


def test_the_trait_not_the_name():
    assert {s for s in STRATEGIES if STRATEGIES[s].takes_batch_size} == {"pad", "pad_sorted", "flatten"}


@pytest.mark.parametrize("kind, budget", [("flan", 512), ("flan", 2048), ("orcamath", 1024)])
def test_padded_and_packed_steps_hold_the_same_tokens(kind, budget):
    lengths = sample_lengths(kind, 3000, seed=1, max_length=budget)
    b = equal_work_batch_size(budget, lengths.mean())
    packed = [tokens_per_step(lengths, s, budget, 8) for s in ("bfd", "balanced")]
    padded = [tokens_per_step(lengths, s, budget, b) for s in ("pad", "flatten", "pad_sorted")]
    for p in padded:
        for q in packed:
            assert abs(p / q - 1) < 0.15, (kind, budget, p, q)


def test_without_the_rule_they_differ():
    """The negative case: the CPU sweep's old batch_size 4 on ~215-token examples and budget 512
    gives padded steps ~70% more tokens than packed ones."""
    lengths = np.clip(sample_lengths("flan", 3000, seed=1, max_length=512), 1, 512)
    lengths = (lengths * 215 / lengths.mean()).clip(1, 512).astype(np.int64)
    ratio = tokens_per_step(lengths, "pad", 512, 4) / tokens_per_step(lengths, "bfd", 512, 4)
    assert ratio > 1.5


def test_batch_size_rounding():
    assert equal_work_batch_size(512, 215.3) == pytest.approx(2.378)
    assert equal_work_batch_size(100, 400) == 1.0  # never below one example
