"""One optimizer step, two objectives: SFT's token mean (`loss.CausalLMLoss`) and DPO's pair
mean (`dpo.DPOLoss`), with an MoE model's router loss riding either.

    pending = train_step(engine, step, objective, counts, number)   # forward, backward, update enqueued
    values = pending.resolve()                                       # read a step late (stepvalues.py)

A step's loss is Σ losses / C, where C is the objective's count (`Objective.per`: label tokens
for SFT, pairs for DPO) over all its micro-batches on all ranks. The engine divides each
backward by the accumulation steps and averages gradients over ranks, so each micro-batch's sum
is scaled by world·accum/C to undo both. Every rank needs C before its first backward: host
numbers the prefetcher counted, summed over the ranks on the host (the stop vote rides the same
gather), so a step with C = 0 is skipped by every rank alike, never averaged in as 0.

The router loss (raypack/train/objectives/router_loss.py) is the mean over the step's U units (SFT's
examples, DPO's sequences), counted with C: each micro-batch's sum of it weighs coef·world·accum/U.
Only the objective's policy forward is captured: DPO's reference forward pauses the capture.

What the step reads back (the loss, the objective's `names` sums, the router's sums and expert
load) travels in one device all_reduce that nothing waits for; see stepvalues.Pending.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from raypack.model.kernels import checkpoint_offload
from raypack.train.prefetch import StepBatch, to_device
from raypack.train.objectives.router_loss import UNIT_KEYS, RouterLoss
from raypack.train.stepvalues import HostCounts, Pending, StepTimer
from raypack.train.stop import StopWatch


class Objective(Protocol):
    """What the step asks of an objective."""

    names: tuple[str, ...]
    """The sums each micro-batch adds to `stats` beside its loss, reported as means over `per`."""
    per: str
    """The host value the step's loss is a mean over (C): `label_tokens` or `pairs`."""

    def counts(self, step: StepBatch) -> list[float]:
        """This rank's host numbers for the step, summed over the ranks before its first backward."""

    def host(self, sums: list[float]) -> tuple[dict[str, float], Any]:
        """From the summed counts: the step's host values (holding `per`), and what each
        micro-batch's loss needs of them (DPO: the NLL term's weight; SFT: nothing)."""

    def micro(self, forward, batch: dict[str, Any], context: Any, stats: list) -> torch.Tensor:
        """Σ loss over one micro-batch (fp32 scalar with grad), its `names` sums appended to `stats`."""


def forward_backward(engine, batches: list[dict], scale: float | torch.Tensor, objective: Objective,
                     offload: bool = False, router: RouterLoss | None = None, router_scale: float = 0.0,
                     context: Any = None, sums: list | None = None) -> torch.Tensor:
    """Backward every micro-batch of one optimizer step, its loss sum scaled by `scale` (and its
    router loss sum by `router_scale`); the caller runs the final engine.step(). Returns this
    rank's Σ loss on the device; each micro-batch's other sums (the objective's `names`, the
    router's sum and expert load) go to `sums`. `offload`: model.offload_checkpoints."""
    total = torch.zeros((), device=engine.device)
    for i, batch in enumerate(batches):
        # move_batch keeps cu_seq_lens_q and _k one tensor; two copies would cost a device
        # comparison (a sync) in every attention layer.
        with checkpoint_offload(offload, engine.device):
            moved = to_device(batch, engine.device)
            units = {k: moved.pop(k) for k in UNIT_KEYS if k in moved}
            stats: list[torch.Tensor] = []
            if router is None:
                loss_sum = objective.micro(engine, moved, context, stats)
                loss = loss_sum * scale
            else:
                with router.routers.capture() as calls:
                    loss_sum = objective.micro(engine, moved, context, stats)
                aux_sum, load = router.sums(calls, units)
                loss = loss_sum * scale + aux_sum * router_scale
                stats += [aux_sum.detach(), load]
            if stats and sums is not None:
                sums.append(torch.cat([s.double().reshape(-1) for s in stats]))
        engine.backward(loss)
        total += loss_sum.detach()
        if i < len(batches) - 1:
            engine.step()  # a no-op for the weights until the accumulation boundary
    return total


def train_step(engine, step: StepBatch, objective: Objective, counts: HostCounts, number: int = 0,
               wait_s: float = 0.0, offload: bool = False, stop: StopWatch | None = None,
               router: RouterLoss | None = None) -> Pending | None:
    """Enqueue optimizer step `number` on prefetched micro-batches; its values are read later
    (`Pending.resolve`). `wait_s` is how long the loop waited for them; `offload`:
    model.offload_checkpoints; `stop`: the run's StopWatch, whose vote rides the step's host
    gather: None, and no step taken, when the ranks agree to stop after step `number - 1`;
    `router`: the router loss."""
    timer = StepTimer(engine.device)
    values = objective.counts(step) + ([step.router_units] if router is not None else [])
    summed = counts.sums(*values) if stop is None else stop.sums(counts, values, number - 1)
    if summed is None:
        return None
    host, context = objective.host(summed[:len(values) - (router is not None)])
    count = host[objective.per]
    host.update(data_wait_s=wait_s, world_size=counts.world, skipped_steps=float(count == 0))
    if router is not None:
        host["router_units"] = summed[-1]
    if count == 0:
        timer.stop()
        return Pending(number, host, timer=timer)
    world_accum = counts.world * len(step.batches)  # what the engine divides each backward by
    router_scale = router.coef * world_accum / max(host["router_units"], 1.0) if router is not None else 0.0
    sums: list[torch.Tensor] = []
    total = forward_backward(engine, step.batches, world_accum / count, objective, offload, router, router_scale,
                             context, sums)
    engine.step()
    parts = [total.double().reshape(1)] + ([torch.stack(sums).sum(0)] if sums else [])
    read = counts.reduce(torch.cat(parts))  # one device all_reduce, not waited for
    return Pending.enqueued(number, host, read[0], engine.grad_norm(), timer, extra=read[1:] if sums else None,
                            names=objective.names, per=objective.per, more=router.read if router is not None else None)
