"""The torch engine (train.engine: torch): torch's own data parallelism, no DeepSpeed.

| train.zero_stage | what each rank holds at rest       | how (fsdp.py)                                 |
|------------------|------------------------------------|-----------------------------------------------|
| 0                | everything, replicated             | DDP                                           |
| 1, 2             | 1/N of weights, gradients, moments | FSDP2: weights gathered and gradients         |
|                  |                                    | reduce-scattered once an optimizer step       |
| 3                | the same, weights let go after     | FSDP2: gathered and reduce-scattered every    |
|                  | each unit's forward and backward   | micro-batch                                   |

One rank trains the bare model at every stage (no DDP, no FSDP2 on a 1-rank mesh, whose hooks
cost time for nothing), unless offload asks for FSDP2's CPUOffloadPolicy; its checkpoints are
the same torch.distributed.checkpoint folders, which a run on more ranks reshards.
FSDP2 always shards gradients and optimizer state together, so stages 1 and 2 are one mode here.
N is the ranks of one node on several nodes (HSDP), every rank on one; the units, the mesh and
how a checkpoint's weights reach the shards: fsdp.py.

Precision (`train.precision`): `mixed` keeps fp32 weights (the master copy) and moments, and
computes in model.dtype (bf16 on CUDA): FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` casts the gathered weights, and DDP runs the forward under `torch.autocast`.
Under FSDP2 the model is read in model.dtype and each rank's shards are cast to fp32 (fsdp.py:
a 70B model's fp32 copy on one host would be 280 GB). With LoRA the frozen base stays in
model.dtype and only the trained weights are fp32.
`bf16` keeps bf16 weights and steps torch-optimi's Kahan-summed AdamW (engines/optim.py).
train.offload_optimizer or offload_params: FSDP2's `CPUOffloadPolicy`, which keeps the sharded
weights, gradients and the optimizer step on the host together; its gradient norm reduces host
tensors, so such a run's process group is `cpu:gloo,cuda:nccl` (raypack/train/placement.py).

Building (`building`): under FSDP2 only rank 0 builds the model with weights (from the
checkpoint or, for a config, from train.seed), on the host; every other rank builds it on the meta
device, so no rank holds a copy on its GPU and only one holds it in host memory (fsdp.py).

Checkpoints: torch.distributed.checkpoint under the tag `torch`: every rank writes its shards
(replicated tensors once), rank 0 the schedule and the TrainState (`engine.pt`); a resume with
another world size reshards. `read_offline` reads the model's tensors alone, without a process group.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from raypack.config import TrainConfig
from raypack.model import autocast
from raypack.model.facts import describe
from raypack.train.engines import fsdp
from raypack.train.engines.base import Engine, SavedWeights, param_groups
from raypack.train.engines.optim import make_optimizer, schedule

STATE_FILE = "engine.pt"
"""Rank 0's part of a checkpoint beside the shards: the schedule, the TrainState, the layout."""


def rank_device() -> torch.device:
    """This rank's device: Ray Train's choice in a worker, else the local rank's GPU, or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray.train.torch

        return ray.train.torch.get_device()
    except (ImportError, RuntimeError):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def sharded(cfg: TrainConfig, world_size: int) -> bool:
    """Whether this run's model is FSDP2-sharded (zero_stage 1-3 on several ranks, or offloaded),
    not replicated: one rank trains the bare model, as FSDP2 on a 1-rank mesh would but without
    its hooks; only FSDP2's CPUOffloadPolicy can keep its weights on the host."""
    return cfg.zero_stage > 0 and (world_size > 1 or fsdp.offloads(cfg))


@contextlib.contextmanager
def building(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int):
    """Where the model is built: under FSDP2 on the meta device on every rank but rank 0 (module doc)."""
    if not sharded(cfg, world_size) or not dist.is_initialized() or dist.get_rank() == 0:
        yield
        return
    with torch.device("meta"):
        yield


