"""The torch engine (train.engine: torch): torch's own data parallelism, no DeepSpeed.

| train.zero_stage | what each rank holds at rest           | how                                          |
|------------------|----------------------------------------|----------------------------------------------|
| 0                | everything, replicated                 | DDP (one rank: the bare model, no wrapper)   |
| 1, 2             | 1/N of weights, gradients, moments     | FSDP2 `fully_shard(reshard_after_forward=False)`: weights gathered once a step |
| 3                | the same, and the weights let go after each layer's forward | `fully_shard(reshard_after_forward=True)` |

FSDP2 always shards gradients and optimizer state together, so stages 1 and 2 are one mode here.
Each of the model's repeated blocks (transformers' `_no_split_modules`: decoder layers, vision
blocks) is its own FSDP unit, and the root holds the rest (embeddings, final norm, the head, tied
or not), so the chunked loss's head matmul runs while the root's weights are gathered.

Precision (`train.precision`): `mixed` keeps fp32 weights (the master copy) and moments, and
computes in model.dtype (bf16 on CUDA): FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` casts the gathered weights, and DDP runs the forward under `torch.autocast`.
With LoRA the frozen base is built in model.dtype and only the trained weights are fp32.
`bf16` keeps bf16 weights and steps torch-optimi's Kahan-summed AdamW (engines/optim.py).
train.offload_optimizer or offload_params: FSDP2's `CPUOffloadPolicy`, which keeps the sharded
weights, gradients and the optimizer step on the host together.

Building (`building`): under FSDP2 only rank 0 builds the model with weights (from the
checkpoint or, for a config, from train.seed), on the host; every other rank builds it on the meta
device, so no rank holds a copy on its GPU and only one holds it in host memory. After sharding,
rank 0's state dict is broadcast into every rank's shards (`set_model_state_dict(...,
broadcast_from_rank0=True)`), and its non-persistent buffers (rotary frequencies) after it.

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
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from raypack.config import TrainConfig
from raypack.model.facts import decoder, describe
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


def sharded(cfg: TrainConfig) -> bool:
    """Whether this run's model is FSDP2-sharded (zero_stage 1-3), not replicated."""
    return cfg.zero_stage > 0


