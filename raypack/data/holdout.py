"""The eval split: which examples are held out of training, by a seeded hash of their source row.

    held_out = held_out_mask(ids, cfg)     # bool per example_id; ~held_out is what the plan covers
    print(held_out_line(ids, held_out, cfg))   # how many, and which setting decided it

Every source row gets a seeded rank from the hash of its row number; the held-out set is a prefix
of that order: the rows whose hash falls in the lowest `data.eval_fraction` of its range, and of
those at most `data.eval_max_examples` examples, the lowest first. So the same examples are held
out on every run and resume, whatever the order of the ids or the number of workers that made
them; raising the cap or the fraction only adds examples; and the pieces of a split example never
straddle train and eval (the hash is of the source row, not the piece). `raypack plan --config`
asks the same question, so it shows the plan training uses. A mixture's split
(`data.sources`) is each source's own: the fraction and the cap apply to its examples alone.
"""

from __future__ import annotations

import numpy as np

from raypack.config import Config
from raypack.data.sources import ROW_SHIFT

BUCKETS = 10_000
"""The hash's resolution: fractions are rounded to 1 / BUCKETS."""


def _hashes(example_ids: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket in [0, BUCKETS), the full 64-bit mix) of each example's source row."""
    rows = example_ids.astype(np.uint64) >> np.uint64(ROW_SHIFT)
    mixed = (rows + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(40)) % np.uint64(BUCKETS), mixed


def is_eval(example_ids: np.ndarray, fraction: float, seed: int, cap: int | None = None) -> np.ndarray:
    """A stable hash split of about `fraction` of the source rows, then at most `cap` examples of
    those: the lowest in (bucket, mix) order, whole source rows only (a split example's pieces
    share both, so they go together or not at all)."""
    if fraction <= 0 or not len(example_ids):
        return np.zeros(len(example_ids), dtype=bool)
    bucket, mixed = _hashes(example_ids, seed)
    held = bucket < np.uint64(round(fraction * BUCKETS))
    if cap is not None and held.sum() > cap:
        where = np.flatnonzero(held)
        order = np.lexsort((mixed[where], bucket[where]))
        row_mix = mixed[where][order]  # one value per source row (the mix is a bijection of it)
        # Examples up to and including each one's source row, in that order: a row's pieces all
        # see the count of the last of them, so a row is kept whole or dropped whole.
        last = np.r_[row_mix[1:] != row_mix[:-1], True]
        through = np.minimum.accumulate(np.where(last, np.arange(1, len(order) + 1), len(order))[::-1])[::-1]
        held[where[order[through > cap]]] = False
    return held


def held_out_mask(ids: np.ndarray, cfg: Config, owner: np.ndarray | None = None) -> np.ndarray:
    """Which examples (by example_id) are held out for eval: `data.eval_fraction` of them, at most
    `data.eval_max_examples`, seeded by `pack.seed`; none when that would hold out every example
    (no eval loss is reported then). `owner`: a mixture's source of each example
    (data/mixture.py), whose split is then each source's own, of its examples alone, capped alone."""
    if owner is not None:
        held = np.zeros(len(ids), dtype=bool)
        for k in np.unique(owner):
            mine = owner == k
            held[mine] = held_out_mask(ids[mine], cfg)
        return held
    held_out = is_eval(ids, cfg.data.eval_fraction, cfg.pack.seed, cfg.data.eval_max_examples)
    if held_out.all():
        held_out[:] = False
    return held_out


def held_out_line(ids: np.ndarray, held_out: np.ndarray, cfg: Config, owner: np.ndarray | None = None) -> str:
    """The prepare summary's line: how many of the examples `ids` were held out for eval, and why
    (`owner`: a mixture's source of each, each source's split its own)."""
    d, n, total = cfg.data, int(held_out.sum()), len(ids)
    setting = f"data.eval_fraction={d.eval_fraction:g}" + (", of each source" if owner is not None else "")
    every = [owner == k for k in np.unique(owner)] if owner is not None else [np.ones(len(ids), dtype=bool)]
    uncapped = sum(int(is_eval(ids[m], d.eval_fraction, cfg.pack.seed).sum()) for m in every)
    if n == 0 and total and uncapped == total:
        why = f"{setting} would hold out every one, so none are; no eval loss is reported"
    elif n == 0:
        why = f"{setting}; no eval loss is reported"
    elif uncapped > n:
        why = f"{setting}, capped by data.eval_max_examples={d.eval_max_examples}"
    else:
        why = setting
    what = "examples"
    if cfg.train.objective == "dpo":  # a preference pair is two rows, held out together
        n, total, what = n // 2, total // 2, "pairs"
    return f"[raypack] held out {n:,} of {total:,} {what} for eval ({why})"
