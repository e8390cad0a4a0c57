"""The held-out eval split, without Ray."""

from __future__ import annotations

import numpy as np

from raypack.data.holdout import is_eval


def test_eval_split_is_stable_and_near_the_fraction():
    ids = np.arange(0, 200_000, 7)
    held = is_eval(ids, 0.1, seed=0)
    assert 0.09 < held.mean() < 0.11
    assert (held == is_eval(ids, 0.1, seed=0)).all()
    assert not is_eval(ids, 0.0, seed=0).any()