@contextlib.contextmanager
def building(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int):
    """Where the model is built: under FSDP2 on the meta device on every rank but rank 0 (module doc)."""
    if not sharded(cfg) or not dist.is_initialized() or dist.get_rank() == 0:
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
        if self.cast is not None:
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:  # peft's modules_to_save copies
                    p.data = p.data.float()
        if sharded(cfg):
            self.module = shard(model, cfg, self.device, self.cast)
            self.wrapped = self.module
        else:
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
        ddp = self.wrapped is not self.module
        if ddp:  # DDP all-reduces in the backward of an optimizer step's last micro-batch only
            self.wrapped.require_backward_grad_sync = (self.micro + 1) % self.accum == 0
        if self.cast is not None and not sharded(self.cfg):
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

    def save(self, folder: Path, state: dict[str, Any], *, frozen: bool) -> None:
        out = Path(folder) / self.tag
        model, optim = get_state_dict(self.module, self.optimizer, options=self._options(frozen))
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(out))
        if dist.get_rank() == 0:
            torch.save({"train_state": state, "scheduler": self.scheduler.state_dict(), "micro": self.micro,
                        "zero_stage": self.zero_stage, "world_size": self.world_size,
                        "dtype": str(self.compute_dtype).removeprefix("torch.")}, out / STATE_FILE)

    def load(self, folder: Path, *, frozen: bool) -> dict[str, Any]:
        source = Path(folder) / self.tag
        model, optim = get_state_dict(self.module, self.optimizer, options=self._options(frozen))
        loaded = {"model": model, "optim": optim}
        dcp.load(loaded, checkpoint_id=str(source))
        set_state_dict(self.module, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"], options=self._options(frozen))
        extra = torch.load(source / STATE_FILE, map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.micro = int(extra["micro"])
        return extra["train_state"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's whole state dict, in the dtype the model computed in (as DeepSpeed's 16-bit one)."""
        if sharded(self.cfg):
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


def block_classes(model: nn.Module) -> set[str]:
    """The classes of the model's repeated blocks: transformers' `_no_split_modules`, on the
    model peft wraps too."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard(model: nn.Module, cfg: TrainConfig, device: torch.device, cast: torch.dtype | None) -> nn.Module:
    """FSDP2 over every rank: each block its own unit, the root the rest; then rank 0's weights
    broadcast into the others' shards (built on the meta device, see `building`)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    full = model.state_dict() if dist.get_rank() == 0 else {}
    buffers = sorted(set(dict(model.named_buffers())) - set(model.state_dict()))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.zero_stage == 3}
    if cast is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=torch.float32)
    kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=device.type == "cuda")
                                if cfg.offload_optimizer or cfg.offload_params else OffloadPolicy())
    # Only the text decoder's blocks are units of their own: every micro-batch runs them, on every
    # rank. A VLM's vision tower runs only where a micro-batch has images; as part of the root it
    # is gathered with it on every rank, and a rank without images reduces zeros for it
    # (set_reduce_scatter_unused_params), so no rank waits in a collective the others skip.
    blocks = block_classes(model)
    for module in reversed(list(decoder(model).modules())):  # innermost first
        if type(module).__name__ in blocks and module is not model:
            fully_shard(module, **kwargs)
    # The root (embeddings, final norm, head) keeps its weights gathered from its forward to its
    # backward, as FSDP2 does for a root by default: the chunked loss calls the head after the
    # model's forward returns (raypack/train/objectives/loss.py).
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    reduce_unused(model)
    # The root's pre-backward fires where a gradient reaches one of its outputs, which a VLM's
    # image features do on a rank with images only (seen: Qwen2.5-VL under the chunked loss); by
    # default it would then prefetch a layer, an all-gather the ranks without images never join.
    # Naming the root itself as its prefetch turns that off: its weights are gathered already (no
    # reshard after forward), so its "prefetch" is no collective.
    model.set_modules_to_backward_prefetch([model])
    with warnings.catch_warnings():  # torch's own deprecation, from inside set_model_state_dict (2.13)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device|Multiple backends are registered")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    for name in buffers:  # not in any state dict: rank 0's, on the compute device (offload moves weights only)
        owner, _, attr = name.rpartition(".")
        holder = model.get_submodule(owner) if owner else model
        buf = holder._buffers[attr]
        buf = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
        dist.broadcast(buf, src=0)
        holder._buffers[attr] = buf
    return model


def reduce_unused(model: nn.Module) -> None:
    """Every rank reduces the same gradients: zeros for a weight its micro-batch didn't use (a VLM's
    tower where it had no image), where FSDP2 would otherwise leave it out on that rank alone and
    the ranks' reduce-scatters would disagree. torch 2.13 has the setting; torch 2.11 (the GPU
    image's) hasn't, so there a VLM whose tower or projector trains is refused."""
    if hasattr(model, "set_reduce_scatter_unused_params"):
        model.set_reduce_scatter_unused_params(True)
        return
    from raypack.model.traits import UnsupportedModelError
    from raypack.model.vision import parts

    if not describe(getattr(model, "config", None)).vlm:
        return
    named = dict(model.named_parameters())
    trained = [n for names in parts(model).values() for n in names if named[n].requires_grad]
    if trained:
        raise UnsupportedModelError(
            f"train.engine torch with train.zero_stage 1-3: this torch ({torch.__version__}) has no FSDP2 "
            "set_reduce_scatter_unused_params, so a rank whose micro-batch holds no image would reduce other "
            f"gradients than the others (the vision tower's and projector's, {len(trained)} weights train); use "
            "torch >= 2.13, train.zero_stage 0 (DDP), model.freeze: [vision, projector], or train.engine deepspeed")


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