def setup_engine(model: nn.Module, cfg: TrainConfig, *, dtype: torch.dtype, world_size: int,
                 total_steps: int) -> TorchEngine:
    """The torch engine for `model` (built by `building`), computing in `dtype`."""
    return TorchEngine(model, cfg, compute_dtype=dtype, world_size=world_size, total_steps=total_steps)


class TorchEngine(Engine):
    """DDP or FSDP2 with raypack's AdamW and schedule, stepping as DeepSpeed's engine does."""

    name = "torch"
    tag = "torch"

    def __init__(self, model: nn.Module, cfg: TrainConfig, *, compute_dtype: torch.dtype, world_size: int,
                 total_steps: int) -> None:
        self.cfg = cfg
        self.device = rank_device()
        self.compute_dtype = compute_dtype
        self.zero_stage = cfg.zero_stage
        self.world_size = world_size
        self.accum = cfg.grad_accum
        self.micro = 0
        self._norm: torch.Tensor | None = None
        # mixed: fp32 trained weights (the master copy; a LoRA base stays in compute_dtype), the
        # forward cast to compute_dtype
        self.cast = compute_dtype if cfg.precision == "mixed" and compute_dtype != torch.float32 else None
        self.sharded = sharded(cfg, world_size)
        # Stages 1-2 gather and reduce-scatter once a step (fsdp.accumulate), but not where a VLM's
        # tower trains: a micro-batch without images leaves its gradients out, and FSDP2 (torch
        # 2.13) then reduce-scatters the accumulated ones in two dtypes ("FSDP reduce-scatter
        # expects uniform gradient dtype", tests/ray/train/test_matrix.py's whole matrix); such a
        # run reduce-scatters every micro-batch, as stage 3 does.
        self.once_a_step = not tower_weights(model)
        if self.sharded:  # the fp32 cast after sharding, of each rank's shards (fsdp.py)
            self.module = fsdp.shard(model, cfg, self.device, self.cast)
            self.wrapped = self.module
            self.units = fsdp.units(self.module)
        else:
            if self.cast is not None:
                autocast.cast_grouped_experts()  # the MoE experts' matmul, which autocast has no rule for
                for p in model.parameters():
                    if p.requires_grad and p.dtype != torch.float32:  # peft's modules_to_save copies
                        p.data = p.data.float()
            self.module = model.to(self.device)
            self.wrapped = replicate(model, self.device, world_size)
        # DDP over a VLM: the tower's and projector's trained weights, which every micro-batch's
        # loss touches with a zero weight (`backward`), so that none goes unused where DDP reduces
        self.touched = tower_weights(model) if self.wrapped is not self.module else []
        self.optimizer = make_optimizer(param_groups(self.module, cfg.weight_decay), cfg)
        self.scheduler = schedule(self.optimizer, cfg, total_steps)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    # --- the step ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DDP all-reduces, and FSDP2 at stages 1-2 reduce-scatters, in the backward of an optimizer
        # step's last micro-batch only; an eval's forward (no backward) changes nothing
        last = (self.micro + 1) % self.accum == 0
        if self.wrapped is not self.module:
            self.wrapped.require_backward_grad_sync = last
        elif self.sharded and self.once_a_step and torch.is_grad_enabled():
            fsdp.accumulate(self.units, self.cfg, last)
        if self.cast is not None and not self.sharded:
            with torch.autocast(self.device.type, dtype=self.cast):
                return self.wrapped(*args, **kwargs)
        return self.wrapped(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.touched:
            # DDP reduces a bucket once each of its weights' gradients arrived, and is told of none
            # that won't (no find_unused_parameters: see `replicate`). A micro-batch without images
            # leaves the vision tower out of the graph; this term puts every tower weight in it with
            # a gradient of exact zeros (x + 0 is x), on every micro-batch, image or not, so the
            # set is the same each time (a tower weight no image reaches either, as Llava's
            # post-layernorm, gets zeros too). Zeros are what FSDP2 (set_reduce_scatter_unused_params)
            # and DeepSpeed's flat buffers reduce for such a weight as well.
            loss = loss + torch.stack([p.reshape(-1)[0] for p in self.touched]).sum().to(loss.dtype) * 0
        (loss / self.accum).backward()

    def step(self) -> None:
        self.micro += 1
        if self.micro % self.accum:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros((), device=self.device)
        if isinstance(norm, DTensor):  # each rank's shards: the norm over all of them
            norm = norm.full_tensor()
        if self.cfg.grad_clip > 0 and grads:
            # no host read: the clip factor is a tensor op (torch's own clamp)
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.grad_clip, norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._norm = norm

    def grad_norm(self) -> torch.Tensor | None:
        return self._norm

    # --- checkpoints --------------------------------------------------------------------------------

    def _options(self, frozen: bool, **more: Any) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen, **more)

    def _resharded(self) -> None:
        if self.sharded:
            fsdp.reshard(self.module)

    def save(self, folder: Path, state: dict[str, Any], *, frozen: bool) -> None:
        out = Path(folder) / self.tag
        self._resharded()
        model, optim = get_state_dict(self.module, self.optimizer, options=self._options(frozen))
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(out))
        if dist.get_rank() == 0:
            torch.save({"train_state": state, "scheduler": self.scheduler.state_dict(), "micro": self.micro,
                        "zero_stage": self.zero_stage, "world_size": self.world_size,
                        "dtype": str(self.compute_dtype).removeprefix("torch.")}, out / STATE_FILE)

    def load(self, folder: Path, *, frozen: bool) -> dict[str, Any]:
        source = Path(folder) / self.tag
        self._resharded()
        model, optim = get_state_dict(self.module, self.optimizer, options=self._options(frozen))
        loaded = {"model": model, "optim": optim}
        dcp.load(loaded, checkpoint_id=str(source))
        set_state_dict(self.module, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"], options=self._options(frozen))
        extra = torch.load(source / STATE_FILE, map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        # Checkpoints are taken at step boundaries, and a resume on another worker count may
        # change grad_accum: count this start's micro-batches from a boundary.
        self.micro = 0
        return extra["train_state"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's whole state dict, in the dtype the model computed in (as DeepSpeed's 16-bit one)."""
        if self.sharded:
            self._resharded()
            full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            full = self.module.state_dict()
        return {k: v.to(self.compute_dtype) if v.is_floating_point() else v for k, v in full.items()}

    def destroy(self) -> None:
        self.optimizer.state.clear()


# --- wrapping -------------------------------------------------------------------------------------


def replicate(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """zero_stage 0: DDP over the ranks, or the model itself on one rank (nothing to average)."""
    if world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    # No find_unused_parameters: it walks the autograd graph from the forward's outputs after every
    # forward, and marks the output head unused there (the chunked loss calls the head after the
    # forward: raypack/train/objectives/loss.py), then fails when its gradient arrives ("mark a
    # variable ready only once"). Every weight is used instead: a VLM's tower through
    # TorchEngine.backward's zero term on micro-batches without images.
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy
        broadcast_buffers=False,  # raypack's models' buffers are constants (rotary frequencies)
    )


def tower_weights(model: nn.Module) -> list[nn.Parameter]:
    """A VLM's vision tower's and projector's weights that train (none for a text model)."""
    if not describe(getattr(model, "config", None)).vlm:
        return []
    from raypack.model.vision import parts

    named = dict(model.named_parameters())
    return [named[n] for names in parts(model).values() for n in names if named[n].requires_grad]


# --- reading a checkpoint back, offline -----------------------------------------------------------


def read_offline(folder: Path, adapters: bool) -> SavedWeights:
    """The model's tensors of the torch engine's state in folder/torch, whole, on the CPU (no
    process group): the shards of every rank put together by torch.distributed.checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = Path(folder) / TorchEngine.tag
    extra = torch.load(source / STATE_FILE, map_location="cpu", weights_only=False)
    metadata = FileSystemReader(str(source)).read_metadata()
    weights = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": weights}, checkpoint_id=str(source), no_dist=True)
    return SavedWeights(extra["train_state"], TorchEngine.name, int(extra["zero_stage"]), int(extra["world_size"]),
                        getattr(torch, extra["dtype"]), weights)
