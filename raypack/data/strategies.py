"""Packing strategies: small frozen dataclasses, each a pure function from lengths to packs.

    plan = make_plan(lengths, cfg.pack, num_ranks, accum)    # the plan training uses
    plan = get_strategy("bfd", budget=4096).plan(lengths, 8)  # or one picked by name

A strategy's `pack` turns the lengths into a `Packing`; its `layout` evens the pack count out
over the ranks and picks the grid cell of every pack; raypack/data/plan.py places them. The same
picklable objects are what the `raypack plan` dry run compares and what a Tune sweep varies.
`make_plan` is the one way from a PackConfig to a plan: `raypack plan` and data preparation both
call it, with the gradient accumulation folded in, so the plan shown is the plan trained.

Semantics. For the packed strategies (wrapped, wrapped_noreset, random, greedy, bfd, balanced)
a pack is one row of at most `budget` tokens: one micro-batch for one rank at one step. For
pad / pad_sorted / flatten a pack is one minibatch of `batch_size` examples; pad pads it to its
longest example, flatten concatenates the same minibatch into one row, so both have the same
packs and steps. Only `wrapped*` splits examples (into rows of exactly `budget`, the last row
may be short); every other strategy places each example whole, once.

Traits. What the rest of raypack needs to know about a strategy is a class attribute of it, the
one answer everywhere (preflight, the sweep, the workers, the tests):

    padded            rows are padded minibatches, attended with a padding mask (Plan.padded,
                      Prepared.padded on the workers)
    bounded_rows      every row holds at most `budget` tokens (flatten's and pad's minibatches
                      hold `batch_size` examples, however long)
    takes_batch_size  packs are minibatches of `pack.batch_size` examples (what tune.equal_work sizes)
    random_packs      the seed decides which examples share a pack (what pack.repack_each_epoch needs)
    splits_examples, reset_positions   wrapped's pieces; wrapped_noreset's running positions

`check_strategies(cfg)` checks a loaded config's strategy names and the traits its options need;
the command line runs it right after loading a config, and preflight before every run.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from raypack.config import Config, PackConfig
from raypack.data import binpack
from raypack.data.balance import balanced_layout
from raypack.data.pairs import plan_pairs
from raypack.data.plan import Packing, Plan, check_lengths, even_out, fold_accumulation, place
from raypack.errors import ConfigError


@dataclass(frozen=True)
class Strategy:
    """A named, picklable packing strategy: a pure function from lengths to packs."""

    name: ClassVar[str]
    padded: ClassVar[bool] = False
    """Rows are padded minibatches (collated with a padding mask, attended by the model's own SDPA)."""
    bounded_rows: ClassVar[bool] = True
    """Every row holds at most `budget` tokens."""
    takes_batch_size: ClassVar[bool] = False
    """Packs are minibatches of `batch_size` examples (pack.batch_size)."""
    reset_positions: ClassVar[bool] = True
    splits_examples: ClassVar[bool] = False
    random_packs: ClassVar[bool] = False
    """True when the seed decides which examples share a pack (not only where packs go)."""

    budget: int = 1024
    seed: int = 0
    epoch: int = 0
    """Epoch of a per-epoch plan (`pack.repack_each_epoch`); 0 gives the same plan as ever."""

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise ValueError(f"{self.name}: budget must be positive, got {self.budget}")

    def pack(self, lengths: np.ndarray) -> Packing:
        raise NotImplementedError

    def rng(self, stream: int) -> np.random.Generator:
        """The generator of one random choice (`stream`), seeded by (seed, stream[, epoch])."""
        return np.random.default_rng([self.seed, stream] + ([self.epoch] if self.epoch else []))

    def layout(self, packing: Packing, num_ranks: int, attention: np.ndarray | None = None,
               tokens: np.ndarray | None = None) -> tuple[Packing, np.ndarray]:
        """Even the pack count out over the ranks (plan.even_out) and give every pack its cell
        (step * num_ranks + rank); the default cell order is a seeded shuffle. `attention`: each
        piece's attention cost, where it is not its length squared (a pair: raypack/data/pairs.py,
        an image example: raypack/data/tower.py); `tokens`: its linear work, where it is not its
        length (an image example's patches count too)."""
        packing = even_out(packing, num_ranks)
        return packing, self.rng(1).permutation(packing.num_packs)

    def plan(self, lengths: np.ndarray, num_ranks: int, extra: tuple[np.ndarray, np.ndarray] | None = None) -> Plan:
        """Pack `lengths`, even the packs out over `num_ranks` and place them (see plan.py).
        `extra`: per example, the linear work and attention cost its vision tower adds
        (raypack/data/tower.py), which the layout weighs beside its length and length²."""
        t0 = time.perf_counter()
        lengths = check_lengths(lengths, self.budget, self.splits_examples, self.name)
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        packing = self.pack(lengths)
        attention = tokens = None
        if extra is not None and not self.splits_examples:  # image rows are refused for splitting strategies
            size = (packing.end - packing.start).astype(np.float64)
            tokens = size + extra[0][packing.example]
            attention = size * size + extra[1][packing.example]
        packing, cell = self.layout(packing, num_ranks, attention, tokens)
        plan = place(packing, cell, num_ranks, strategy=self.name,
                     budget=self.budget, padded=self.padded, reset_positions=self.reset_positions)
        return dataclasses.replace(plan, seconds=time.perf_counter() - t0)


def _whole(bins: np.ndarray, lengths: np.ndarray, order: np.ndarray | None = None) -> Packing:
    """Packing of whole examples; `order` (default: index order) fixes the order inside packs."""
    example = np.arange(len(lengths), dtype=np.int64) if order is None else order.astype(np.int64)
    pack = bins[example]
    return Packing(example, np.zeros(len(example), np.int64), lengths[example], pack, int(bins.max(initial=-1)) + 1)


@dataclass(frozen=True)
class Pad(Strategy):
    """Minibatches of `batch_size` examples in seeded random order, padded to their longest.

    A fractional `batch_size` B gives minibatches of floor(B) and ceil(B) examples whose mean is
    B (example i of the order goes to minibatch floor(i / B)): the knob a sweep turns to give
    padded trials as many tokens per step as packed ones."""

    name: ClassVar[str] = "pad"
    padded: ClassVar[bool] = True
    bounded_rows: ClassVar[bool] = False
    takes_batch_size: ClassVar[bool] = True
    random_packs: ClassVar[bool] = True
    batch_size: float = 8.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.batch_size >= 1:
            raise ValueError(f"{self.name}: batch_size must be at least 1, got {self.batch_size}")

    def _order(self, lengths: np.ndarray) -> np.ndarray:
        return self.rng(0).permutation(len(lengths))

    def pack(self, lengths: np.ndarray) -> Packing:
        order = self._order(lengths)
        bins = np.empty(len(lengths), dtype=np.int64)
        bins[order] = (np.arange(len(lengths)) // self.batch_size).astype(np.int64)
        return _whole(bins, lengths, order)


@dataclass(frozen=True)
class PadSorted(Pad):
    """`pad` over examples grouped by length (minibatch order is still shuffled)."""

    name: ClassVar[str] = "pad_sorted"
    random_packs: ClassVar[bool] = False

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
    random_packs: ClassVar[bool] = True

    def pack(self, lengths: np.ndarray) -> Packing:
        order = self.rng(0).permutation(len(lengths))
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
    random_packs: ClassVar[bool] = True

    def pack(self, lengths: np.ndarray) -> Packing:
        order = self.rng(0).permutation(len(lengths))
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
    """`bfd` packs laid on the grid so each step's ranks get near-equal tokens and attention cost
    (raypack/data/balance.py); the remainder is dealt into one even step instead of split."""

    name: ClassVar[str] = "balanced"

    def layout(self, packing: Packing, num_ranks: int, attention: np.ndarray | None = None,
               tokens: np.ndarray | None = None) -> tuple[Packing, np.ndarray]:
        return balanced_layout(packing, num_ranks, self.budget, self.seed, attention, tokens)


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (Pad, PadSorted, Flatten, Wrapped, WrappedNoReset, Random, Greedy, BFD, Balanced)
}


def check_strategy_name(name: str, field: str = "pack.strategy") -> None:
    """ConfigError naming `field` unless `name` is a registered strategy."""
    if name not in STRATEGIES:
        raise ConfigError(f"{field}: unknown packing strategy {name!r}; expected one of {', '.join(STRATEGIES)}")


def check_strategies(cfg: Config, source: str = "") -> None:
    """Every strategy `cfg` names is registered (pack.strategy, tune.strategies) and has the traits
    its options need (pack.repack_each_epoch); a ConfigError naming the field, and `source` (the
    config file) when given, otherwise."""
    try:
        check_strategy_name(cfg.pack.strategy, "pack.strategy")
        if cfg.pack.repack_each_epoch:
            check_repack(cfg.pack.strategy, "pack.repack_each_epoch")
        for name in cfg.tune.strategies:
            check_strategy_name(name, "tune.strategies")
        check_split(cfg.pack.strategy, cfg.train.sequence_parallel, "pack.strategy")
        if cfg.train.objective == "dpo":
            check_pairs(cfg.pack.strategy, "pack.strategy")
            for name in cfg.tune.strategies:
                check_pairs(name, "tune.strategies")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def check_split(name: str, sequence_parallel: int, field: str = "pack.strategy") -> None:
    """ConfigError for a padded strategy under train.sequence_parallel > 1: its batches run the
    model's own attention, which the Ulysses exchange (raypack/model/ulysses.py) never reaches."""
    if sequence_parallel > 1 and STRATEGIES[name].padded:
        raise ConfigError(
            f"{field}: {name} pads one example a row and runs the model's own attention, which "
            f"train.sequence_parallel={sequence_parallel} can't split; use a packed strategy"
        )


def check_pairs(name: str, field: str = "pack.strategy") -> None:
    """ConfigError for a strategy that cuts examples into pieces under train.objective: dpo,
    whose pairs must stay whole in one row (raypack/data/pairs.py)."""
    if STRATEGIES[name].splits_examples:
        whole = ", ".join(n for n, s in STRATEGIES.items() if not s.splits_examples)
        raise ConfigError(
            f"{field}: {name} cuts examples into pieces at row ends, which would split a preference pair's "
            f"sequences (train.objective: dpo needs both in one row); use one of {whole}"
        )


def check_repack(name: str, field: str = "pack.repack_each_epoch") -> None:
    """ConfigError unless strategy `name` packs differently with another seed: for the others a
    per-epoch plan would repeat the same packs, and every epoch already gets a new step order."""
    if not STRATEGIES[name].random_packs:
        takes = ", ".join(n for n, s in STRATEGIES.items() if s.random_packs)
        raise ConfigError(
            f"{field}: {name} packs the same examples together whatever the seed, so a new plan per "
            f"epoch would only repeat its packs; every epoch already trains them in a new step order. "
            f"Set it to false, or use a strategy with random packs ({takes})."
        )


def get_strategy(name: str, **params: Any) -> Strategy:
    """Strategy by name. Params it does not take (e.g. `batch_size` for bfd) are ignored, so one
    set of params (a PackConfig's) serves every strategy in a sweep."""
    check_strategy_name(name, "strategy")
    cls = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


def from_config(cfg: PackConfig, name: str | None = None, epoch: int = 0) -> Strategy:
    """The strategy a PackConfig names (or `name`, e.g. a Tune trial's choice) with its params;
    `epoch` > 0 gives that epoch's plan under `pack.repack_each_epoch`."""
    return get_strategy(name or cfg.strategy, budget=cfg.budget, batch_size=cfg.batch_size, seed=cfg.seed,
                        epoch=epoch)


def make_plan(lengths: np.ndarray, cfg: PackConfig, num_ranks: int, accum: int = 1, epoch: int = 0,
              pairs: bool = False, extra: tuple[np.ndarray, np.ndarray] | None = None) -> Plan:
    """The plan training uses for `cfg` over `lengths` on `num_ranks` ranks with `accum` micro-steps
    per optimizer step: planned over num_ranks x accum virtual ranks, so every optimizer step's
    packs are balanced together, then folded (plan.fold_accumulation). `epoch` as in from_config.
    `pairs`: `lengths` are preference pairs' (chosen, rejected) lengths, each pair one item whose
    two sequences share a pack (raypack/data/pairs.py). `extra`: per example, what its vision
    tower adds to its linear work and attention cost (`tower.TowerCost.extra`), for `balanced`."""
    if accum <= 0:
        raise ValueError(f"accum must be positive, got {accum}")
    t0 = time.perf_counter()
    strategy = from_config(cfg, epoch=epoch)
    if pairs:
        check_pairs(strategy.name)
        plan = plan_pairs(strategy, np.asarray(lengths), num_ranks * accum, extra)
    else:
        plan = strategy.plan(np.asarray(lengths), num_ranks * accum, extra)
    plan = fold_accumulation(plan, num_ranks, accum)
    return dataclasses.replace(plan, seconds=time.perf_counter() - t0)
