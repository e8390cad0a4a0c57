"""The eval split: which examples are held out of training, by a seeded hash of their source row.

    held_out = held_out_mask(ids, cfg)     # bool per example_id; ~held_out is what the plan covers

The same examples are held out on every run and resume, whatever the order of the ids, and the
pieces of a split example never straddle train and eval (the hash is of the source row, not the
piece). `raypack plan --config` asks the same question, so it shows the plan training uses.
"""

from __future__ import annotations

import numpy as np

from raypack.config import Config
from raypack.data.sources import ROW_SHIFT


def is_eval(example_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A stable hash split of about `fraction` of the source rows."""
    if fraction <= 0:
        return np.zeros(len(example_ids), dtype=bool)
    rows = example_ids.astype(np.uint64) >> np.uint64(ROW_SHIFT)
    mixed = (rows + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(40)) % np.uint64(10_000) < np.uint64(round(fraction * 10_000))


def held_out_mask(ids: np.ndarray, cfg: Config) -> np.ndarray:
    """Which examples (by example_id) are held out for eval: `data.eval_fraction` of them, seeded
    by `pack.seed`; none when that would hold out every example (no eval loss is reported then)."""
    held_out = is_eval(ids, cfg.data.eval_fraction, cfg.pack.seed)
    if held_out.all():
        held_out[:] = False
    return held_out
