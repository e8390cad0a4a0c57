"""LoRA and QLoRA adapters on a causal LM, through the `peft` library (`model.peft`).

    model = apply_adapters(load_model(name), cfg.model.peft)     # a peft.PeftModel: base frozen
    adapted_head(model)                                          # does an adapter reach the output head?

The adapters are peft's own layers: raypack writes none by hand. What it adds is the rule every
other path follows, exact or refused: the adapters sit inside linear layers, which act on each
token alone, so packing changes nothing about them. What packing could break is the attention
between examples, and that is the attention backend's business (`attention.py`), unchanged here.
Three things do need care:

- The chunked loss (raypack/train/objectives/loss.py) computes logits with the output head's own weight. An
  adapter on the head (`target_modules` or `modules_to_save` reaching it) changes that function,
  so the loss asks `adapted_head` (the model, not the config's names) and refuses.
- `all-linear` in peft takes every nn.Linear but the head, MoE routers that subclass it included;
  those return more than a tensor, so raypack leaves them out (`custom_linears`).
- A hybrid's mixers read some weights themselves (raypack/model/mixers.py): a convolution's on
  every path (an adapter there is refused), and Mamba-2's `out_proj` in mamba-ssm's fused
  training kernel. `all-linear` leaves `out_proj` out; a target list that names it keeps that
  layer off the fused kernel, so the adapter runs on every device.
- Gradient checkpointing: with a frozen embedding the checkpointed blocks' inputs need not
  require grad, and a reentrant checkpoint then gives the adapters no gradient. raypack uses
  non-reentrant checkpoints, which don't depend on it, and still turns input gradients on, as
  peft's own recipes do, so a model whose checkpointing is reentrant trains too.

QLoRA loads the base weights in 4 bits (bitsandbytes NF4, compute in the model's dtype) and needs
CUDA; `raypack.train.preflight` refuses it elsewhere before Ray starts.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from typing import Any

import torch
from torch import nn

from raypack.config import PeftConfig
from raypack.errors import InputError
from raypack.model import mixers


class AdapterError(InputError):
    """`model.peft` can't be applied to this model as configured (its message names the key)."""


ALL_LINEAR = ("all-linear",)


def lora_config(cfg: PeftConfig, exclude: list[str] | None = None):
    """The peft LoraConfig for `cfg`; `exclude`: module names `all-linear` must leave out."""
    from peft import LoraConfig

    return LoraConfig(
        exclude_modules=exclude or None,
        task_type="CAUSAL_LM",
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if tuple(cfg.target_modules) == ALL_LINEAR else list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) or None,
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        bias="none",
    )


