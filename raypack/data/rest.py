"""The rest of an epoch, planned again: what a resume on another worker count trains first.

    rest = pack_rest(cfg, num_ranks, out_dir, sources, epoch, trained, vocab_size=..., tower=...)

A checkpoint's position (epoch, micro-step) indexes one plan's packs, and a plan holds its rank
count. On other ranks that position means nothing, but the ranks' step logs say which examples
the epoch has trained (raypack/train/checkpoint.py). The examples of the run's draw less those
(one occurrence each: a mixture may draw an example twice) are planned with the run's own
strategy for the new ranks and grad_accum, balanced as any plan, and written as their own rows;
the epoch then reads these from their first step, and later epochs the new ranks' full plan.
Nothing is skipped or trained twice: the rest is a set difference over example ids.

Why the tokenized rows are read again (from `data.cache_path`, or tokenized anew): the packed
rows hold the pieces of several examples each, in the old plan's layout.
"""

from __future__ import annotations

import numpy as np

from raypack import storage
from raypack.config import Config
from raypack.data.cache import tokenized
from raypack.data.listing import Sources
from raypack.data.mixture import split
from raypack.data.prepare import _pack
from raypack.data.tower import tower_extra
from raypack.errors import InputError


def untrained(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """A mask over `ids` (the epoch's draw, an id once per time it is drawn) leaving out one
    occurrence of every id in `trained` (the later ones: which copy trained is all the same); an
    InputError if `trained` holds an id more often than the draw (the logs are of other data)."""
    ids, trained = np.asarray(ids, np.int64), np.asarray(trained, np.int64)
    uniq, inverse = np.unique(ids, return_inverse=True)
    done, times = np.unique(trained, return_counts=True)
    at = np.minimum(np.searchsorted(uniq, done), max(len(uniq) - 1, 0))
    drawn = np.where(uniq[at] == done, np.bincount(inverse, minlength=len(uniq))[at], 0) if len(uniq) else 0 * times
    if (times > drawn).any():
        bad = int(np.argmax(times > drawn))
        raise InputError(f"the checkpoint's step logs say example {int(done[bad])} trained {int(times[bad])} times "
                         f"this epoch, but the data draws it {int(drawn[bad])} times: the data changed since; resume "
                         "with the data it trained on, or start a new run.name")
    done_count = np.zeros(len(uniq), np.int64)
    done_count[at] = times
    order = np.argsort(inverse, kind="stable")
    grouped = inverse[order]
    occurrence = np.empty(len(ids), np.int64)  # 0 for an id's first copy, 1 for its second, ...
    occurrence[order] = np.arange(len(ids)) - np.searchsorted(grouped, grouped, "left")
    return occurrence >= done_count[inverse]


def pack_rest(cfg: Config, num_ranks: int, out_dir: str, sources: Sources, epoch: int, trained: np.ndarray, *,
              vocab_size: int | None = None, tower=None) -> dict:
    """Plan the examples of epoch `epoch` not in `trained` (ids, as the step logs hold them) for
    `num_ranks` ranks and `cfg.train.grad_accum`, and write their rows under `out_dir`:
    {"dir", "steps_per_rank", "stats", "examples"} (no rows and 0 steps when none is left)."""
    storage.remove_dir(out_dir)  # a rest planned by an earlier try of this resume: Parquet appends
    scratch = f"{out_dir}/tokenized"
    try:
        tok = tokenized(cfg, sources, vocab_size, scratch=None if cfg.data.cache_path else scratch)
        take = split(tok, cfg, sources).take
        lengths, ids = tok.lengths[take], tok.ids[take]
        keep = untrained(ids, trained)
        if not keep.any():
            return {"dir": None, "steps_per_rank": 0, "stats": {}, "examples": 0}
        rest = ids[keep]
        rows = (storage.file_sizes(tok.data_dir, ".parquet"), (np.unique(rest), True))
        extra = tower_extra(None if tok.tower is None else tok.tower[take][keep], tower)
        plan, stats, _ = _pack(rows, lengths[keep], rest, cfg, num_ranks, f"{out_dir}/train", epoch=epoch, extra=extra)
    finally:
        storage.remove_dir(scratch)
    return {"dir": f"{out_dir}/train", "steps_per_rank": int(plan.num_steps), "stats": stats, "examples": int(keep.sum())}
