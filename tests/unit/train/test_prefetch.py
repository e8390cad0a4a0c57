"""The prefetching data path (raypack/train/prefetch.py) hands the loop exactly the micro-batches
the unthreaded loop would build, in the same order; a reader error surfaces at its step; an early
stop leaves no thread behind."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch

from raypack.data.collate import collate_packed, count_label_tokens
from raypack.train.objectives.loss import label_targets
from raypack.train.prefetch import Prefetcher, prepare_step


def packed_rows(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for step in range(n):
        lengths = rng.integers(1, 30, size=rng.integers(1, 4)).tolist()
        ids = rng.integers(3, 500, size=sum(lengths)).tolist()
        labels = [i if rng.random() < 0.7 else -100 for i in ids]
        yield {
            "input_ids": ids, "labels": labels, "position_ids": [p for n in lengths for p in range(n)],
            "example_ids": [step * 10 + k for k in range(len(lengths))], "num_tokens": sum(lengths), "step": step,
        }  # fmt: skip


def slow(rows, seconds: float):
    for row in rows:
        time.sleep(seconds)  # a reader slower than the consumer, then a consumer slower than it
        yield row


def unthreaded(rows, accum: int, padded: bool):
    """The loop before prefetching: islice a group, collate each row in the loop's thread."""
    rows = iter(rows)
    while len(group := list(itertools.islice(rows, accum))) == accum:
        yield group, [collate_packed([r], padded=padded, pad_token_id=0) for r in group]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("accum,reader_s,consumer_s", [(1, 0.0, 0.002), (3, 0.002, 0.0)])
def test_same_micro_batches_in_the_same_order(padded, accum, reader_s, consumer_s):
    n = 14  # not a multiple of 3: the short last group ends the epoch in both paths
    expected = list(unthreaded(packed_rows(n), accum, padded))
    got = []
    with Prefetcher(slow(packed_rows(n), reader_s), accum, lambda g: prepare_step(g, padded=padded)) as steps:
        for step in steps:
            time.sleep(consumer_s)
            got.append(step)
    assert len(got) == len(expected) == n // accum
    for step, (group, batches) in zip(got, expected):
        assert step.example_ids == [i for r in group for i in r["example_ids"]]
        assert step.tokens == sum(r["num_tokens"] for r in group)
        assert step.label_tokens == sum(count_label_tokens(b) for b in batches)
        for mine, theirs in zip(step.batches, batches, strict=True):
            assert mine.keys() == {*theirs, "loss_positions", "loss_targets"}
            for key, value in theirs.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(mine[key], value), key
                else:
                    assert mine[key] == value, key
            targets = label_targets(theirs["labels"])
            assert all(torch.equal(mine[k], targets[k]) for k in targets)
        if not padded:
            assert step.batches[0]["cu_seq_lens_k"] is step.batches[0]["cu_seq_lens_q"]


def test_a_reader_error_reaches_the_loop_at_its_step():
    def broken():
        for i, row in enumerate(packed_rows(10)):
            if i == 5:
                raise OSError("rank=0/part-3.parquet: truncated file")
            yield row

    seen = []
    with Prefetcher(broken(), 2, prepare_step) as steps:
        with pytest.raises(OSError, match="truncated"):
            for step in steps:
                seen.append(step.example_ids)
    assert len(seen) == 2  # rows 0-3 made two steps; row 5 never came


def test_close_stops_a_thread_blocked_on_a_full_queue():
    before = threading.active_count()
    steps = Prefetcher(packed_rows(1000), 1, prepare_step, depth=1)
    next(steps)
    time.sleep(0.2)  # the producer fills the queue and blocks
    steps.close()
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(steps)


def test_to_device_keeps_the_host_boundaries_beside_the_moved_ones():
    """Off the host (meta stands in for CUDA: a device tensor without values to read), the moved
    cu_seq_lens_q answers with the host tensor collate built, for as long as it lives."""
    import gc

    from raypack.model import exact
    from raypack.train.prefetch import to_device

    batch = collate_packed([{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "position_ids": [0, 1, 0, 1, 2]}])
    before = len(exact._host_copies)
    moved = to_device(batch, "meta")
    cu = moved["cu_seq_lens_q"]
    assert cu.device.type == "meta" and moved["cu_seq_lens_k"] is cu
    assert exact.host_copy(cu) is batch["cu_seq_lens_q"] and exact.host_copy(cu).tolist() == [0, 2, 5]
    assert exact.host_copy(to_device(batch, "cpu")["cu_seq_lens_q"]) is None  # not moved: read as it is
    del moved, cu
    gc.collect()
    assert len(exact._host_copies) == before, "a host copy outlived the tensor it stood for"