def apply_adapters(model: nn.Module, cfg: PeftConfig, name: str = "model") -> nn.Module:
    """`model` wrapped by peft with `cfg`'s adapters: only they (and `modules_to_save`) train."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise AdapterError("model.peft.method: needs the peft package (pip install 'raypack[peft]')") from None
    custom = custom_linears(model)
    all_linear = tuple(cfg.target_modules) == ALL_LINEAR
    try:
        wrapped = _peft_model(model, lora_config(cfg, exclude=custom + mixers.fused_linears(model) if all_linear else None))
    except ValueError as e:  # target modules that match nothing, or a layer type peft can't adapt
        raise AdapterError(f"model.peft.target_modules {list(cfg.target_modules)} on {name}: {e}") from None
    if not all_linear and (named := [n for n in custom if is_adapted(wrapped.get_submodule(f"base_model.model.{n}"))]):
        raise AdapterError(
            f"model.peft.target_modules {list(cfg.target_modules)} on {name}: reaches {named[0]}, a "
            f"{type(model.get_submodule(named[0])).__name__} whose forward is not a plain linear layer's (a router "
            "returning scores and choices), which a LoRA layer can't wrap; leave it out"
        )
    if not all_linear and (where := mixers.read_by_weight(wrapped.get_base_model(), is_lora_layer)):
        raise AdapterError(f"model.peft.target_modules {list(cfg.target_modules)} on {name}: reaches {where}; "
                           "leave it out")
    mixers.keep_unfused(wrapped, is_lora_layer)  # a fused Mamba-2 kernel would skip an adapted out_proj
    # transformers >= 5.2x renamed the flag (the old name warns)
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(model, flag, False):
        wrapped.enable_input_require_grads()
    return wrapped


def _peft_model(model: nn.Module, config) -> nn.Module:
    """peft's `get_peft_model`, without the FutureWarning every worker would print: peft reads
    transformers' old `is_gradient_checkpointing` name, which transformers >= 5.2x warns about."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def custom_linears(model: nn.Module) -> list[str]:
    """Linear subclasses with a forward of their own (Llama 4's and PhiMoE's routers return scores
    and choices): a LoRA layer adds its output to the base layer's and needs a tensor back, so
    `all-linear` leaves these out and a named target may not reach them."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward]


def is_lora_layer(module: nn.Module | None) -> bool:
    """Whether `module` is one of peft's adapter layers (its forward adds the adapter; its
    `weight` is the base layer's alone). A modules_to_save copy is not: its `weight` is the copy's."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def is_adapted(module: nn.Module) -> bool:
    """Whether peft replaced or wrapped `module` (a LoRA layer, or a modules_to_save copy)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    return isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))


def adapted_head(model: nn.Module) -> bool:
    """Whether an adapter reaches the model's output head (peft installed or not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and importlib.util.find_spec("peft") is not None and is_adapted(head)


