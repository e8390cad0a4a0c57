"""raypack's AdamW and warmup-cosine schedule, the same on both engines (so their losses compare).

`train.precision: mixed` steps torch's AdamW (fused on CUDA) on fp32 weights; `bf16` steps
torch-optimi's AdamW with Kahan summation on bf16 weights: each parameter's compensation buffer
(bf16) keeps the part of an update that rounding to bf16 lost, so a run of updates below half an
ulp still moves the weight, where plain bf16 AdamW (TRL on a bf16 model) drops them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from raypack.config import TrainConfig

BETAS = (0.9, 0.95)
EPS = 1e-8


def make_optimizer(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.Optimizer:
    """raypack's AdamW for `groups`: torch's (fused on CUDA), or torch-optimi's with Kahan summation
    for train.precision bf16."""
    if cfg.precision == "bf16":
        import optimi

        # foreach on the CPU; its Triton kernel where CUDA and Triton are (optimi's own choice)
        return optimi.AdamW(groups, lr=cfg.lr, betas=BETAS, eps=EPS, weight_decay=cfg.weight_decay, kahan_sum=True,
                            triton=None if torch.cuda.is_available() else False)
    # weight_decay: a group that doesn't say takes the config's, not torch's own default of 0.01
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=BETAS, eps=EPS, weight_decay=cfg.weight_decay,
                             fused=torch.cuda.is_available())


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total` optimizer steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The warmup-cosine schedule over `total_steps` optimizer steps, stepped once per update."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, warmup=cfg.warmup_steps, total=total_steps, min_ratio=cfg.min_lr_ratio)
    )
