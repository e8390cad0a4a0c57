"""Global packing plan: which examples share a pack, and which rank trains each pack at which step.

The planner sees only lengths (one int per example, index i = the i-th smallest `example_id`).
A strategy turns them into packs; `make_plan` then evens the pack count out over the ranks and
lays the packs on a (step, rank) grid, one pack per cell:

    lengths [5 3 7 2 4 ...]            budget 10, 2 ranks
        |  strategy (bfd, balanced, pad, ...)
        v
    packs   p0=[ex2 ex0]  p1=[ex4 ex1 ex3]  p2=[...]  ...
        |  remainder: split / empty packs until #packs % ranks == 0
        v
    grid        rank 0      rank 1
      step 0    [ex2 ex0]   [ex4 ex1 ex3]
      step 1    [...]       [...]

Semantics. For the packed strategies (wrapped, wrapped_noreset, random, greedy, bfd, balanced)
a pack is one row of at most `budget` tokens: one micro-batch for one rank at one step. For
pad / pad_sorted / flatten a pack is one minibatch of `batch_size` examples; pad pads it to its
longest example, flatten concatenates the same minibatch into one row, so both have the same
packs and steps. Only `wrapped*` splits examples (into rows of exactly `budget`, the last row
may be short); every other strategy places each example whole, once.

Remainder. Ranks must all run the same number of steps, and no example may be dropped. When the
pack count is not a multiple of `num_ranks`, the pack with the most tokens that holds at least
two pieces is split in two (at the piece where its tokens pass half), repeatedly, until it is.
When no pack can be split any more (fewer pieces than cells), empty packs fill the grid; the pack
stage turns an empty pack into a 1-token row whose label is -100, so it adds zero loss.

Order. Steps are shuffled with `seed` so training never runs sorted by length; ranks within a
step are shuffled too. Everything is seeded: the same lengths, config and rank count rebuild
exactly the same plan (a resumed run relies on it).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from raypack.data import binpack
from raypack.data.balance import Packing, balanced_cells, even_out, stable_argsort


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

    def stats(self) -> dict[str, Any]:
        from raypack.data.stats import plan_stats

        return plan_stats(self)

    def to_table(self):
        import pyarrow as pa

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

    def write_parquet(self, path: str) -> None:
        import pyarrow.parquet as pq

        pq.write_table(self.to_table(), path)


# --- strategies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """A named, picklable packing strategy: a pure function from lengths to packs."""

    name: ClassVar[str]
    padded: ClassVar[bool] = False
    reset_positions: ClassVar[bool] = True
    splits_examples: ClassVar[bool] = False

    budget: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise ValueError(f"{self.name}: budget must be positive, got {self.budget}")

    def pack(self, lengths: np.ndarray) -> Packing:
        raise NotImplementedError

    def arrange(self, packing: Packing, lengths: np.ndarray, num_ranks: int) -> np.ndarray:
        """Cell (step * num_ranks + rank) of every pack; the default is a seeded shuffle."""
        rng = np.random.default_rng([self.seed, 1])
        return rng.permutation(packing.num_packs)

    def plan(self, lengths: np.ndarray, num_ranks: int) -> Plan:
        t0 = time.perf_counter()
        lengths = _check_lengths(lengths, self.budget, self.splits_examples, self.name)
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        packing = even_out(self.pack(lengths), num_ranks)
        plan = _place(self, packing, self.arrange(packing, lengths, num_ranks), num_ranks)
        return dataclasses.replace(plan, seconds=time.perf_counter() - t0)


def _whole(bins: np.ndarray, lengths: np.ndarray, order: np.ndarray | None = None) -> Packing:
    """Packing of whole examples; `order` (default: index order) fixes the order inside packs."""
    example = np.arange(len(lengths), dtype=np.int64) if order is None else order.astype(np.int64)
    pack = bins[example]
    return Packing(example, np.zeros(len(example), np.int64), lengths[example], pack, int(bins.max(initial=-1)) + 1)


@dataclass(frozen=True)
class Pad(Strategy):
    """Minibatches of `batch_size` examples in seeded random order, padded to their longest."""

    name: ClassVar[str] = "pad"
    padded: ClassVar[bool] = True
    batch_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size <= 0:
            raise ValueError(f"{self.name}: batch_size must be positive, got {self.batch_size}")

    def _order(self, lengths: np.ndarray) -> np.ndarray:
        return np.random.default_rng([self.seed, 0]).permutation(len(lengths))

    def pack(self, lengths: np.ndarray) -> Packing:
        order = self._order(lengths)
        bins = np.empty(len(lengths), dtype=np.int64)
        bins[order] = np.arange(len(lengths)) // self.batch_size
        return _whole(bins, lengths, order)


@dataclass(frozen=True)
class PadSorted(Pad):
    """`pad` over examples grouped by length (minibatch order is still shuffled)."""

    name: ClassVar[str] = "pad_sorted"

    def _order(self, lengths: np.ndarray) -> np.ndarray:
        return binpack.descending_order(lengths, self.budget)


@dataclass(frozen=True)
class Flatten(Pad):
    """`pad`'s minibatches concatenated into one row each (HF DataCollatorWithFlattening)."""

    name: ClassVar[str] = "flatten"
    padded: ClassVar[bool] = False


