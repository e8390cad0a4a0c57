"""The training engines behind one seam (`base.Engine`): DeepSpeed's ZeRO, and torch's own DDP and
FSDP2 (train.engine: deepspeed | torch). Nothing outside this package imports DeepSpeed.

    compute = engines.compute_dtype(cfg.train, cfg.model.dtype)
    with engines.building(cfg.train, dtype=compute, world_size=world):  # where each rank builds it
        model = load_model(..., dtype=engines.weights_dtype(cfg.train, cfg.model.dtype, adapters=...))
    engine = engines.build(model, cfg.train, dtype=compute, world_size=world, total_steps=total)

The same train.zero_stage is the same memory trade on both: 0 replicates everything, 1-2 shard
the optimizer state and gradients, 3 the weights too; offload moves state to the host. What an
engine can't do is refused by the config (raypack/config/sections.py, `TrainConfig`) before Ray
starts. Each engine is imported only when a run uses it: a torch-engine worker never imports
DeepSpeed.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import ContextManager

import torch
from torch import nn

from raypack.config import TrainConfig
from raypack.errors import InputError
from raypack.model.build import resolve_dtype
from raypack.train.engines.base import Engine, SavedWeights

__all__ = ["ENGINES", "Engine", "SavedWeights", "build", "building", "compute_dtype", "read_offline", "saved_by",
           "weights_dtype"]

ENGINES = {"deepspeed": ("raypack.train.engines.deepspeed_engine", "ds"),
           "torch": ("raypack.train.engines.torch_engine", "torch")}
"""train.engine -> (its module, the folder its state takes in a checkpoint). The modules are not
named deepspeed.py and torch.py: importing a submodule sets its name on this package, and this
module's own `torch` would become the torch engine's module."""


def _engine(name: str):
    return importlib.import_module(ENGINES[name][0])


def compute_dtype(cfg: TrainConfig, model_dtype: str) -> torch.dtype:
    """The dtype the forward computes in: model.dtype's (bf16 on CUDA for auto), bf16 for precision bf16."""
    return torch.bfloat16 if cfg.precision == "bf16" else resolve_dtype(model_dtype)


def weights_dtype(cfg: TrainConfig, model_dtype: str, adapters: bool = False) -> torch.dtype:
    """The dtype the model is built in. DeepSpeed builds it in the compute dtype and keeps its fp32
    master copy in its optimizer; the torch engine keeps the master weights in the model itself
    (fp32 for precision mixed), casting them for the forward. Under FSDP2 (zero_stage 1-3) it too
    is built in the compute dtype, and each rank casts its shards to fp32 after sharding: the one
    rank that reads a checkpoint then holds it in bf16, not fp32 (engines/fsdp.py). With
    `adapters` (LoRA) the frozen base needs no master copy: it is built in the compute dtype, and
    the torch engine keeps the trained weights alone in fp32."""
    compute = compute_dtype(cfg, model_dtype)
    if cfg.engine == "torch" and cfg.precision == "mixed" and not adapters and cfg.zero_stage == 0:
        return torch.float32
    return compute


def building(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int) -> ContextManager:
    """Where each rank builds the model (ZeRO-3's zero.Init, FSDP2's meta device on ranks > 0)."""
    if cfg.engine == "deepspeed" and cfg.zero_stage != 3:
        return contextlib.nullcontext()  # no DeepSpeed import where nothing needs it
    return _engine(cfg.engine).building(cfg, dtype=dtype, world_size=world_size)


def build(model: nn.Module, cfg: TrainConfig, *, dtype: torch.dtype, world_size: int, total_steps: int) -> Engine:
    """train.engine's engine over `model`, computing in `dtype`, for `total_steps` optimizer steps."""
    return _engine(cfg.engine).setup_engine(model, cfg, dtype=dtype, world_size=world_size, total_steps=total_steps)


def saved_by(folder: str | Path) -> str | None:
    """Which engine wrote the checkpoint in `folder` (local), or None if neither did."""
    return next((name for name, (_, tag) in ENGINES.items() if (Path(folder) / tag).is_dir()), None)


def read_offline(folder: str | Path, adapters: bool) -> SavedWeights:
    """The engine state of the checkpoint in `folder`, whichever engine wrote it, read on the CPU."""
    name = saved_by(folder)
    if name is None:
        tags = " or ".join(f"{tag}/" for _, tag in ENGINES.values())
        raise InputError(f"{folder}: no engine state in {tags} (is it a raypack checkpoint, copied whole?)")
    return _engine(name).read_offline(Path(folder), adapters)
