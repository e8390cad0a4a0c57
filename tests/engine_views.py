"""Whole tensors out of either engine, for tests that compare them with a single process.

DeepSpeed partitions parameters and gradients under ZeRO (deepspeed.utils reads them back
whole); the torch engine's FSDP2 holds DTensors (`full_tensor()` gathers them, a collective: every
rank calls it, in the same order). Under DDP and DeepSpeed's ZeRO-0 they are whole already.
"""

from __future__ import annotations

import torch


def full_grad(engine, p: torch.nn.Parameter) -> torch.Tensor | None:
    """`p`'s gradient, whole (None if it has none)."""
    if engine.name == "deepspeed":
        import deepspeed

        return deepspeed.utils.safe_get_full_grad(p)
    g = p.grad
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def full_param(engine, p: torch.nn.Parameter) -> torch.Tensor:
    """`p`'s trained value, whole: DeepSpeed's fp32 master copy where it keeps one, else the weight."""
    if engine.name == "deepspeed":
        import deepspeed

        fp32 = deepspeed.utils.safe_get_full_fp32_param(p)  # None under ZeRO-0: no master copy
        return fp32 if fp32 is not None else p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def grads(engine, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    return {n: full_grad(engine, p).clone() for n, p in engine.module.named_parameters()
            if p.requires_grad or not trainable_only}


def params(engine) -> dict[str, torch.Tensor]:
    return {n: full_param(engine, p).clone() for n, p in engine.module.named_parameters()}
