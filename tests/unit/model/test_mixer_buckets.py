"""The torch path's length buckets (raypack/model/mixer_buckets.py): the fewest padded slots, and
where each token goes. The mixers' exactness over them is tests/unit/model/test_mixers.py's and
test_families.py's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raypack.model.mixer_buckets import BUCKETS, cuts, layout


def _brute_force(sizes: list[int], buckets: int) -> int:
    """The fewest slots over every cut of the sorted lengths into at most `buckets` runs."""
    ordered, best = sorted(sizes), None
    for k in range(1, min(buckets, len(sizes)) + 1):
        for points in itertools.combinations(range(1, len(sizes)), k - 1):
            edges = (0, *points, len(sizes))
            slots = sum((b - a) * ordered[b - 1] for a, b in zip(edges[:-1], edges[1:]))
            best = slots if best is None else min(best, slots)
    return best


@pytest.mark.parametrize("buckets", [1, 2, 3, 4])
def test_the_cuts_pad_no_more_than_the_best_cut_found_by_trying_them_all(buckets):
    rng = np.random.default_rng(buckets)
    for _ in range(60):
        sizes = rng.integers(1, 40, size=int(rng.integers(1, 9))).tolist()
        shapes = cuts(sizes, buckets)
        assert sum(n * longest for n, longest in shapes) == _brute_force(sizes, buckets), sizes
        assert sum(n for n, _ in shapes) == len(sizes) and len(shapes) <= buckets
        assert [longest for _, longest in shapes] == sorted({longest for _, longest in shapes})


def test_a_long_example_among_short_ones_pads_to_the_short_ones_longest():
    """The brief's row: one 4000-token example and thirty of 100 run 7000 slots, not 31 x 4000."""
    found = layout([100] * 15 + [4000] + [100] * 15, BUCKETS)
    assert cuts([100] * 15 + [4000] + [100] * 15, BUCKETS) == ((30, 100), (1, 4000))
    assert found.slots == 7000 and [longest for _, longest in found.shapes] == [100, 100, 100, 4000]
    assert cuts([], BUCKETS) == ()


def test_buckets_of_one_length_are_split_so_no_dummy_call_is_needed():
    """Fewer distinct lengths than buckets: the cuts need fewer buckets, and splitting one of a
    single length pads nothing; only a row of fewer examples than buckets leaves one empty."""
    assert cuts([5, 5, 5, 9, 9], 4) == ((3, 5), (2, 9))
    assert layout([5, 5, 5, 9, 9], 4).shapes == ((1, 5), (2, 5), (1, 9), (1, 9))
    assert layout([5, 5, 5, 9, 9], 4).slots == 33
    assert layout([7, 7], 4).shapes == ((1, 7), (1, 7))


def test_every_token_has_its_own_slot_in_its_examples_row_from_the_rows_start():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 300, size=57).tolist()
    found = layout(sizes, BUCKETS)
    assert len(found.index) == sum(sizes) and len(set(found.index.tolist())) == sum(sizes)
    assert found.index.min() >= 0 and found.index.max() < found.slots
    rows = {}  # slot where each row of each bucket starts -> its length
    offset = 0
    for n, longest in found.shapes:
        rows.update({offset + r * longest: longest for r in range(n)})
        offset += n * longest
    start = 0
    for size in sizes:
        slots = found.index[start:start + size]
        assert slots[0] in rows and size <= rows[slots[0]]  # from its row's start, within it
        assert (np.diff(slots) == 1).all()  # in order, right-padded
        start += size

