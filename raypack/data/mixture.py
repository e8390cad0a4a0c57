"""Several datasets mixed by weight (`data.sources`): which source each example comes from, how many
of each an epoch holds, the seeded draw, and what each source contributes.

    parts = split(tok, cfg, sources)           # the eval split and an epoch's draw: what prepare and plan use
    mix = Mixture.of(cfg.data, sources)        # None for data.paths (one source)
    take = mix.draw(ids, cfg.pack.seed)        # indexes into ids: an epoch's examples, repeats included
    figures = mix.figures(ids, take, labels)   # per source: examples drawn, label tokens, shares

The unit of the draw is the source row, an example as it came: a split example's pieces and a
preference pair's two sequences are drawn, and repeated, together. For source k with n_k training
rows (its eval split held out first, raypack/data/holdout.py) and weights w:

    N        = data.examples_per_epoch: `sum` Σ n_k; `first_exhausted` the largest N with no count
               above its n_k; `all_exhausted` the smallest with none below; or a number
    count_k  = w_k / Σw × N, rounded by largest remainder (ties to the first source): Σ count_k = N
    the draw = count_k // n_k copies of every row of k, and count_k % n_k of its rows once more,
               a seeded choice without repeats (seeded by pack.seed and k)

so a weight that asks for more than a source holds repeats every row of it evenly (each
count_k // n_k times, some once more); counts are exact, not the expectation of a random stream (Hugging
Face `interleave_datasets`, LLaMA-Factory's `interleave_probs`). Without weights every row of every
source is taken once: their concatenation, as TRL's and Axolotl's dataset lists are. One draw
serves every epoch (one set of packed rows does: raypack/data/shards.py); each epoch reads it in
its own order. A source the weights give less than one example, or one with no training example
left, is an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from raypack.config import Config, DataConfig
from raypack.data.holdout import held_out_mask
from raypack.data.listing import Sources
from raypack.data.plan import concat_ranges
from raypack.data.sources import FILE_SHIFT, ROW_SHIFT
from raypack.errors import InputError

if TYPE_CHECKING:  # Ray Data's import takes seconds: preflight asks this module before it needs it
    from raypack.data.cache import Tokenized

DRAW_STREAM = 0x6D6978
"""Mixed into the draw's seed, so it is not the stream any packing strategy draws from pack.seed."""


