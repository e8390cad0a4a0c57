"""What the training loop asks of an engine: the one seam between raypack and DeepSpeed or torch.

    engine = engines.build(model, cfg.train, compute_dtype=..., world_size=..., total_steps=...)
    for micro_batch in step:                # the optimizer step (raypack/train/step.py)
        loss = loss_fn(engine, micro_batch)     # engine(**batch) runs the model's forward
        engine.backward(loss * scale)           # scale = world * accum / N (the loop's normalizer)
        engine.step()                           # after every micro-batch: updates at the boundary
    norm = engine.grad_norm()               # the update's norm before clipping, not read
    engine.save(folder, state, frozen=...)  # a collective: every rank writes its part
    state = engine.load(folder, frozen=...)

Both engines keep DeepSpeed's conventions, so one loop drives either: `backward` divides by
train.grad_accum and the gradients are averaged over the ranks (DeepSpeed's ZeRO and DDP/FSDP2
alike), and `step` is called after every micro-batch, a no-op for the weights until the last of
an optimizer step. A checkpoint folder holds one engine's state under its `tag`, so a resume
with the other engine is refused by name (raypack/train/checkpoint.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn


class Engine(abc.ABC):
    """One rank's model, optimizer and schedule behind the calls the loop makes."""

    name: ClassVar[str]
    """train.engine's value for this engine."""
    tag: ClassVar[str]
    """The folder inside a checkpoint that holds this engine's state."""

    module: nn.Module
    """The model itself (not a wrapper): what probes, hooks, adapters and exports read."""
    device: torch.device
    optimizer: Any
    """The optimizer the engine steps (DeepSpeed's ZeRO wrapper, or raypack's AdamW itself)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    compute_dtype: torch.dtype
    """The dtype the forward computes in (the weights may be kept in fp32 beside it)."""
    zero_stage: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, through whatever the engine wraps it in."""
        return self.forward(*args, **kwargs)

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward, divided by train.grad_accum; the gradients reach the
        ranks' mean by the optimizer step."""

    @abc.abstractmethod
    def step(self) -> None:
        """Called after every micro-batch's backward: at the last of an optimizer step's, clip,
        update, zero the gradients and advance the schedule; before it, nothing."""

    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor | float | None:
        """The last update's gradient norm before clipping (a device tensor, not read)."""

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.train(False)

    @abc.abstractmethod
    def save(self, folder: Path, state: dict[str, Any], *, frozen: bool) -> None:
        """Write this rank's part of the weights, optimizer and schedule, and `state` (the
        TrainState's client dict), into folder/tag. `frozen`: with adapters, leave the frozen
        base weights out. Every rank calls it."""

    @abc.abstractmethod
    def load(self, folder: Path, *, frozen: bool) -> dict[str, Any]:
        """Read back what `save` wrote into folder/tag; returns `state`. Every rank calls it."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict on rank 0 (gathered from every rank where sharded: a
        collective, every rank calls it; the other ranks may get an empty dict)."""

    def destroy(self) -> None:
        """Free what the engine holds beyond the model (tests build several in one process)."""


@dataclass
class SavedWeights:
    """One checkpoint's engine state read back offline, on the CPU (`raypack export`)."""

    state: dict[str, Any]
    """The TrainState's client dict."""
    engine: str
    zero_stage: int
    world_size: int
    dtype: torch.dtype
    """The dtype the model trained in."""
    weights: dict[str, torch.Tensor]
    """The trained weights, whole (with adapters, those alone)."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in AdamW's two groups: matrices decay, vectors (norms, biases) don't."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}]
