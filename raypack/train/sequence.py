"""Sequence-parallel groups on the workers: which ranks share a row, and how its shards reach them.

    group = make_groups(cfg.train.sequence_parallel)     # every rank, once, at setup
    with step_source(group, rows, accum, prepare) as steps:    # this rank's StepBatch shards
        for step in steps: ...

World rank r is rank r % N of group r // N, and group g trains the packed rows of data rank g
(`data_rank`), so data parallelism runs across groups. A group's rows are read once: its first
rank reads and collates them (the usual Prefetcher), cuts every micro-batch into N shards
(`collate.shard_batch`) and scatters them over a gloo group, so each rank receives only its own
shard and storage serves each row once, not N times. The scatter runs in the loop's thread, at
the same point of every rank's loop, so the group's collectives can never interleave (a
prefetch thread doing it could still be inside a scatter when the loop stops). What it costs:
one gloo scatter per optimizer step, of a few integer tensors per micro-batch (ids, positions,
labels, loss positions and targets: int64, ~40 bytes a token), while the first rank's next step is already prefetched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from raypack.data.collate import shard_batch
from raypack.model.ulysses import SequenceGroup, sequence_parallel
from raypack.train.objectives.loss import label_targets, probe_batch
from raypack.train.prefetch import Prefetcher, StepBatch, to_device


def make_groups(size: int) -> SequenceGroup:
    """This rank's group of `size` consecutive ranks; every rank must call it (new_group is
    collective). The attention all-to-alls use the default backend (NCCL on GPUs); the shards
    travel over gloo, as host tensors."""
    if size == 1:
        return SequenceGroup(size=1, rank=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        attention, data = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = SequenceGroup(size=size, rank=rank - first, process_group=attention, data_group=data)
    return mine


@torch.no_grad()
def probe_split(engine, group: SequenceGroup, loss) -> None:
    """One short forward of a packed row split over the group, on every rank of it, at setup: a
    model whose layers can't take part (heads that don't divide, attention that never sees the
    whole row's cu_seqlens) is refused here, before any step, with the reason (UnsupportedModelError)."""
    if group.size == 1:
        return
    batch = probe_batch(loss.vocab, padded=False)  # the chunked loss: the config refuses the full one here
    batch.update(label_targets(batch["labels"]))
    shard = to_device(shard_batch(batch, group.size)[group.rank], engine.device)
    was_training = engine.module.training
    engine.module.eval()
    try:
        with sequence_parallel(group):
            loss(engine, shard)
    finally:
        engine.module.train(was_training)


def data_rank(world_rank: int, size: int) -> int:
    """The data-parallel rank (the packed rows' `rank=` folder) of a world rank."""
    return world_rank // size


def shard_step(step: StepBatch, n: int, pad_token_id: int) -> list[StepBatch]:
    """One optimizer step's micro-batches cut into n per-rank steps (see collate.shard_batch).
    Only the first shard lists the examples, so every example is logged once per group."""
    cut = [shard_batch(b, n, pad_token_id) for b in step.batches]
    steps = []
    for k in range(n):
        batches = [shards[k] for shards in cut]
        # tokens: the shard's less the row's padding, which sits at the end of the last shard
        real = sum(min(max(full["input_ids"].shape[1] - k * b["input_ids"].shape[1], 0), b["input_ids"].shape[1])
                   for full, b in zip(step.batches, batches))
        steps.append(StepBatch(batches=batches, label_tokens=sum(len(b["loss_targets"]) for b in batches),
                               tokens=real, example_ids=step.example_ids if k == 0 else []))
    return steps


class ShardedSteps(Iterator[StepBatch]):
    """This rank's shard of each of its group's steps: the first rank's `steps` (None elsewhere)
    cut and scattered; a None scattered at the end stops every rank of the group together."""

    def __init__(self, steps: Iterator[StepBatch] | None, group: SequenceGroup, pad_token_id: int, pin: bool):
        self.steps, self.group, self.pad, self.pin = steps, group, pad_token_id, pin
        self.src = dist.get_rank() - group.rank  # the group's first rank, in world numbering
        self.done = False

    def __next__(self) -> StepBatch:
        if self.done:
            raise StopIteration
        parts = None
        if self.group.rank == 0:
            step = next(self.steps, None)
            parts = shard_step(step, self.group.size, self.pad) if step is not None else [None] * self.group.size
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts, src=self.src, group=self.group.data_group)
        if out[0] is None:
            self.done = True
            raise StopIteration
        return _pinned(out[0]) if self.pin else out[0]


def _pinned(step: StepBatch) -> StepBatch:
    for batch in step.batches:
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and key != "cu_seq_lens_k":
                batch[key] = value.pin_memory()
        batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]  # one tensor (see collate.move_batch)
    return step


@contextlib.contextmanager
def step_source(group: SequenceGroup, rows: Callable[[], Iterable[dict]], accum: int,
                prepare: Callable[[list[dict]], StepBatch], pad_token_id: int, pin: bool) -> Iterator[Iterator[StepBatch]]:
    """This rank's steps: the Prefetcher over `rows()` without sequence parallelism; with it, the
    group's first rank prefetches (the others read nothing) and every rank gets its shards."""
    if group.size == 1:
        with Prefetcher(rows(), accum, prepare) as steps:
            yield steps
        return
    reader = Prefetcher(rows(), accum, prepare) if group.rank == 0 else None
    try:
        yield ShardedSteps(reader, group, pad_token_id, pin)
    finally:
        if reader is not None:
            reader.close()
