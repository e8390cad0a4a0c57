"""The `balanced` strategy's grid: which (step, rank) cell each pack gets, so ranks are balanced.

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

import numpy as np

from raypack.data.plan import Packing


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