@dataclass(frozen=True)
class Mixture:
    """The sources of `data.sources` as the data stages see them."""

    names: tuple[str, ...]
    labels: tuple[str, ...]
    """How messages name each source: its index and paths (`config.source_where`)."""
    weights: tuple[float, ...] | None
    """None: no weights, every example once (concatenation)."""
    examples_per_epoch: str | int
    owners: np.ndarray
    """The source of every file, by file index (`Sources.owners`)."""

    @classmethod
    def of(cls, data: DataConfig, sources: Sources) -> Mixture | None:
        if not data.sources:
            return None
        weights = tuple(s.weight for s in data.sources)
        return cls(names=source_names(data), labels=sources.labels,
                   weights=None if weights[0] is None else weights, examples_per_epoch=data.examples_per_epoch,
                   owners=np.asarray(sources.owners, dtype=np.int64))

    def owner(self, ids: np.ndarray) -> np.ndarray:
        """The source index of every example id."""
        return self.owners[np.asarray(ids, dtype=np.int64) >> FILE_SHIFT]

    def counts(self, available: np.ndarray, most: bool = False) -> np.ndarray:
        """Source rows of each source in an epoch, given the training rows each holds. `most`:
        `available` are the most each could hold (preflight's good rows, before the eval split and
        tokenize's drops), so that a quota below one there is below one in the draw too."""
        n = np.asarray(available, dtype=np.int64)
        if self.weights is None:
            return n.copy()
        share = np.asarray(self.weights, dtype=np.float64) / sum(self.weights)
        for k in np.flatnonzero(n == 0):
            raise InputError(f"{self.labels[k]}: no training example left to draw (its rows were all held out for "
                             "eval or dropped by tokenize); give it more rows or remove it")
        rule = self.examples_per_epoch
        # a hair of slack: n / share can land a rounding error below the whole number it is
        total = (int(n.sum()) if rule == "sum" else int(np.floor((n / share).min() + 1e-9)) if rule == "first_exhausted"
                 else int(np.ceil((n / share).max() - 1e-9)) if rule == "all_exhausted" else int(rule))
        quota = share * total
        counts = np.floor(quota).astype(np.int64)
        order = np.lexsort((np.arange(len(n)), -(quota - counts)))  # largest remainder, then source order
        counts[order[: total - int(counts.sum())]] += 1
        if rule == "first_exhausted":
            counts = np.minimum(counts, n)
        elif rule == "all_exhausted":
            counts = np.maximum(counts, n)
        for k in np.flatnonzero(quota < 1):
            most_ = "at most " if most else ""
            raise InputError(
                f"{self.labels[k]}: weight {self.weights[k]:g} of {sum(self.weights):g} names {most_}{quota[k]:.2g} of "
                f"the {most_}{total:,} examples of an epoch (data.examples_per_epoch={rule}), less than one; raise its "
                "weight")
        return counts

    def draw(self, ids: np.ndarray, seed: int) -> np.ndarray:
        """Indexes into `ids` (example ids in example_id order, eval held out) of an epoch's
        examples: each drawn source row's pieces, once per copy, ordered by (row, copy, piece)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.weights is None:
            return np.arange(len(ids))
        rows, first, pieces = np.unique(ids >> ROW_SHIFT, return_index=True, return_counts=True)
        row_owner = self.owner(rows << ROW_SHIFT)
        available = np.bincount(row_owner, minlength=len(self.names))
        times = np.zeros(len(rows), dtype=np.int64)
        for k, count in enumerate(self.counts(available)):
            mine = np.flatnonzero(row_owner == k)
            copies, more = divmod(int(count), len(mine))
            times[mine] = copies
            rng = np.random.default_rng([seed, k, DRAW_STREAM])
            times[mine[np.sort(rng.permutation(len(mine))[:more])]] += 1
        row = np.repeat(np.arange(len(rows)), times)
        return concat_ranges(first[row], pieces[row])

    def figures(self, ids: np.ndarray, take: np.ndarray, labels: np.ndarray | None,
                held_out: np.ndarray | None = None) -> list[dict[str, Any]]:
        """What each source contributes to an epoch: {name, weight, available (training rows),
        examples (rows drawn), label_tokens (None where not counted), share (of the examples),
        label_share, eval_examples}. `ids`: the training examples `take` indexes; `held_out`: the
        ids held out for eval."""
        ids = np.asarray(ids, dtype=np.int64)
        k = len(self.names)
        keys, first = np.unique(ids >> ROW_SHIFT, return_index=True)
        available = np.bincount(self.owner(keys << ROW_SHIFT), minlength=k)
        starts = np.zeros(len(ids), dtype=bool)
        starts[first] = True  # a row's first piece: one in `take` per copy of the row drawn
        owner = self.owner(ids[take])
        rows = np.bincount(owner[starts[take]], minlength=k)
        tokens = None if labels is None else np.bincount(owner, weights=np.asarray(labels)[take], minlength=k)
        evals = (np.bincount(self.owner(np.unique(np.asarray(held_out) >> ROW_SHIFT) << ROW_SHIFT), minlength=k)
                 if held_out is not None and len(held_out) else np.zeros(k, int))
        return [{"name": self.names[i], "weight": None if self.weights is None else self.weights[i],
                 "available": int(available[i]), "examples": int(rows[i]),
                 "label_tokens": None if tokens is None else int(tokens[i]),
                 "share": float(rows[i] / max(rows.sum(), 1)),
                 "label_share": None if tokens is None else float(tokens[i] / max(tokens.sum(), 1)),
                 "eval_examples": int(evals[i])} for i in range(k)]


@dataclass(frozen=True)
class Split:
    """Which of the tokenized examples are held out for eval, and which an epoch trains on."""

    held_out: np.ndarray
    """Per example of `tok.ids`: held out for eval (a mixture's, per source)."""
    take: np.ndarray
    """Indexes into `tok.ids` of an epoch's training examples, in example_id order; a weighted
    mixture's draw repeats some and leaves others out (raypack/data/mixture.py)."""
    mixture: Mixture | None
    owner: np.ndarray | None
    """A mixture's source of every example of `tok.ids`."""

    def figures(self, tok: Tokenized) -> list[dict[str, Any]]:
        """What each source of a mixture contributes (`Mixture.figures`); [] for data.paths."""
        if self.mixture is None:
            return []
        train = np.flatnonzero(~self.held_out)
        within = np.searchsorted(train, self.take)  # `take` as indexes into the training examples
        labels = None if tok.labels is None else tok.labels[train]
        return self.mixture.figures(tok.ids[train], within, labels, tok.ids[self.held_out])


def split(tok: Tokenized, cfg: Config, sources: Sources) -> Split:
    """The eval split and an epoch's training examples of `tok` (`sources`: its listing)."""
    mixture = Mixture.of(cfg.data, sources)
    owner = mixture.owner(tok.ids) if mixture is not None else None
    held_out = held_out_mask(tok.ids, cfg, owner)
    take = np.flatnonzero(~held_out)
    if mixture is not None:
        take = take[mixture.draw(tok.ids[take], cfg.pack.seed)]
    return Split(held_out, take, mixture, owner)


def lines(figures: list[dict[str, Any]], examples_per_epoch: str | int, prefix: str = "") -> list[str]:
    """The mixture's lines for the prepare summary and `raypack plan`: one for the epoch, one per source."""
    total = sum(f["examples"] for f in figures)
    weighted = figures[0]["weight"] is not None
    how = f"by weight, data.examples_per_epoch={examples_per_epoch}" if weighted else "no weights: each example once"
    out = [f"{prefix}mixture of {len(figures)} sources: {total:,} examples an epoch ({how})"]
    width = max(len(f["name"]) for f in figures)
    for f in figures:
        n, c = f["available"], f["examples"]
        drawn = (f"all {n:,}, each once" if c == n else f"{c:,} of its {n:,}, none twice" if c < n
                 else f"{c:,} from its {n:,}, each {c // n}" + (f" or {c // n + 1}" if c % n else "") + " times")
        tokens = ("label tokens not counted" if f["label_tokens"] is None
                  else f"{f['label_tokens']:,} label tokens ({f['label_share']:.1%})")
        weight = f"weight {f['weight']:g}, " if weighted else ""
        out.append(f"{prefix}  {f['name']:<{width}}  {weight}{drawn}: {f['share']:.1%} of the examples; {tokens}; "
                   f"{f['eval_examples']:,} held out for eval")
    return out


def print_mixture(figures: list[dict[str, Any]] | None, data: DataConfig) -> None:
    """What each source of a mixture contributes, as prepare (the start of every run) says it."""
    for line in lines(figures, data.examples_per_epoch, "[raypack] ") if figures else []:
        print(line, flush=True)


def source_names(data: DataConfig) -> tuple[str, ...]:
    """Each source's `name`, or its first path's file name without extension, made unique by `-N`
    (N its index) where two would share one."""
    stems = [s.name or PurePosixPath(s.paths[0].rstrip("/")).name.split(".")[0] or f"source{i}"
             for i, s in enumerate(data.sources)]
    names = [n if s.name or stems.count(n) == 1 else f"{n}-{i}" for i, (n, s) in enumerate(zip(stems, data.sources))]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise InputError(f"data.sources[{i}].name: {n!r} names data.sources[{names.index(n)}] too; give each "
                             "source its own name")
    return tuple(names)
