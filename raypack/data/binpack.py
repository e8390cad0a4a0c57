"""Bin-packing kernels over a numpy array of lengths: the pure functions behind the strategies.

Each kernel returns `bins`, an int64 array with the bin of every item (bins numbered 0..n_bins-1
in the order they were opened). Nothing here knows about ranks, steps or configs;
`strategies.py` wraps these kernels in strategies.

Speed comes from one observation: lengths are integers no larger than the budget and are
heavily repeated (10M lengths hold at most `budget` distinct values). The decreasing kernels
therefore walk the *runs* of equal length, longest first, and place a whole run at once:

- best fit: an item goes to the open bin with the smallest remaining capacity >= L. After it is
  placed the same bin, now at capacity c - L, is still the best fit while c - L >= L, so a bin at
  capacity c takes c // L items of the run in a row. Bins are kept in buckets by remaining
  capacity (0..budget), so a run visits only the nonempty buckets >= L in ascending order and
  moves whole buckets at a time: O(distinct lengths x touched buckets), not O(items).
- first fit: the same run logic over bins in opening order, with a per-block maximum capacity
  so that a run only scans blocks that can take it.
"""

from __future__ import annotations

import bisect

import numpy as np


def descending_order(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Indices that sort `lengths` longest first, ties in index order (radix sort when it can)."""
    if budget < 2**16:
        return np.argsort((budget - lengths).astype(np.uint16), kind="stable")
    return np.argsort(-lengths, kind="stable")


def _runs(sorted_lengths: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """(value, start, count) of each run of equal values in a sorted array."""
    if len(sorted_lengths) == 0:
        return [], [], []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_lengths)) + 1))
    counts = np.diff(np.append(starts, len(sorted_lengths)))
    return sorted_lengths[starts].tolist(), starts.tolist(), counts.tolist()


def best_fit_decreasing(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Best-fit decreasing. Every length must be in [1, budget]."""
    n = len(lengths)
    order = descending_order(lengths, budget)
    sorted_bins = np.empty(n, dtype=np.int64)
    count = np.zeros(budget + 1, dtype=np.int64)  # open bins per remaining capacity
    members: list[list[np.ndarray]] = [[] for _ in range(budget + 1)]  # their ids, in chunks
    n_bins = 0
    for length, start, run in zip(*_runs(lengths[order])):
        segments, todo = [], run
        for cap in (np.flatnonzero(count[length:]) + length).tolist():
            per_bin = cap // length
            chunks = members[cap]
            k = int(count[cap])
            if todo >= k * per_bin:  # the run empties this bucket
                ids = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
                segments.append(np.repeat(ids, per_bin) if per_bin > 1 else ids)
                rest = cap - per_bin * length
                members[rest].extend(chunks)
                count[rest] += k
                members[cap], count[cap] = [], 0
                todo -= k * per_bin
            else:  # the run ends inside this bucket
                ids = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
                full, part = divmod(todo, per_bin)
                used = full + (part > 0)
                segments.append(np.repeat(ids[:used], per_bin)[:todo])
                if full:
                    members[cap - per_bin * length].append(ids[:full])
                    count[cap - per_bin * length] += full
                if part:
                    members[cap - part * length].append(ids[full:used])
                    count[cap - part * length] += 1
                members[cap] = [ids[used:]] if used < k else []
                count[cap] = k - used
                todo = 0
            if todo == 0:
                break
        if todo:  # open new bins; each new bin is the best fit until it cannot take another
            per_bin = budget // length
            full, part = divmod(todo, per_bin)
            new = np.arange(n_bins, n_bins + full + (part > 0), dtype=np.int64)
            segments.append(np.repeat(new, per_bin)[:todo])
            if full:
                members[budget - per_bin * length].append(new[:full])
                count[budget - per_bin * length] += full
            if part:
                members[budget - part * length].append(new[full:])
                count[budget - part * length] += 1
            n_bins += len(new)
        sorted_bins[start : start + run] = segments[0] if len(segments) == 1 else np.concatenate(segments)
    bins = np.empty(n, dtype=np.int64)
    bins[order] = sorted_bins
    return bins


def first_fit_decreasing(lengths: np.ndarray, budget: int, block: int = 2048) -> np.ndarray:
    """First-fit decreasing (the papers' "greedy" packing). Every length must be in [1, budget]."""
    n = len(lengths)
    order = descending_order(lengths, budget)
    sorted_bins = np.empty(n, dtype=np.int64)
    caps = np.zeros(max(n, 1), dtype=np.int64)  # remaining capacity per bin (at most n bins)
    block_max = np.full((len(caps) + block - 1) // block, -1, dtype=np.int64)
    n_bins = 0
    for length, start, run in zip(*_runs(lengths[order])):
        segments, todo = [], run
        for b in np.flatnonzero(block_max >= length).tolist():
            lo = b * block
            sub = caps[lo : min(lo + block, n_bins)]
            idx = np.flatnonzero(sub >= length)
            per_bin = sub[idx] // length
            filled = np.cumsum(per_bin)
            if filled[-1] > todo:  # the run ends in this block
                j = int(np.searchsorted(filled, todo))  # first bin that reaches `todo`
                per_bin = per_bin[: j + 1].copy()
                per_bin[j] = todo - (filled[j - 1] if j else 0)
                idx = idx[: j + 1]
            segments.append(np.repeat(idx + lo, per_bin))
            sub[idx] -= per_bin * length
            block_max[b] = sub.max()
            todo -= int(per_bin.sum())
            if todo == 0:
                break
        if todo:
            per_bin = budget // length
            full, part = divmod(todo, per_bin)
            k = full + (part > 0)
            new = np.arange(n_bins, n_bins + k, dtype=np.int64)
            segments.append(np.repeat(new, per_bin)[:todo])
            caps[n_bins : n_bins + full] = budget - per_bin * length
            if part:
                caps[n_bins + full] = budget - part * length
            for b in range(n_bins // block, (n_bins + k - 1) // block + 1):
                block_max[b] = caps[b * block : min((b + 1) * block, n_bins + k)].max()
            n_bins += k
        sorted_bins[start : start + run] = np.concatenate(segments)
    bins = np.empty(n, dtype=np.int64)
    bins[order] = sorted_bins
    return bins


def next_fit(lengths: np.ndarray, budget: int, window: int = 1 << 20) -> np.ndarray:
    """Next fit in the given order: close the open bin as soon as the next item does not fit."""
    n = len(lengths)
    ends = np.cumsum(lengths)
    heads = []  # first item of every bin
    i, lo, chunk = 0, 0, []  # bisect on a list window is ~10x cheaper a call than np.searchsorted
    while i < n:
        if i >= lo + len(chunk):
            lo, chunk = i, ends[i : i + window].tolist()
        heads.append(i)
        limit = (chunk[i - lo - 1] if i > lo else (int(ends[i - 1]) if i else 0)) + budget
        if chunk[-1] <= limit:  # the bin runs past the window
            i = int(np.searchsorted(ends, limit, side="right"))
        else:
            i = lo + bisect.bisect_right(chunk, limit, i - lo)
    bins = np.zeros(n, dtype=np.int64)
    bins[np.asarray(heads[1:], dtype=np.int64)] = 1
    return np.cumsum(bins)
