"""FSDP2 for the torch engine (train.zero_stage 1-3 on more than one rank), in the order of
torchtitan's `parallelize`: the mesh, the units, then the weights loaded into the shards.

Mesh (`mesh_shape`): one flat dimension over every rank on one node. Across nodes with equal
local counts, HSDP: a 2-D mesh (replicate across nodes, shard within a node), so the per-layer
all-gathers and reduce-scatters stay on the node's NVLink and only one all-reduce of each
shard's gradients a step crosses the network. Each rank then holds 1/(ranks a node) of the
model, not 1/(all ranks): the price of keeping the gathers off the network.

Units (`wrap`): each of the model's repeated blocks (transformers' `_no_split_modules`), the
input embedding and the output head each their own unit (torchtitan's), so no rank holds the
vocabulary matrices gathered beside a layer's; a head tied to the embedding is one weight, which
FSDP2 can shard in one unit only: both stay in the root then. The root holds the rest (final
norm, a VLM's vision tower and projector: see `wrap`).

Stages, as DeepSpeed's (`accumulate`): 1-2 keep the gathered weights from an optimizer step's
first forward to its last backward and reduce-scatter the gradients once, in that last backward
(`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)` on the micro-batches
before it); 3 lets each unit's weights go after its forward and its backward, and reduce-scatters
every micro-batch's gradients, gathering each unit twice a micro-batch.

Loading (`load`), for a 70B model on nodes of 8 GPUs: rank 0 reads the checkpoint, in its own
dtype (bf16: 70e9 x 2 B = 140 GB of host memory, on one rank of the node; nodes of 8 H100s have
1-2 TB), and every other rank builds the structure on the meta device (0 B). Rank 0 takes its
model's tensors out as a state dict and puts the model itself on the meta device too; every rank
shards the meta model and only then materializes its shards (1/8: 35 GB of fp32 master weights
a GPU under precision mixed), and rank 0 broadcasts one tensor at a time into them, each rank
keeping its slice, cast to the shard's dtype as it is copied. Every rank reading its own shard
from disk would need 140/8 = 17.5 GB a rank, but it bypasses transformers' loading (its key
renames and weight conversions, a fused MoE's experts), the exact model raypack trains on; and
rank 0 casting to fp32 before sharding would hold 280 GB. Peak beside the shards: one full
tensor on each GPU during its broadcast (the embedding: 128k x 8192 x 2 B = 2 GB).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from raypack.config import TrainConfig
from raypack.model.facts import decoder, describe


def offloads(cfg: TrainConfig) -> bool:
    """Whether FSDP2 keeps the shards and the optimizer step on the host (CPUOffloadPolicy)."""
    return cfg.offload_optimizer or cfg.offload_params


# --- the mesh -------------------------------------------------------------------------------------


def mesh_shape(layout: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """(nodes, ranks a node) for HSDP, or (world,): `layout` is each rank's (node rank, local rank,
    local world size), in rank order. 2-D only where the ranks fill several nodes equally and in
    order (node k holds ranks k*L .. k*L+L-1, as Ray Train numbers them): otherwise a replica
    group would span nodes, or one node would hold two shards of a replica."""
    world = len(layout)
    per_node = layout[0][2] if layout else 1
    nodes = world // per_node if per_node else 0
    in_order = all(rank == (r // per_node, r % per_node, per_node) for r, rank in enumerate(layout))
    return (nodes, per_node) if nodes > 1 and nodes * per_node == world and in_order else (world,)


def rank_layout() -> list[tuple[int, int, int]]:
    """Every rank's (node rank, local rank, local world size), as Ray Train (or torchrun) sets them."""
    mine = tuple(int(os.environ.get(k, default)) for k, default in
                 (("NODE_RANK", 0), ("LOCAL_RANK", dist.get_rank()), ("LOCAL_WORLD_SIZE", dist.get_world_size())))
    layout: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layout, mine)
    return layout