def quantization_config(dtype: torch.dtype):
    """QLoRA's base weights: 4-bit NF4 with double quantization, computing in `dtype`."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise AdapterError("model.peft.method=qlora: needs the bitsandbytes package on the workers (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
    )


def trainable_summary(model: nn.Module) -> dict[str, Any]:
    """Trainable and total parameter counts (under ZeRO-3, from each parameter's full size)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable_params": trainable, "total_params": total}


def frozen_digest(model: nn.Module) -> int:
    """A checksum of the bits of this rank's frozen weights (under ZeRO-3, its partition of them):
    it changes if any bit of any frozen weight does, short of a collision. Computed on the weights'
    device, a few int64 sums per tensor, so it costs seconds even for 70B."""
    _at_rest(model)
    return tensor_digest(_held(p) for _, p in _frozen(model))


def frozen_sum(model: nn.Module) -> int:
    """This rank's share of a checksum of the frozen weights that doesn't depend on how the ranks
    hold them: every value weighted by its place in its whole tensor (`_held_at`), each value
    counted on one rank only, so the ranks' shares add up (mod 2**64) to what one process holding
    every weight whole computes, on any worker count and any sharding. A LoRA run resumed on
    another worker count compares it (checkpoint.same_base), where `frozen_digest`'s per-rank
    checksums of shards can't be: another count cuts the shards otherwise."""
    _at_rest(model)
    total = 0
    for index, (_, p) in enumerate(_frozen(model)):
        held = _held_at(p)
        if held is None:
            continue
        values, offset = held
        total += pow(_SPREAD, index + 1, 1 << 64) * _placed_sum(values, offset)
    return total % (1 << 64)


_SPREAD = 0x9E3779B97F4A7C15  # odd: tensor i's sum is multiplied by its (i+1)th power, so order counts


def _placed_sum(values: torch.Tensor, offset: int) -> int:
    """Sum of `values`' bits (a flat slice starting at `offset` of its whole tensor), each times a
    weight of its place in the whole tensor, mod 2**64 (int64 sums wrap: shares still add up)."""
    bits = values.detach().reshape(-1)
    bits = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
    total = 0
    for start in range(0, bits.numel(), 1 << 24):
        chunk = bits[start:start + (1 << 24)].to(torch.int64)
        where = torch.arange(offset + start, offset + start + chunk.numel(), device=chunk.device) % 65521 + 1
        total += int((chunk * where).sum())
    return total % (1 << 64)


def _held_at(p: nn.Parameter) -> tuple[torch.Tensor, int] | None:
    """`_held(p)` flattened, with the place in the whole flattened tensor where it starts; None
    where another rank counts these values (replicas: rank 0 counts a tensor every rank holds,
    the first replica group an HSDP shard)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if hasattr(p.data, "to_local"):  # FSDP2: dim-0 chunks (torch.chunk) over the mesh's Shard dim
        from torch.distributed.tensor import Replicate, Shard

        mesh, start, sharded = p.data.device_mesh, 0, False
        for dim, placement in enumerate(p.data.placements):
            coordinate = mesh.get_local_rank(dim)
            if isinstance(placement, Replicate):
                if coordinate:
                    return None
            elif isinstance(placement, Shard) and placement.dim == 0 and not sharded:
                start, sharded = coordinate * -(-p.shape[0] // mesh.size(dim)), True
            else:
                raise ValueError(f"frozen_sum: {placement} of a frozen weight's {p.data.placements}; FSDP2 "
                                 "shards on dim 0 only")
        return p.data.to_local().reshape(-1), start * (p.numel() // max(1, p.shape[0]))
    part = getattr(p, "ds_tensor", None)
    if part is not None:  # ZeRO-3: this rank's slice of the flattened tensor
        return _held(p).reshape(-1), rank * part.numel()
    return (p.data.reshape(-1), 0) if rank == 0 else None


def weights_digest(model: nn.Module, frozen_only: bool = False) -> int:
    """`frozen_digest` over every weight of this rank (or the frozen ones alone): what identifies
    the starting weights of a DPO reference (raypack/train/objectives/dpo_reference.py)."""
    _at_rest(model)
    params = _frozen(model) if frozen_only else sorted(model.named_parameters(), key=lambda item: item[0])
    return tensor_digest(_held(p) for _, p in params)


def _at_rest(model: nn.Module) -> None:
    """FSDP2's units back to their shards. A unit that keeps its weights gathered after its forward
    (train.zero_stage 1-2, and the root at every stage) registers the whole tensors as its
    parameters until a backward reshards it, and the loss probe's forward has none: a digest
    taken then would be of every weight on every rank, not of the `fsdp` shards
    `expected_digests` rebuilds, and one taken at the last step of what that step left gathered.
    Resharding only frees the gathered copies (no collective); the next forward gathers again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _held(p: nn.Parameter) -> torch.Tensor:
    """The values of `p` this rank holds: all of them; under ZeRO-3 its slice of the flattened
    tensor without the padding DeepSpeed adds to the last slices (left uninitialized, so it would
    change the checksum from one start to the next); under FSDP2 its dim-0 shard (a DTensor's local
    part, without FSDP2's padding)."""
    if hasattr(p.data, "to_local"):
        return p.data.to_local()
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p.data
    size = part.numel()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return part.reshape(-1)[:max(0, min(size, p.ds_numel - rank * size))]


def expected_digests(model: nn.Module, world_size: int, layout: str, dtype: torch.dtype | None = None,
                     shard_ranks: int | None = None) -> list[int]:
    """What `frozen_digest` returns on each of `world_size` ranks that trained `model` (its frozen
    weights whole, here on one process), by how the ranks held them (`layout`): `replicated`, the
    same on every rank; `zero3`, each rank's slice of every flattened tensor, as DeepSpeed partitions
    them (the numel padded up to a multiple of the world size, the padding left out); `fsdp`, each
    rank's dim-0 chunk, as FSDP2 shards them (torch.chunk, an empty one past the last), over
    `shard_ranks` ranks (default all; under HSDP one node's, rank r holding chunk r mod it). `dtype`:
    every frozen weight as the ranks held it in that dtype (DeepSpeed holds all of them in its
    training dtype, the weights transformers loads in fp32 too: `_keep_in_fp32_modules_strict`)."""
    frozen = [(n, p.data if dtype is None else p.data.to(dtype)) for n, p in _frozen(model)]
    if layout == "replicated":
        return [tensor_digest(t for _, t in frozen)] * world_size
    if layout == "fsdp":
        group = shard_ranks or world_size

        def chunk(t: torch.Tensor, index: int) -> torch.Tensor:
            chunks = torch.chunk(t, group, dim=0)
            return chunks[index] if index < len(chunks) else t.new_empty(0)

        shards = [tensor_digest(chunk(t, index) for _, t in frozen) for index in range(group)]
        return [shards[rank % group] for rank in range(world_size)]
    if layout != "zero3":
        raise ValueError(f"expected_digests: layout {layout!r}; expected replicated, zero3 or fsdp")
    flat = [t.reshape(-1) for _, t in frozen]
    sizes = [-(-t.numel() // world_size) for t in flat]  # DeepSpeed's partition size
    return [tensor_digest(t[rank * size:(rank + 1) * size] for t, size in zip(flat, sizes)) for rank in range(world_size)]


def _frozen(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in sorted(model.named_parameters(), key=lambda item: item[0]) if not p.requires_grad]


def tensor_digest(tensors) -> int:
    """`frozen_digest`'s checksum of a sequence of tensors, in order."""
    total = 0
    for t in tensors:
        t = t.detach().reshape(-1)
        bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        for start in range(0, bits.numel(), 1 << 24):
            chunk = bits[start:start + (1 << 24)].to(torch.int64)
            # weight each element by its position, so swapped or shifted values change the sum too
            where = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65521 + 1
            total = (total * 1_000_003 + int((chunk * where).sum())) % (1 << 61)
    return total


def is_peft_model(model: nn.Module) -> bool:
    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save_adapted(model: nn.Module, state: dict[str, torch.Tensor], folder, *, merge: bool, tokenizer=None,
                 trust_remote_code: bool = False) -> list[str]:
    """Write what a LoRA run leaves behind into `folder`, from `model` (the trained PeftModel, whose
    weights may be ZeRO-3 partitions) and `state` (its full state dict, gathered):

    - `adapter/`: the adapters in peft's format (`PeftModel.from_pretrained(base, folder / "adapter")`);
    - `base/`, for a base built from a config (no checkpoint to load it from): the frozen base weights;
    - `model/`, if `merge`: the merged model (`merge_and_unload`), a plain transformers folder.

    The tokenizer goes beside each. A CPU copy is rebuilt from `state` (built on the meta device, the
    tensors assigned), so the training model is never touched. Returns the folder names written."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    base_config = model.get_base_model().config
    from raypack.model.facts import vlm_class

    auto = vlm_class(base_config) or AutoModelForCausalLM  # a VLM rebuilds as what it trained as
    with torch.device("meta"):
        base = auto.from_config(base_config, trust_remote_code=trust_remote_code)
        rebuilt = _peft_model(base, model.peft_config["default"])
    rebuilt.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, strict=False, assign=True)
    if missing := [n for n, p in rebuilt.named_parameters() if p.is_meta]:
        raise RuntimeError(f"saving the adapters: {len(missing)} weights missing from the gathered state, e.g. {missing[0]}")
    written = {"adapter": rebuilt}
    rebuilt.save_pretrained(folder / "adapter", safe_serialization=True)
    if not base_config._name_or_path:
        # unload() strips the adapters in place: do it on a copy (a tiny model: built from a config)
        written["base"] = copy.deepcopy(rebuilt).unload()
    if merge:
        written["model"] = rebuilt.merge_and_unload()
    for name, m in written.items():
        if name != "adapter":
            if getattr(m.config, "tie_word_embeddings", False):
                m.tie_weights()  # the assigned tensors are two objects; tied models save one
            m.save_pretrained(folder / name, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / name)
    return list(written)
