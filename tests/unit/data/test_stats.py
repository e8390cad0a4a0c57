"""Plan statistics: efficiency, padding and imbalance as raypack/data/stats.py defines them."""

from __future__ import annotations

import numpy as np
import pytest

from planning import plan_for


def test_stats_definitions():
    plan = plan_for("pad", np.array([4, 2, 3, 3]), 8, 1, 2, 0)  # two minibatches of two
    stats = plan.stats()
    padded = sum(2 * max(plan.end[plan.pack == p]) for p in range(2))
    assert stats["efficiency"] == pytest.approx(12 / padded)
    assert stats["padding_fraction"] == pytest.approx(1 - 12 / padded)
    stats = plan_for("bfd", np.array([8, 4, 4, 2]), 8, 2, 8, 0).stats()  # [8] [4 4] | [2] [] -> 4 packs
    assert stats["packs"] == 4 and stats["efficiency"] == pytest.approx(18 / 32)
    assert stats["token_imbalance"] >= 1.0 and stats["attention_imbalance"] >= 1.0
