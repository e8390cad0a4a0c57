"""The bin-packing kernels against textbook first-fit and best-fit decreasing."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from raypack.data import binpack

from planning import problems


def _naive(lengths, budget, best):
    caps = []
    for n in sorted(lengths.tolist(), reverse=True):
        fits = [b for b, c in enumerate(caps) if c >= n]
        if not fits:
            caps.append(budget)
            fits = [len(caps) - 1]
        b = min(fits, key=lambda b: caps[b]) if best else fits[0]
        caps[b] -= n
    return len(caps)


@settings(max_examples=80, deadline=None)
@given(problems())
def test_decreasing_kernels_match_the_textbook_algorithms(problem):
    lengths, budget, *_ = problem
    for kernel, best in ((binpack.best_fit_decreasing, True), (lambda l, b: binpack.first_fit_decreasing(l, b, block=4), False)):
        bins = kernel(lengths, budget)
        count = int(bins.max(initial=-1)) + 1
        assert count == _naive(lengths, budget, best)
        assert (np.bincount(bins, weights=lengths, minlength=count) <= budget).all()
    bins = binpack.next_fit(lengths, budget, window=3)
    if len(lengths):
        assert (np.bincount(bins, weights=lengths) <= budget).all() and (np.diff(bins) >= 0).all()
