"""Global packing plan: which examples share a pack, and which rank trains each pack at which step.

The planner sees only lengths (one int per example, index i = the i-th smallest `example_id`).
A strategy (raypack/data/strategies.py) turns them into a `Packing`; this module evens the pack
count out over the ranks and lays the packs on a (step, rank) grid, one pack per cell, giving
the `Plan` that the pack stage materializes and the workers follow:

    lengths [5 3 7 2 4 ...]            budget 10, 2 ranks
        |  strategy (bfd, balanced, pad, ...)
        v
    packs   p0=[ex2 ex0]  p1=[ex4 ex1 ex3]  p2=[...]  ...      a Packing
        |  even_out: split / empty packs until #packs % ranks == 0
        v
    grid        rank 0      rank 1                              place -> a Plan
      step 0    [ex2 ex0]   [ex4 ex1 ex3]
      step 1    [...]       [...]

Remainder. Ranks must all run the same number of steps, and no example may be dropped. When the
pack count is not a multiple of `num_ranks`, the pack with the most tokens that holds at least
two pieces is split in two (at the piece where its tokens pass half), repeatedly, until it is.
When no pack can be split any more (fewer pieces than cells), empty packs fill the grid; the pack
stage turns an empty pack into a 1-token row whose label is -100, so it adds zero loss.

Order. Which pack goes to which cell is the strategy's choice (`Strategy.layout`): by default
steps are shuffled with `seed` so training never runs sorted by length, and ranks within a step
are shuffled too. Everything is seeded: the same lengths, config and rank count rebuild exactly
the same plan (a resumed run relies on it).

Gradient accumulation is folded in afterwards (`fold_accumulation`): a plan built over
ranks x accum virtual ranks becomes one over `ranks` ranks with accum micro-steps per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from raypack.data.stats import plan_stats


class Packing(NamedTuple):
    """What a strategy returns: pieces before they are placed on the grid, one entry per piece.
    Pieces of one pack are in their pack order."""

    example: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pack: np.ndarray  # dense ids 0..num_packs-1
    num_packs: int


@dataclass(frozen=True, eq=False)  # arrays do not compare as one bool; compare fields instead
class Plan:
    """Plain record of the plan: one entry per placed piece, ordered by (pack, position in pack).

    Pack ids are numbered step-major, `pack = step * num_ranks + rank`, so every (rank, step)
    cell has exactly one pack; a pack with no entries is an empty pack.
    """

    strategy: str
    budget: int
    num_ranks: int
    num_steps: int
    """Steps per rank (the same for every rank)."""
    padded: bool
    """True for pad / pad_sorted: collate pads the pack's examples instead of concatenating them."""
    reset_positions: bool
    """False only for wrapped_noreset (positions run on across examples)."""
    example: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pack: np.ndarray
    rank: np.ndarray
    step: np.ndarray
    seconds: float = 0.0
    """Wall time spent planning."""

    @property
    def num_packs(self) -> int:
        return self.num_steps * self.num_ranks

    def pack_tokens(self) -> np.ndarray:
        """Real tokens in every pack (index = pack id)."""
        return np.bincount(self.pack, weights=self.end - self.start, minlength=self.num_packs).astype(np.int64)

    def pack_attention(self) -> np.ndarray:
        """Attention cost of every pack: the sum of its pieces' squared lengths."""
        n = (self.end - self.start).astype(np.float64)
        return np.bincount(self.pack, weights=n * n, minlength=self.num_packs)

    def pack_max_piece(self) -> np.ndarray:
        """Longest piece of every pack (what pad pads to); 0 for empty packs."""
        out = np.zeros(self.num_packs, dtype=np.int64)
        np.maximum.at(out, self.pack, self.end - self.start)
        return out

    def widest_padded(self) -> tuple[int, int]:
        """(pieces, longest piece) of the pack whose pieces padded to its longest make the largest
        batch: what the memory estimate sizes a hybrid's mixers by on raypack's torch path, at
        most what its length buckets run (raypack/model/mixer_buckets.py)."""
        counts = np.bincount(self.pack, minlength=self.num_packs)
        longest = self.pack_max_piece()
        worst = int(np.argmax(counts * longest)) if len(counts) else 0
        return (int(counts[worst]), int(longest[worst])) if len(counts) else (0, 0)

    def stats(self) -> dict[str, Any]:
        return plan_stats(self)

    def to_table(self) -> pa.Table:
        return pa.table(
            {
                "example_id": self.example,
                "pack": self.pack,
                "rank": self.rank,
                "step": self.step,
                "start": self.start,
                "end": self.end,
            }
        )


