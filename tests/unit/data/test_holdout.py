"""The held-out eval split, without Ray."""

from __future__ import annotations

import numpy as np

from raypack.data.holdout import held_out_line, held_out_mask, is_eval
from raypack.data.sources import ROW_SHIFT


def test_eval_split_is_stable_and_near_the_fraction():
    ids = np.arange(0, 200_000, 7)
    held = is_eval(ids, 0.1, seed=0)
    assert 0.09 < held.mean() < 0.11
    assert (held == is_eval(ids, 0.1, seed=0)).all()
    assert not is_eval(ids, 0.0, seed=0).any()


def _ids(rows: np.ndarray, pieces: int = 1) -> np.ndarray:
    """example_ids of `rows`, each split into `pieces` pieces (the low bits number them)."""
    return (rows[:, None].astype(np.int64) << ROW_SHIFT | np.arange(pieces)).ravel()


def test_the_cap_keeps_the_lowest_hashes_whatever_the_order_of_the_ids():
    ids = _ids(np.arange(50_000))
    free = is_eval(ids, 0.1, seed=3)
    capped = is_eval(ids, 0.1, seed=3, cap=2000)
    assert capped.sum() == 2000 and not (capped & ~free).any()
    # The subset is a prefix of one seeded order: a larger cap or fraction only adds examples.
    assert not (capped & ~is_eval(ids, 0.1, seed=3, cap=3000)).any()
    assert not (capped & ~is_eval(ids, 0.2, seed=3, cap=2000)).any()
    assert (is_eval(ids, 0.1, seed=3, cap=10_000) == free).all()  # a cap above the fraction's count
    # Ids arriving in another order, or as the union of what several workers made, pick the same.
    perm = np.random.default_rng(0).permutation(len(ids))
    assert (is_eval(ids[perm], 0.1, seed=3, cap=2000) == capped[perm]).all()
    shards = [ids[r::4] for r in range(4)]
    again = np.concatenate(shards)
    assert set(again[is_eval(again, 0.1, seed=3, cap=2000)]) == set(ids[capped])
    assert set(ids[is_eval(ids, 0.1, seed=4, cap=2000)]) != set(ids[capped])  # the seed does choose


def test_the_cap_keeps_a_split_example_whole():
    ids = _ids(np.arange(20_000), pieces=3)
    held = is_eval(ids, 0.1, seed=0, cap=1000)
    by_row = held.reshape(-1, 3)
    assert (by_row.all(axis=1) | ~by_row.any(axis=1)).all()
    assert 997 <= held.sum() <= 1000  # whole rows of 3 up to the cap


def test_held_out_line_says_how_many_and_why():
    from raypack.config import load

    ids = _ids(np.arange(30_000))
    cfg = load(None, ["data.eval_max_examples=500"])
    held = held_out_mask(ids, cfg)
    assert held_out_line(ids, held, cfg) == (
        "[raypack] held out 500 of 30,000 examples for eval "
        "(data.eval_fraction=0.1, capped by data.eval_max_examples=500)")
    small = ids[:300]
    default = load(None, [])
    held = held_out_mask(small, default)
    assert 15 < held.sum() < 45  # the 10% split on small data: the default cap changes nothing
    assert held_out_line(small, held, default).endswith(" of 300 examples for eval (data.eval_fraction=0.1)")
    none = load(None, ["data.eval_fraction=0"])
    assert held_out_line(small, held_out_mask(small, none), none) == (
        "[raypack] held out 0 of 300 examples for eval (data.eval_fraction=0; no eval loss is reported)")