@dataclass(frozen=True)
class Wrapped(Strategy):
    """Concatenate the shuffled stream and cut rows of exactly `budget`, splitting examples."""

    name: ClassVar[str] = "wrapped"
    splits_examples: ClassVar[bool] = True

    def pack(self, lengths: np.ndarray) -> Packing:
        order = np.random.default_rng([self.seed, 0]).permutation(len(lengths))
        ex_start = np.concatenate(([0], np.cumsum(lengths[order])))
        total = int(ex_start[-1])
        rows = np.arange(0, total + 1, self.budget)
        at = np.searchsorted(ex_start, rows)
        inner = ex_start[np.minimum(at, len(ex_start) - 1)] != rows  # row cuts inside an example
        cuts = np.insert(ex_start, at[inner], rows[inner])  # a merge, not a sort
        is_example_start = np.insert(np.ones(len(ex_start), bool), at[inner], False)
        lo, hi = cuts[:-1], cuts[1:]
        k = np.cumsum(is_example_start[:-1]) - 1  # position in the stream of each piece's example
        return Packing(order[k].astype(np.int64), lo - ex_start[k], hi - ex_start[k], lo // self.budget,
                       -(-total // self.budget))


@dataclass(frozen=True)
class WrappedNoReset(Wrapped):
    """`wrapped` with positions running on across examples: the cross-contamination baseline."""

    name: ClassVar[str] = "wrapped_noreset"
    reset_positions: ClassVar[bool] = False


@dataclass(frozen=True)
class Random(Strategy):
    """Random order, next fit into the budget (2410.08081's random packing)."""

    name: ClassVar[str] = "random"

    def pack(self, lengths: np.ndarray) -> Packing:
        order = np.random.default_rng([self.seed, 0]).permutation(len(lengths))
        bins = np.empty(len(lengths), dtype=np.int64)
        bins[order] = binpack.next_fit(lengths[order], self.budget)
        return _whole(bins, lengths, order)


@dataclass(frozen=True)
class Greedy(Strategy):
    """Longest first, first fit (2410.08081's greedy packing)."""

    name: ClassVar[str] = "greedy"

    def pack(self, lengths: np.ndarray) -> Packing:
        return _whole(binpack.first_fit_decreasing(lengths, self.budget), lengths,
                      binpack.descending_order(lengths, self.budget))


@dataclass(frozen=True)
class BFD(Strategy):
    """Best-fit decreasing over the whole dataset (bucketed by remaining capacity)."""

    name: ClassVar[str] = "bfd"

    def pack(self, lengths: np.ndarray) -> Packing:
        return _whole(binpack.best_fit_decreasing(lengths, self.budget), lengths,
                      binpack.descending_order(lengths, self.budget))


@dataclass(frozen=True)
class Balanced(BFD):
    """`bfd` packs laid on the grid so each step's ranks get near-equal tokens and attention cost."""

    name: ClassVar[str] = "balanced"

    def arrange(self, packing: Packing, lengths: np.ndarray, num_ranks: int) -> np.ndarray:
        return balanced_cells(packing, num_ranks, self.budget, self.seed)


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (Pad, PadSorted, Flatten, Wrapped, WrappedNoReset, Random, Greedy, BFD, Balanced)
}


def get_strategy(name: str, **params: Any) -> Strategy:
    """Strategy by name. Params it does not take (e.g. `batch_size` for bfd) are ignored, so one
    set of params (a PackConfig's) serves every strategy in a sweep."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown packing strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


def from_config(cfg, name: str | None = None) -> Strategy:
    """The strategy a PackConfig names (or `name`, e.g. a Tune trial's choice) with its params."""
    return get_strategy(name or cfg.strategy, budget=cfg.budget, batch_size=cfg.batch_size, seed=cfg.seed)


def make_plan(lengths: np.ndarray, cfg, num_ranks: int) -> Plan:
    """The plan for `cfg` (a PackConfig: strategy, budget, batch_size, seed) over `lengths`."""
    return from_config(cfg).plan(np.asarray(lengths), num_ranks)


# --- placement -------------------------------------------------------------------------------------


def _check_lengths(lengths: np.ndarray, budget: int, splits: bool, name: str) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be a 1-d array, got shape {lengths.shape}")
    if len(lengths) and lengths.min() < 1:
        raise ValueError(f"every length must be >= 1, got {lengths.min()}")
    if len(lengths) and not splits and lengths.max() > budget:
        raise ValueError(f"{name}: length {lengths.max()} exceeds budget {budget}; apply the over-length policy first")
    return lengths


def _place(strategy: Strategy, packing: Packing, cell: np.ndarray, num_ranks: int) -> Plan:
    pack = cell[packing.pack]
    order = stable_argsort(pack)  # keeps each pack's pieces in pack order
    pack = pack[order]
    return Plan(
        strategy=strategy.name,
        budget=strategy.budget,
        num_ranks=num_ranks,
        num_steps=packing.num_packs // num_ranks,
        padded=strategy.padded,
        reset_positions=strategy.reset_positions,
        example=packing.example[order],
        start=packing.start[order],
        end=packing.end[order],
        pack=pack,
        rank=pack % num_ranks,
        step=pack // num_ranks,
    )