# --- from a Packing to a Plan ---------------------------------------------------------------------


def check_lengths(lengths: np.ndarray, budget: int, splits: bool, name: str) -> np.ndarray:
    """`lengths` as int64, or a ValueError naming what is wrong with it for strategy `name`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be a 1-d array, got shape {lengths.shape}")
    if len(lengths) and lengths.min() < 1:
        raise ValueError(f"every length must be >= 1, got {lengths.min()}")
    if len(lengths) and not splits and lengths.max() > budget:
        raise ValueError(f"{name}: length {lengths.max()} exceeds budget {budget}; apply the over-length policy first")
    return lengths


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
        # Members of every pack, in index order, from one sort: a scan of the whole array per
        # chosen pack took 8 s for 511 splits of 10M pieces (512 ranks).
        by_pack = stable_argsort(pack)
        first = np.concatenate(([0], np.cumsum(sizes)))
        for p in chosen.tolist():
            idx = by_pack[first[p] : first[p + 1]]
            run = np.cumsum(end[idx] - start[idx])
            cut = int(np.clip(np.searchsorted(run, run[-1] / 2), 1, len(idx) - 1))
            pack[idx[cut:]] = num_packs
            num_packs += 1
        need -= take
    return Packing(example, start, end, pack, num_packs + need)


def place(packing: Packing, cell: np.ndarray, num_ranks: int, *, strategy: str, budget: int,
          padded: bool, reset_positions: bool) -> Plan:
    """The Plan that puts pack p of `packing` in grid cell `cell[p]` (= step * num_ranks + rank)."""
    pack = cell[packing.pack]
    order = stable_argsort(pack)  # keeps each pack's pieces in pack order
    pack = pack[order]
    return Plan(
        strategy=strategy,
        budget=budget,
        num_ranks=num_ranks,
        num_steps=packing.num_packs // num_ranks,
        padded=padded,
        reset_positions=reset_positions,
        example=packing.example[order],
        start=packing.start[order],
        end=packing.end[order],
        pack=pack,
        rank=pack % num_ranks,
        step=pack // num_ranks,
    )


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative ints below 2**32 as two 16-bit radix passes (numpy radix
    sorts 16-bit keys; int64 keys would take timsort, ~5x slower on 10M)."""
    if len(keys) == 0 or keys.max() < 2**16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    if keys.max() >= 2**32:
        return np.argsort(keys, kind="stable")
    low = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    return low[np.argsort((keys[low] >> 16).astype(np.uint16), kind="stable")]


# --- after placement ------------------------------------------------------------------------------


def fold_accumulation(plan: Plan, num_ranks: int, accum: int) -> Plan:
    """Map a plan over ranks·accum virtual ranks onto `num_ranks` ranks with accum micro-steps each:
    virtual rank v becomes (rank v mod R, micro-step step·accum + v div R). Every optimizer step
    then sees ranks·accum packs balanced together, and every rank the same multiple of accum."""
    if accum == 1:
        return plan
    return dataclasses.replace(
        plan,
        num_ranks=num_ranks,
        num_steps=plan.num_steps * accum,
        rank=plan.rank % num_ranks,
        step=plan.step * accum + plan.rank // num_ranks,
    )


def stack_steps(plans: list[Plan], sizes: list[int]) -> Plan:
    """Plans over consecutive parts of one lengths array (plan k's example i is example i of part
    k, which holds sizes[k] examples) as one plan whose steps are plan 0's, then plan 1's, ...: a
    mixture's eval packs, one source's examples to a step (raypack/data/prepare.py), so each
    step's loss is one source's."""
    first = plans[0]
    offsets, steps = np.cumsum([0, *sizes[:-1]]), np.cumsum([0, *[p.num_steps for p in plans[:-1]]])
    step = np.concatenate([p.step + s for p, s in zip(plans, steps)])
    rank = np.concatenate([p.rank for p in plans])
    return dataclasses.replace(
        first, num_steps=sum(p.num_steps for p in plans), step=step, rank=rank, pack=step * first.num_ranks + rank,
        example=np.concatenate([p.example + o for p, o in zip(plans, offsets)]),
        start=np.concatenate([p.start for p in plans]), end=np.concatenate([p.end for p in plans]),
        seconds=sum(p.seconds for p in plans))


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for every (s, c), without a Python loop: the rows a plan's
    entries (or a mixture's draw) take, as one index array."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)