def device_mesh(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(rank_layout())
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


# --- the units --------------------------------------------------------------------------------------


def block_classes(model: nn.Module) -> set[str]:
    """The classes of the model's repeated blocks: transformers' `_no_split_modules`, on the
    model peft wraps too."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def _ends(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output head, where each can be a unit: neither when tied (one
    weight in two modules), nor a head peft replaced (its own forward, not the Linear's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if embed is None or head is None or head.weight is embed.weight:
        return []
    return [m for m in (embed, head) if isinstance(m, (nn.Embedding, nn.Linear))]


def wrap(model: nn.Module, cfg: TrainConfig, mesh, device: torch.device, cast: torch.dtype | None) -> None:
    """fully_shard the blocks, the embedding and head, then the root (module doc)."""
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.zero_stage == 3}
    if cast is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=torch.float32)
    kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offloads(cfg) else OffloadPolicy()
    # Only the text decoder's blocks are units of their own: every micro-batch runs them, on every
    # rank. A VLM's vision tower runs only where a micro-batch has images; as part of the root it
    # is gathered with it on every rank, and a rank without images reduces zeros for it
    # (set_reduce_scatter_unused_params), so no rank waits in a collective the others skip.
    blocks = block_classes(model)
    for module in reversed(list(decoder(model).modules())):  # innermost first
        if type(module).__name__ in blocks and module is not model:
            fully_shard(module, **kwargs)
    vlm = describe(getattr(model, "config", None)).vlm
    # The head is called by the chunked loss after the model's forward returns, through its own
    # module (raypack/train/objectives/loss.py `_forward_as`), so its unit's hooks gather it then.
    # A VLM's stay in the root: where a rank's micro-batch has images, their features reach the
    # root's pre-backward by another path than the ranks without, and the units' order differs.
    for module in [] if vlm else _ends(model):
        fully_shard(module, **kwargs)
    # The root keeps its weights gathered from its forward to its backward, as FSDP2 does for a
    # root by default: under stage 3 too, since a VLM's image features reach it late (below).
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    reduce_unused(model)
    # The root's pre-backward fires where a gradient reaches one of its outputs, which a VLM's
    # image features do on a rank with images only (seen: Qwen2.5-VL under the chunked loss); by
    # default it would then prefetch a layer, an all-gather the ranks without images never join.
    # Naming the root itself as its prefetch turns that off: its weights are gathered already (no
    # reshard after forward), so its "prefetch" is no collective.
    model.set_modules_to_backward_prefetch([model])


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of a sharded model, found once: the chunked loss swaps the head out of the
    model during its forward (raypack/train/objectives/loss.py), so `model.modules()` then misses it."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def accumulate(found: list[nn.Module], cfg: TrainConfig, last: bool) -> None:
    """Before a micro-batch's forward, on the model's `units`: stages 1-2 reduce-scatter and let
    the weights go in the last micro-batch's backward only (module doc); stage 3 every micro-batch."""
    if cfg.zero_stage < 3:
        for unit in found:
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)


def reshard(model: nn.Module) -> None:
    """Every unit's weights back to their shards: stages 1-2 keep them gathered after a forward
    without a backward (the loss probe's, an eval's) until the next backward, and a state dict
    read meanwhile would hold whole tensors where the checkpoint's layout has shards."""
    for unit in units(model):
        unit.reshard()


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


# --- the weights ------------------------------------------------------------------------------------


def to_meta(model: nn.Module) -> None:
    """Every parameter and buffer on the meta device, tied ones still one object (Module.to
    would make two): what rank 0 holds once its tensors are taken out as a state dict."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.is_meta:
                    continue
                if id(t) not in new:
                    meta = torch.empty_like(t, device="meta")
                    new[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                table[name] = new[id(t)]


def shard(model: nn.Module, cfg: TrainConfig, device: torch.device, cast: torch.dtype | None) -> nn.Module:
    """FSDP2 over every rank (module doc): rank 0's weights, taken out, loaded into every rank's
    shards; the weights that train in fp32 under precision mixed (`cast` set)."""
    persistent = set(model.state_dict())  # the buffers in it: loaded with the weights
    full = model.state_dict() if dist.get_rank() == 0 else {}
    buffers = dict(model.named_buffers()) if dist.get_rank() == 0 else {}
    to_meta(model)
    if cast is not None:  # the master copy: fp32 on the meta device, materialized as 1/N shards
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    wrap(model, cfg, device_mesh(device), device, cast)
    model.to_empty(device="cpu" if offloads(cfg) else device)
    with warnings.catch_warnings():  # torch's own deprecation, from inside set_model_state_dict (2.13)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device|Multiple backends are registered")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    load_buffers(model, buffers, persistent, device)
    return model


def load_buffers(model: nn.Module, rank0: dict[str, torch.Tensor], persistent: set[str], device: torch.device) -> None:
    """The buffers that no state dict holds (rotary frequencies): rank 0's, broadcast, on the
    compute device; the state dict's own (loaded above) moved there too (offload moves weights only)."""
    names = sorted(dict(model.named_buffers()))
    for name in names:
        owner, _, attr = name.rpartition(".")
        holder = model.get_submodule(owner) if owner else model
        buf = holder._buffers[attr]
        if name in persistent:
            holder._buffers[attr] = buf.to(device)
            continue
        buf = rank0[name].to(device) if dist.get_rank() == 0 else torch.empty_like(buf, device=device)
        dist.broadcast(buf, src=0)
        holder._buffers[attr] = buf
