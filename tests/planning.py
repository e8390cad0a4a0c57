"""Packing problems for the plan, strategy and bin-packing tests: a hypothesis strategy and a
one-line way to plan with every PackConfig field spelled out."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from raypack.config import PackConfig
from raypack.data.plan import Plan
from raypack.data.strategies import STRATEGIES, make_plan

PACKED = tuple(name for name, s in STRATEGIES.items() if s.bounded_rows)
"""Strategies whose packs are rows of at most `budget` tokens (the others are minibatches)."""


@st.composite
def problems(draw):
    """(lengths, budget, ranks, batch_size, seed)."""
    budget = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, budget), min_size=0, max_size=80))
    return (np.array(lengths, dtype=np.int64), budget, draw(st.integers(1, 9)), draw(st.integers(1, 5)),
            draw(st.integers(0, 3)))


def plan_for(name: str, lengths, budget: int, ranks: int, batch: int, seed: int) -> Plan:
    return make_plan(lengths, PackConfig(strategy=name, budget=budget, batch_size=batch, seed=seed), ranks)
