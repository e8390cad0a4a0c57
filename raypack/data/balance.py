"""The `balanced` strategy's layout: which (step, rank) cell each pack gets, so a step costs no
more wall time than its mean rank.

A step lasts as long as its busiest rank, and a rank's work has two parts: tokens (the MLPs and
projections, linear in tokens) and attention (quadratic in each example's length, so a pack's
attention cost is the sum of its pieces' squared lengths). The figure to minimize, for each of
the two, is the wall-time overhead Σ_steps max_rank / Σ_steps mean_rank (raypack/data/stats.py).

Three moves, each measured against the alternatives in benchmarks/pack_plan.py (--balance):

1. Remainder: when the pack count is not a multiple of the ranks, the `r` leftover packs are not
   split in halves (plan.even_out, which gives a step of half-full packs next to full ones and
   costs up to 0.9% in tokens at 512 ranks); the `r` packs with the shortest longest-example are
   dissolved and their examples dealt, longest first in snake order, into one step of exactly
   `num_ranks` packs of near-equal tokens and attention. Same pack count as bfd, so the same
   efficiency. If a dealt pack would overflow (large examples, few ranks), even_out is used.
2. Grid: packs are ranked by attention and cut into steps of `num_ranks` consecutive packs: for
   a fixed set of packs this minimizes Σ max attention. Sorting by tokens first (the previous
   layout, 256 fill buckets) fragments the attention order and cost up to 5% at 512 ranks.
3. Windows: ranking by attention alone mixes a partly filled pack with full packs of the same
   attention (orcamath-like lengths: 10 x 396 tokens next to 4096). So consecutive steps whose
   attention lies within `WINDOW_SPREAD` of each other (at most `WINDOW_STEPS` of them) form a
   window, and inside a window the packs are re-cut by tokens. That trades at most ~WINDOW_SPREAD
   of attention (measured: 0.1-0.3%) for the token balance of the partly filled packs.

Steps are then shuffled with the seed (training must not run sorted by cost), and the ranks
inside each step too. Examples never move between steps except in the dissolved remainder.
"""

from __future__ import annotations

import numpy as np

from raypack.data.plan import Packing, even_out, stable_argsort

WINDOW_SPREAD = 0.05
"""Steps whose attention is within this ratio of each other may swap packs to even out tokens."""
WINDOW_STEPS = 64
"""Most steps in one window (bounds how far a pack moves from its attention rank)."""


def balanced_layout(packing: Packing, num_ranks: int, budget: int, seed: int,
                    cost: np.ndarray | None = None, work: np.ndarray | None = None) -> tuple[Packing, np.ndarray]:
    """The packing with its remainder dissolved into one even step, and the cell
    (step * num_ranks + rank) of every pack. `cost`: each piece's attention cost, where it is
    not its length squared (a preference pair's two sequences, raypack/data/pairs.py; an image
    example, whose vision tower attends within each image: raypack/data/tower.py). `work`: each
    piece's linear work, where it is not its length (an image example's patches in tokens' worth
    of FLOPs). The packs' work and cost are what the grid evens out; the remainder is still dealt
    by real tokens, which the budget bounds."""
    packing, tail = dissolve_remainder(packing, num_ranks, budget)
    n = packing.num_packs
    size = (packing.end - packing.start).astype(np.float64)
    tokens = np.bincount(packing.pack, weights=size if work is None else work, minlength=n)
    attention = np.bincount(packing.pack, weights=size * size if cost is None else cost, minlength=n)
    rest = np.ones(n, dtype=bool)
    rest[tail] = False
    ids = np.flatnonzero(rest)
    ids = ids[_grid_order(np.rint(tokens[ids]).astype(np.int64), attention[ids], num_ranks)]
    grid = ids.reshape(-1, num_ranks)
    if len(tail):
        grid = np.vstack([grid, tail[None, :]])
    rng = np.random.default_rng([seed, 2])
    grid = grid[rng.permutation(len(grid))]
    grid = rng.permuted(grid, axis=1)
    cell = np.empty(n, dtype=np.int64)
    cell[grid.ravel()] = np.arange(n)
    return packing, cell


def _grid_order(tokens: np.ndarray, attention: np.ndarray, num_ranks: int) -> np.ndarray:
    """Order of the packs such that each consecutive `num_ranks` form a step (see 2. and 3.)."""
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(attention, kind="stable")
    att = attention[order]
    lowest = np.maximum(att[::num_ranks], 1.0)  # each step's cheapest pack
    # Windows: runs of steps in one log-spaced attention bin, cut every WINDOW_STEPS steps.
    level = np.floor(np.log(lowest) / np.log1p(WINDOW_SPREAD)).astype(np.int64)
    new_run = np.concatenate(([True], level[1:] != level[:-1]))
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(len(level)), 0))
    new_window = new_run | ((np.arange(len(level)) - run_start) % WINDOW_STEPS == 0)
    window = np.repeat(np.cumsum(new_window) - 1, num_ranks)
    # Within a window, fullest packs first; a stable sort keeps the attention order among ties.
    key = window * (int(tokens.max()) + 1) + (tokens.max() - tokens[order])
    return order[stable_argsort(key)]


def dissolve_remainder(packing: Packing, num_ranks: int, budget: int) -> tuple[Packing, np.ndarray]:
    """Make the pack count a multiple of `num_ranks` (see 1. above). Returns the new packing and
    the ids of the dissolved step's packs (empty when nothing was dissolved)."""
    example, start, end, pack, n = packing
    r = n % num_ranks
    none = np.zeros(0, dtype=np.int64)
    if r == 0:
        return packing, none
    size = end - start
    leader = np.zeros(n, dtype=np.int64)
    np.maximum.at(leader, pack, size)
    chosen = np.zeros(n, dtype=bool)
    chosen[stable_argsort(leader)[:r]] = True  # most and finest examples: they deal evenly
    members = np.flatnonzero(chosen[pack])
    members = members[np.argsort(-size[members], kind="stable")]
    k = np.arange(len(members))
    lap, seat = np.divmod(k, num_ranks)
    seat = np.where(lap % 2 == 0, seat, num_ranks - 1 - seat)  # snake: long ones spread both ways
    if np.bincount(seat, weights=size[members], minlength=num_ranks).max() > budget:
        return even_out(packing, num_ranks), none
    # The r dissolved ids are reused, the rest are new; dealt packs left empty stay empty.
    tail = np.concatenate((np.flatnonzero(chosen), np.arange(n, n + num_ranks - r)))
    pack = pack.copy()
    pack[members] = tail[seat]
    return Packing(example, start, end, pack, n + num_ranks - r), tail
