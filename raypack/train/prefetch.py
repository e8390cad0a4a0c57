"""The worker's data path: the next optimizer step's micro-batches are read, collated and pinned in
a background thread while the current step computes.

    steps = Prefetcher(iter_rank_packs(train_dir, rank, start), accum, partial(prepare_step, padded=..., pin=True))
    for step in steps:             # StepBatch objects, in plan order
        pending = train_step(engine, step, loss, counts)   # read later: pending.resolve()
    steps.close()                  # stops the thread if the loop ends early

    main thread:   [ step i: move ─ forward/backward ─ optimizer ]  [ step i+1 ... ]
    prefetcher:      [ read + collate + pin step i+1 ]  [ step i+2 ] (waits: `depth` steps ahead at most)

Reading a 16k-token pack from Parquet and collating it takes milliseconds of Python; in the loop's
own thread the GPU idles for them every step. Pinned host memory makes the copy to the device
(`move_batch`, non_blocking) asynchronous too. One producer thread and a FIFO queue keep the plan
order, so the micro-batches are exactly those of the unthreaded loop (a test checks it); an error
in the reader reaches the loop at the step it would have happened.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from raypack.data.collate import collate_packed, count_label_tokens, move_batch
from raypack.model import vision_tower
from raypack.model.exact import keep_host_copy
from raypack.train.objectives.loss import label_targets
from raypack.train.objectives.router_loss import batch_units


@dataclass
class StepBatch:
    """One optimizer step's micro-batches, collated on the host."""

    batches: list[dict[str, Any]]
    """Model kwargs plus `labels` and the loss's target positions (`label_targets`), one per micro-batch."""
    label_tokens: int
    """Label tokens of this rank's micro-batches: this step's share of the loss normalizer."""
    tokens: int
    """Real (non-padding) tokens."""
    example_ids: list[int]
    router_units: int = 0
    """The router loss's units (examples, or micro-batches) in this rank's micro-batches; 0: no router loss."""


def prepare_step(group: list[dict[str, Any]], padded: bool = False, pad_token_id: int = 0, pin: bool = False,
                 router_scope: str | None = None, collate: Callable[..., dict[str, Any]] | None = None) -> StepBatch:
    """Collate each packed row of `group` into a micro-batch; pin its tensors when `pin`.
    `router_scope` (train.router_aux_loss, when the router loss is on): each token's unit too
    (raypack/train/objectives/router_loss.py). `collate`: collate_packed's stand-in (a VLM run's
    `vision_collate.VisionRows`, which adds each row's images)."""
    batches = []
    for row in group:
        batch = (collate or collate_packed)([row], padded=padded, pad_token_id=pad_token_id)
        batch.update(label_targets(batch["labels"]))
        if router_scope is not None:
            batch.update(batch_units(batch, router_scope))
        if pin:
            # cu_seq_lens_k must stay the same tensor as _q (see collate.move_batch)
            pinned = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "cu_seq_lens_k"}
            if "cu_seq_lens_k" in batch:
                pinned["cu_seq_lens_k"] = pinned["cu_seq_lens_q"]
            batch = pinned
        batches.append(batch)
    return StepBatch(
        batches=batches,
        label_tokens=sum(count_label_tokens(b) for b in batches),
        tokens=sum(int(row["num_tokens"]) for row in group),
        example_ids=[i for row in group for i in row["example_ids"]],
        router_units=sum(int(b.get("router_unit_count", 0)) for b in batches),
    )


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Iterator[StepBatch]):
    """Groups of `accum` rows from `rows`, prepared by `prepare` in a background thread, `depth`
    steps ahead at most. Stops at the first short group (the epoch's end: the plan gives every
    rank a multiple of `accum` packs)."""

    def __init__(self, rows: Iterable[dict[str, Any]], accum: int, prepare: Callable[[list[dict]], StepBatch], depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(iter(rows), accum, prepare), daemon=True,
                                        name="raypack-prefetch")  # fmt: skip
        self._thread.start()

    def _produce(self, rows: Iterator[dict[str, Any]], accum: int, prepare: Callable[[list[dict]], StepBatch]) -> None:
        try:
            while not self._stop.is_set():
                group = list(itertools.islice(rows, accum))
                if len(group) < accum:
                    break
                if not self._put(prepare(group)):
                    return
        except BaseException as e:  # handed to the consumer, raised at the step that needed it
            self._put(_Failed(e))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> StepBatch:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._done = True
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue) and wait for it."""
        self._stop.set()
        self._done = True
        self._thread.join(timeout=10)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


HOST_COPIED = ("cu_seq_lens_q", *vision_tower.HOST_COPIED)
"""Keys whose host tensors stay beside the moved ones: the exact attention's boundaries, and a
grid tower's grid and offsets (raypack/model/vision_tower.py), read as numbers on the host."""


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """A micro-batch on `device` (collate.move_batch), the host tensors of HOST_COPIED kept beside
    the moved ones for the exact attention and the vision tower, which need boundaries and grids
    as numbers and so read the host's, not the device's (raypack/model/exact.py: no device sync
    per micro-batch on CUDA)."""
    moved = move_batch(batch, device)
    for key in HOST_COPIED:
        host = batch.get(key)
        if isinstance(host, torch.Tensor) and host.device.type == "cpu":
            keep_host_copy(moved[key], host)
    return moved
