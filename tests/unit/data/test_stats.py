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


def test_imbalance_is_the_wall_time_overhead():
    """Σ over steps of the busiest rank / Σ over steps of the mean rank, by hand on a 2x2 grid."""
    plan = plan_for("bfd", np.array([8, 4, 4, 2]), 8, 2, 8, 0)  # packs [8] [4 4] [2] [] in some cells
    tokens = plan.pack_tokens().reshape(-1, 2).astype(float)
    want = tokens.max(axis=1).sum() / tokens.mean(axis=1).sum()
    stats = plan.stats()
    assert stats["token_imbalance"] == pytest.approx(want)
    att = plan.pack_attention().reshape(-1, 2)
    assert stats["attention_imbalance"] == pytest.approx(att.max(axis=1).sum() / att.mean(axis=1).sum())
    assert stats["token_imbalance_worst"] == pytest.approx((tokens.max(axis=1) / tokens.mean(axis=1)).max())
