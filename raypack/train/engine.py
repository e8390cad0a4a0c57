"""DeepSpeed config and engine: one place where the JSON presets meet the typed config.

A preset under raypack/configs/deepspeed/ holds what a cluster operator tunes (bucket sizes, overlap,
offload devices). The typed `TrainConfig` then overwrites every key it owns, so no value is left
as "auto" for DeepSpeed and Ray to resolve differently. The presets are package data: a name such
as `zero3` resolves the same from a checkout, an uploaded working dir or an installed wheel (the
cluster image).
"""

from __future__ import annotations

import math
from typing import Any

import deepspeed
import torch

from raypack.config import TrainConfig
from raypack.train.presets import PRESETS, find_auto, load_preset

__all__ = ["PRESETS", "deepspeed_config", "load_preset", "lr_lambda", "setup_engine"]


def deepspeed_config(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int) -> dict[str, Any]:
    """The full DeepSpeed config for one run: the preset, overlaid by the typed config."""
    ds = load_preset(cfg.deepspeed_preset)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = cfg.zero_stage
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
    else:
        zero.pop("offload_optimizer", None)
    if cfg.offload_params:
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
    else:
        zero.pop("offload_param", None)
    if cfg.zero_stage == 3:
        # Consolidate the full weights on save so a checkpoint loads without zero_to_fp32.
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    # One packed row per micro-batch: the pack budget, not a row count, sets the work per step.
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.grad_accum * world_size
    ds["gradient_clipping"] = cfg.grad_clip
    ds["bf16"] = {"enabled": dtype == torch.bfloat16}
    ds["fp16"] = {"enabled": dtype == torch.float16}
    ds["steps_per_print"] = 10**9  # raypack prints its own progress line
    ds["wall_clock_breakdown"] = False
    if cfg.optimizer == "deepspeed" or cfg.offload_optimizer:
        # DeepSpeed's own (CPU-)Adam: needed for optimizer offload; JIT-builds on first use.
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": [0.9, 0.95], "eps": 1e-8},
        }
    else:
        ds.pop("optimizer", None)
    ds.pop("scheduler", None)  # raypack passes its own warmup-cosine schedule
    if auto := find_auto(ds):
        raise ValueError(f"DeepSpeed config key {auto} is still 'auto'; set it in the preset or the typed config")
    return ds


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total` optimizer steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def setup_engine(model: torch.nn.Module, cfg: TrainConfig, *, dtype: torch.dtype, world_size: int, total_steps: int):
    """`deepspeed.initialize` with raypack's optimizer and schedule. Returns (engine, scheduler)."""
    ds_config = deepspeed_config(cfg, dtype=dtype, world_size=world_size)
    optimizer = None
    if "optimizer" not in ds_config:
        # A torch optimizer avoids DeepSpeed's JIT Adam builds (85-105 s each on 2 cores).
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available()
        )

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_lambda(step, warmup=cfg.warmup_steps, total=total_steps, min_ratio=cfg.min_lr_ratio)
        )

    # The schedule is built on DeepSpeed's wrapped optimizer and stepped by engine.step() at each
    # accumulation boundary; save/load_checkpoint carry its state.
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=None if optimizer is not None else [p for p in model.parameters() if p.requires_grad],
        lr_scheduler=schedule,
        config=ds_config,
    )
    return engine, scheduler
