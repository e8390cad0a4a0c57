"""Where a packed row's tokens go when the mixers' exact torch path (raypack/model/mixers.py) runs
its examples as padded batches: the examples sorted by length and cut into `BUCKETS` buckets,
each a right-padded batch of its own longest, so the padding is what the cuts leave, not every
example padded to the row's longest.

    row        [a a a a a a a | b | c c | d d d d d d | e e | f]     19 tokens, 6 examples
    one batch  a a a a a a a   b . . . . . .   c c . . . . .        6 x 7 = 42 slots
               d d d d d d .   e e . . . . .   f . . . . . .
    buckets    [b] [f]   [c c] [e e]   [d d d d d d]   [a a a a a a a]
               2 x 1   + 2 x 2       + 1 x 6         + 1 x 7           = 19 slots

Why a fixed number of buckets, and not one call per example or per distinct length: under
DeepSpeed ZeRO-3 every call of a submodule gathers its weights, a collective, so every rank must
call each mixer the same number of times in every micro-batch whatever its examples. A row with
fewer examples than `BUCKETS` leaves some buckets empty; mixers.py calls the layer on a
one-token dummy for each empty one, so the count of calls is always `BUCKETS`; a row of at
least `BUCKETS` examples fills them all (`filled`) and makes no dummy call.

The cuts minimise the padded slots (sum over buckets of examples x longest), found by a small
dynamic programme over the row's distinct lengths on the host, once per batch: the boundaries
are the host copy collate kept, so nothing here reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BUCKETS = 4
"""Calls of each mixer per forward on the torch path. Over every row of raypack's plans of its
synthetic length shapes and the bundled sample (budgets 1k to 16k, `balanced` and `random`), four
buckets leave 1.00x to 1.73x the tokens in padded slots (mean over a plan; 1.92x the worst row),
where one batch costs up to 43x (91x); three leave up to 2.21x, six 1.36x, for two more calls
of every layer (benchmarks/results/hybrid_padding_cpu_20261203.md)."""


@dataclass(frozen=True)
class Buckets:
    """A packed row laid out as up to `BUCKETS` padded batches, one after another in one buffer."""

    shapes: tuple[tuple[int, int], ...]
    """(examples, longest) of each non-empty bucket, shortest first."""
    index: np.ndarray
    """int64, one per row token: its slot in the buffer of the buckets' padded batches."""

    @property
    def slots(self) -> int:
        """Token slots of all the buckets' padded batches together."""
        return sum(n * longest for n, longest in self.shapes)


def cuts(sizes: list[int] | np.ndarray, buckets: int) -> tuple[tuple[int, int], ...]:
    """(examples, longest) of each bucket, shortest first, for examples of `sizes` tokens cut
    into at most `buckets` contiguous runs of the sorted lengths with the fewest padded slots.

    Over distinct lengths only (a run never gains by splitting examples of one length):
    best[k][j] is the fewest slots for the j shortest distinct lengths in k buckets, and a bucket
    from distinct length i to j - 1 costs its examples times length j - 1. Its (m + 1)^2 table is
    small: m distinct lengths sum to at least m^2 / 2 tokens, so m <= 512 for a 128k-token row."""
    values, counts = np.unique(np.asarray(sizes, dtype=np.int64), return_counts=True)
    m = len(values)
    if m == 0:
        return ()
    cum = np.concatenate([[0], np.cumsum(counts)])
    i, j = np.arange(m + 1)[:, None], np.arange(m + 1)[None, :]
    never = np.iinfo(np.int64).max // 4
    cost = np.where(i < j, (cum[j] - cum[i]) * values[np.maximum(j - 1, 0)], never)  # [i, j]
    best = np.full(m + 1, never, dtype=np.int64)
    best[0] = 0
    choices = []
    for _ in range(min(buckets, m)):  # with m distinct lengths, m buckets pad nothing
        total = best[:, None] + cost
        choice = total.argmin(axis=0)
        best = np.minimum(total[choice, np.arange(m + 1)], never)
        choices.append(choice)
    shapes, end = [], m
    for choice in reversed(choices):  # the last bucket ends at the longest length, and so on down
        start = int(choice[end])
        shapes.append((int(cum[end] - cum[start]), int(values[end - 1])))
        end = start
        if end == 0:
            break
    return tuple(reversed(shapes))


def filled(shapes: tuple[tuple[int, int], ...], buckets: int) -> tuple[tuple[int, int], ...]:
    """`shapes` split up to `buckets` buckets where a bucket holds several examples: fewer buckets
    than `buckets` are found only where each holds one length, so a split pads nothing, and it
    spares a call on a dummy (which the scans pad to a whole chunk). The largest bucket first, in
    halves."""
    shapes = list(shapes)
    while len(shapes) < buckets:
        many = [b for b, (n, _) in enumerate(shapes) if n > 1]
        if not many:
            break
        b = max(many, key=lambda b: shapes[b][0] * shapes[b][1])
        n, longest = shapes[b]
        shapes[b:b + 1] = [(n // 2, longest), (n - n // 2, longest)]
    return tuple(shapes)


def layout(sizes: list[int], buckets: int) -> Buckets:
    """The buckets for a row whose examples are `sizes` tokens long, in row order, and where each
    row token goes: example e, the r-th of its bucket (in sorted order), fills slots
    offset + r x longest onwards, right-padded. As many buckets as `buckets` where the row has
    as many examples."""
    sizes_ = np.asarray(sizes, dtype=np.int64)
    shapes = filled(cuts(sizes_, buckets), buckets)
    order = np.argsort(sizes_, kind="stable")
    base = np.empty(len(sizes_), dtype=np.int64)
    first, offset = 0, 0
    for n, longest in shapes:
        base[order[first:first + n]] = offset + np.arange(n) * longest
        first, offset = first + n, offset + n * longest
    starts = np.concatenate([[0], np.cumsum(sizes_)[:-1]])
    index = np.arange(int(sizes_.sum()), dtype=np.int64) + np.repeat(base - starts, sizes_)
    return Buckets(shapes, index)

