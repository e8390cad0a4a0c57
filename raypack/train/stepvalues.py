"""A step's values without stalling the device: what each optimizer step needs from the other
ranks, over the host, and what it reports, read a step late.

    counts = HostCounts.open(world, engine.device)          # every rank, once, at setup
    n, tokens = counts.sums(step.label_tokens, step.tokens)  # host numbers, no device sync
    ... forward, backward, engine.step() ...
    pending = Pending(counts.reduce(loss_sum), ...)         # device tensors, not read yet
    ... the next step's forward and backward are enqueued ...
    values = pending.resolve()                               # the device is busy with the next step

Why. On CUDA the host runs ahead of the device: it enqueues kernels and returns. Every read of
a device value on the host (`.item()`, `float()`, `.cpu()`) and every `synchronize()` makes it
wait until the device has run everything enqueued so far; then the device idles while the host
enqueues the next work. A step's loss is wanted only for the logs, so it is read after the next
step is enqueued: by then it is done, or nearly, and the device never runs dry. Reading it then
with `.item()` would not do: that copy queues behind the next step's kernels and waits for them
too. So the step ends by copying its loss and gradient norm into pinned host memory
(non-blocking, in the step's place on the stream) and recording an event; the read a step later
waits for that event only, then reads host memory. What a step
needs before its first backward, N (its label tokens on every rank, the loss normalizer), is a
host number on every rank: one rank sums nothing; many sum theirs with one all_gather over a
gloo group (host memory and TCP, never the device's stream), with the step's real tokens in the
same message.

Per optimizer step, then: one rank makes no collective and no host read of a device value; it
waits once, a step late, for the previous step's end event; many ranks add one
host all_gather (N, the tokens, and each rank's vote to stop, raypack/train/stop.py) and one
device all_reduce of the loss (queued, not waited for). Reports gather each rank's step times
once a report (`window`), for the rank imbalance. `benchmarks/step_syncs.py` counts them in the
loop's own step (loop.take_step), before and after, and tests/unit/train/test_stepvalues.py holds
the step to it.

Divergence. DeepSpeed's bf16 overflow check is off (raypack/train/engines/deepspeed_engine.py), so a step whose
gradients hold inf or NaN would be applied. The gradient norm DeepSpeed computes anyway for
clipping is read with the loss; a non-finite one (DeepSpeed masks it to -1) or a non-finite loss
raises `DivergedError`. The loop reads every step's values before it saves a checkpoint, so no
checkpoint ever holds weights updated from a non-finite gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raypack.errors import InputError


class DivergedError(InputError):
    """The loss or the gradient norm is not finite: the run diverged. Restarting from the last
    checkpoint would diverge again, so it is never retried."""


@dataclass(frozen=True)
class HostCounts:
    """Host numbers summed over every rank: nothing on one rank, one gloo all_gather on many."""

    world: int
    group: Any = None
    """A gloo process group beside NCCL's (None: the default group, already gloo on the CPU)."""

    @classmethod
    def open(cls, world: int, device: torch.device) -> HostCounts:
        """Every rank must call it (new_group is collective)."""
        if world == 1 or dist.get_backend() == "gloo":
            return cls(world)
        return cls(world, dist.new_group(backend="gloo"))

    def gather(self, values: list[float]) -> np.ndarray:
        """Every rank's `values` (the same length on every rank): a [world, len] float64 array."""
        if self.world == 1:
            return np.asarray([values], dtype=np.float64)
        local = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).numpy()

    def sums(self, *values: float) -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        return self.gather(list(values)).sum(0).tolist()

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, on the device (queued on NCCL's stream; nothing waits)."""
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor


class StepTimer:
    """The device's time for one step: CUDA events on the stream, read when the step is resolved;
    the host's clock on the CPU, where the work runs as it is called."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """Waits for the step's end on the device: call it a step late."""
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._seconds


@dataclass
class Pending:
    """One optimizer step, enqueued: its host values, and the device values read by `resolve`."""

    step: int
    host: dict[str, float]
    """Known when the step was enqueued: label_tokens (N), tokens, data_wait_s, lr, ..."""
    readings: torch.Tensor | None = None
    """[Σ losses over every rank, the `names` sums, and, where DeepSpeed keeps it on the device, the
    gradient norm], fp64: in host memory once the step's end event has passed (None: a skipped step)."""
    timer: StepTimer | None = None
    values: dict[str, float] | None = field(default=None, repr=False)
    names: tuple[str, ...] = ()
    """Sums read after the loss, each reported divided by `per` as the loss is (DPO's metrics)."""
    per: str = "label_tokens"
    """The host value the loss is a mean over: label tokens (SFT), pairs (DPO)."""
    more: Any = None
    """Reads the readings after the named sums (another objective's: the router loss's sum and
    expert load, raypack/train/objectives/router_loss.py): more(values, readings) -> values to add."""
    more_len: int = 0

    @classmethod
    def enqueued(cls, step: int, host: dict[str, float], loss_sum: torch.Tensor, grad_norm: Any,
                 timer: StepTimer, extra: torch.Tensor | None = None, names: tuple[str, ...] = (),
                 per: str = "label_tokens", more: Any = None) -> Pending:
        """After the step's last kernel: copy its loss, the `extra` sums (the first len(names) named
        `names`, the rest read by `more`) and the gradient norm to host memory, without waiting,
        and mark the step's end on the stream."""
        parts = [loss_sum.detach().double().reshape(1)]
        if extra is not None:
            parts.append(extra.detach().double().reshape(-1))
        if isinstance(grad_norm, torch.Tensor):
            parts.append(grad_norm.detach().double().reshape(1))
        elif grad_norm is not None:  # a host number already (DeepSpeed's inf after an overflow)
            host = {**host, "grad_norm": float(grad_norm)}
        both = torch.cat(parts)
        if both.device.type == "cuda":
            readings = torch.empty(len(both), dtype=torch.float64, pin_memory=True)
            readings.copy_(both, non_blocking=True)
        else:
            readings = both
        timer.stop()
        more_len = 0 if extra is None else extra.numel() - len(names)
        return cls(step, host, readings, timer, names=names, per=per, more=more, more_len=more_len)

    def resolve(self) -> dict[str, float]:
        """The step's values for the trackers and reports (read once; a DivergedError if not finite)."""
        if self.values is not None:
            return self.values
        values = dict(self.host)
        busy = self.timer.seconds() if self.timer is not None else 0.0  # waits for the step's end event
        values["busy_s"] = busy
        values["step_time_s"] = values["data_wait_s"] + busy
        if self.readings is None:
            values["loss"] = float("nan")
        else:
            read = self.readings.tolist()  # host memory: the event above has passed
            values["loss"] = read[0] / values[self.per]
            values.update({name: read[1 + k] / values[self.per] for k, name in enumerate(self.names)})
            if self.more is not None:
                start = 1 + len(self.names)
                values.update(self.more(values, read[start:start + self.more_len]))
            if len(read) > 1 + len(self.names) + self.more_len:
                values["grad_norm"] = read[-1]
            norm = values.get("grad_norm", 0.0)
            bad = [f"the loss is {values['loss']}"] if not math.isfinite(values["loss"]) else []
            if not (math.isfinite(norm) and norm >= 0):
                # DeepSpeed writes -1 (or inf) where the norm was inf or NaN
                bad.append("a gradient is inf or NaN")
            if bad:
                raise DivergedError(
                    f"step {self.step}: {' and '.join(bad)}: the run diverged, and no checkpoint holds the weights this "
                    "step updated. Lower train.lr (or raise train.warmup_steps, set train.grad_clip) and continue from "
                    "the last checkpoint with --resume RUN_DIR and the new values"
                )
        self.values = values
        return values


def rank_imbalance(busy: np.ndarray) -> float:
    """[world, steps] device seconds: the largest, over the steps, of the slowest rank's time over
    the mean rank's (1.0: balanced; each step waits for its slowest rank)."""
    if busy.size == 0 or busy.shape[0] == 1:
        return 1.0
    return float((busy.max(0) / np.maximum(busy.mean(0), 1e-9)).max())
