"""Lay packs on the (step, rank) grid: even the pack count out over the ranks, balance the ranks.

`even_out` makes the pack count a multiple of the ranks (split the largest splittable packs, then
empty packs; plan.py's docstring states the rule). `balanced_cells` orders packs for `balanced`.

A step is as slow as its slowest rank, and a rank's work has two parts: tokens (the MLPs and
projections, linear in tokens) and attention (quadratic in each example's length, so a pack's
attention cost is the sum of its pieces' squared lengths). Two packs of 4096 tokens can differ
tenfold in attention: one 4000-token example against twenty 200-token ones.

Multipack-style: sort the packs so that neighbours are alike in both costs, then give each
consecutive group of `num_ranks` packs to one step. Best-fit decreasing fills almost every pack to
the budget, so tokens are equalised by a coarse key (fill in steps of 1/`TOKEN_BUCKETS` of the
budget) and attention by the fine key inside it. The steps are then shuffled (training must not
run sorted by cost) and the ranks inside each step too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Packing(NamedTuple):
    """Pieces before they are placed on the grid. Pieces of one pack are in their pack order."""

    example: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pack: np.ndarray  # dense ids 0..num_packs-1
    num_packs: int


TOKEN_BUCKETS = 256
"""Fill resolution of the token key; neighbours differ by at most budget / TOKEN_BUCKETS tokens."""


def balanced_cells(packing: Packing, num_ranks: int, budget: int, seed: int) -> np.ndarray:
    """Cell (step * num_ranks + rank) of every pack of `packing`."""
    n = packing.num_packs
    size = (packing.end - packing.start).astype(np.float64)
    tokens = np.bincount(packing.pack, weights=size, minlength=n)
    attention = np.bincount(packing.pack, weights=size * size, minlength=n)
    bucket = np.floor(tokens * TOKEN_BUCKETS / budget)
    # Snake order: attention ascends in even buckets and descends in odd ones, so a step that
    # straddles two buckets joins packs of similar attention rather than the two extremes.
    snake = np.where(bucket % 2 == 0, attention, -attention)
    ranked = np.lexsort((snake, bucket))  # packs in grid order before shuffling
    steps = n // num_ranks
    rng = np.random.default_rng([seed, 2])
    grid = ranked.reshape(steps, num_ranks)[rng.permutation(steps)]
    grid = rng.permuted(grid, axis=1)
    cell = np.empty(n, dtype=np.int64)
    cell[grid.ravel()] = np.arange(n)
    return cell


def even_out(packing: Packing, num_ranks: int) -> Packing:
    """Split the largest splittable packs until the count is a multiple of `num_ranks` (see the
    module docstring); empty packs fill what splitting cannot. Returns a new Packing."""
    example, start, end, pack, num_packs = packing
    need = (-num_packs) % num_ranks
    while need:
        sizes = np.bincount(pack, minlength=num_packs)
        tokens = np.bincount(pack, weights=end - start, minlength=num_packs)
        candidates = np.flatnonzero(sizes >= 2)
        if len(candidates) == 0:
            break
        take = min(need, len(candidates))
        chosen = candidates[np.argsort(-tokens[candidates], kind="stable")[:take]]
        pack = pack.copy()
        for p in chosen.tolist():
            (idx,) = np.nonzero(pack == p)
            run = np.cumsum(end[idx] - start[idx])
            cut = int(np.clip(np.searchsorted(run, run[-1] / 2), 1, len(idx) - 1))
            pack[idx[cut:]] = num_packs
            num_packs += 1
        need -= take
    return Packing(example, start, end, pack, num_packs + need)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative ints below 2**32 as two 16-bit radix passes (numpy radix
    sorts 16-bit keys; int64 keys would take timsort, ~5x slower on 10M)."""
    if len(keys) == 0 or keys.max() < 2**16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    if keys.max() >= 2**32:
        return np.argsort(keys, kind="stable")
    low = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    return low[np.argsort((keys[low] >> 16).astype(np.uint16), kind="stable")]
