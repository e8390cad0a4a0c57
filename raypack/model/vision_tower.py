"""A grid tower's inputs found on the host, and its attention as one varlen call per block.

Qwen's vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) derive everything about the images from
`image_grid_thw`: rotary positions, each image's patch offsets (`cu_seqlens`), Qwen2.5-VL's window
order and window offsets, Qwen3-VL's position-embedding interpolation. Given the grid on the
device, transformers reads it back to build them (`.tolist()`, `repeat_interleave`, boolean
indexing), then reads the offsets back again in every block to split the attention into one SDPA
call per image or window: with the placeholder count, 26 device reads a step for the tiny
Qwen2.5-VL before this module, none after (benchmarks/results/loop_syncs_cpu_20261203.md).
transformers' vision utilities take each value precomputed instead (`image_<name>` keywords of the
model's forward, `vision_utils.get_vision_*`), and the grid is only counted once more, on the
host, where its features are split per image.

So, where the tower takes it (`host_plan_refusal`, by trait):

    collate (prefetch thread)   `plan`: each value transformers' own helper gives for the host
                                grid, as `image_*` keys of the batch
    to_device                   moves them; keeps the host tensors of the grid and of the offsets
                                beside the moved ones (`HOST_COPIED`, exact.keep_host_copy)
    the model's forward         a pre-hook hands the model the host grid (`install`): only the
                                host counts it; everything a kernel reads is on the device
    the placeholder mask        counted on the host (`plan_batch`), so a planned forward takes
                                the model's own masks without transformers' device-side check
    Qwen3-VL's deepstack        its features added at the image tokens' positions, found on the
                                host (`VISUAL_INDEX`), not by a boolean mask, which reads the
                                device twice a layer and three times in its backward
    each block's attention      `TOWER_ATTENTION`: the block's offsets as one varlen kernel call
                                on CUDA (flash-attn, else torch's varlen_attn; fp16/bf16), or one
                                SDPA call per image or window from the host offsets (CPU, fp32)

Bidirectional within each image (or window), nothing across: the kernels take the same offsets
transformers' SDPA split uses. The name holds "flash" because transformers' Qwen towers pass their
offsets to attention only for a flash implementation; it is set on the tower's config after the
model is built, since transformers would try to load a flash kernel for it at load time.

A tower whose forward computes something else from the grid (GLM-4.1V reads it again in its
position embeddings), or calls a helper this module doesn't know, stays on the old path:
transformers' SDPA per image, the grid on the device, its reads with it. The trait is checked by
running a copy of the tower on the meta device with the plan and a host grid, which fails as CUDA
would on a host tensor meeting a device one, and on any read of a device value; and the plan must
be what the tower's own forward computes from the grid (its helpers' values, recorded on the same
copy), so that a planner calling a helper with other arguments than the tower does is caught.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers import vision_utils as vu

from raypack.model.exact import host_copy, keep_host_copy

TOWER_ATTENTION = "raypack_tower_flash_varlen"
"""The tower's attention once `install`ed (see the module doc for the "flash" in it)."""
HOST_COPIED = ("image_grid_thw", "image_cu_seqlens", "image_cu_window_seqlens")
"""Batch keys whose host tensors to_device keeps beside the moved ones (prefetch.HOST_COPIED):
the grid, which the host counts, and the offsets, which the CPU path splits by."""
PLAN_KEY = "image_cu_seqlens"
"""A batch holds a plan when it holds this key."""
VISUAL_INDEX = "raypack_visual_index"
"""A planned batch's image tokens, as positions in its flattened (batch x sequence) tokens, found by
collate on the host: where Qwen3-VL's deepstack layers add the tower's features. The pre-hook takes
it out of the forward's keywords (`_host_grid`), the language model's `_deepstack_process` reads it."""


def _offsets(name: str, longest: str, cu: torch.Tensor) -> dict[str, Any]:
    return {name: cu, longest: int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0}


def _positions(tower, grid):
    return {"position_ids": vu.get_vision_position_ids(grid, tower.spatial_merge_size)}


def _seqlens(tower, grid):
    return _offsets("cu_seqlens", "max_seqlen", vu.get_vision_cu_seqlens(grid))


def _windows(tower, grid):
    index, cu = vu.get_vision_window_index(grid, spatial_merge_size=tower.spatial_merge_size,
                                           window_size=tower.window_size, patch_size=tower.patch_size)  # fmt: skip
    return {"window_index": index, **_offsets("cu_window_seqlens", "max_window_seqlen", cu)}


def _interpolation(tower, grid):
    indices, weights = vu.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)  # fmt: skip
    return {"interp_indices": indices, "interp_weights": weights}


PLANNERS: dict[str, Callable[[Any, torch.Tensor], dict[str, Any]]] = {
    "get_vision_position_ids": _positions,
    "get_vision_attention_seqlens": _seqlens,
    "get_vision_window_index": _windows,
    "get_vision_interpolation_indices_and_weights": _interpolation,
}
"""transformers' vision helpers a tower's forward may call -> the values they give, computed as
the Qwen towers call them (each tower's own arguments: merge, window and patch sizes, its
interpolation settings)."""


def helpers_called(tower: torch.nn.Module) -> set[str]:
    """The vision_utils helpers `tower`'s forward calls (names its code loads from that module)."""
    forward = inspect.unwrap(type(tower).forward)
    names = set(forward.__code__.co_names)
    return {n for n in names if n.startswith("get_vision_") and forward.__globals__.get(n) is getattr(vu, n, None)}


def plan(tower: torch.nn.Module, grid: torch.Tensor) -> dict[str, Any]:
    """What `tower` derives from `grid` (a host tensor), as the model's forward takes it precomputed."""
    grid = torch.as_tensor(grid).cpu()
    out: dict[str, Any] = {}
    for helper in sorted(helpers_called(tower)):
        out.update(PLANNERS[helper](tower, grid))
    return {f"image_{k}": v for k, v in out.items()}


def tower_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The grid tower of a VLM (`visual`, on the *Model inside), through a peft wrapper; else None."""
    from raypack.model.facts import inner as _inner

    tower = getattr(_inner(model), "visual", None)
    return tower if isinstance(tower, torch.nn.Module) else None


def _probe_inputs(config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A host grid of two images (one several windows wide) and their patches' size."""
    m = config.spatial_merge_size
    grid = torch.tensor([[1, 4 * m, 6 * m], [1, 2 * m, 2 * m]])
    width = config.in_channels * getattr(config, "temporal_patch_size", 1) * config.patch_size**2
    return grid, torch.Size([int(grid.prod(-1).sum()), width])


def host_plan_refusal(tower: torch.nn.Module) -> str | None:
    """Why `tower` can't run from a host plan (None: it can). Checked on a meta copy of the tower:
    plan on the host, device values on meta, the grid a host tensor, as on CUDA."""
    helpers = helpers_called(tower)
    unknown = sorted(helpers - PLANNERS.keys())
    if not helpers or unknown:
        what = (f"calls {', '.join(unknown)}, which raypack doesn't precompute" if unknown
                else "takes nothing precomputed")
        return f"{type(tower).__name__}'s forward {what}"
    try:
        grid, shape = _probe_inputs(tower.config)
        copy = _meta_copy(tower)
        values = plan(copy, grid)
        moved = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for key in HOST_COPIED:
            if key in moved:
                keep_host_copy(moved[key], values[key])
        kwargs = {k.removeprefix("image_"): v for k, v in moved.items()}
        with torch.no_grad():
            copy(torch.empty(shape, device="meta"), grid_thw=grid, **kwargs)
    except Exception as e:  # what would fail on CUDA: a host tensor meeting a device one, or a read
        return f"{type(tower).__name__} with its grid on the host and its values precomputed: {type(e).__name__}: {e}"
    differs = _differs_from_own(copy, grid, shape)
    if differs:
        return f"{type(tower).__name__}'s own {differs} gives other values than raypack's plan for it"
    return None


def _differs_from_own(copy: torch.nn.Module, grid: torch.Tensor, shape: torch.Size) -> str | None:
    """The first helper whose values, as the tower's forward calls it itself (recorded on the
    meta copy given only the host grid: the helpers run on the host, before anything meets a meta
    tensor), are not `plan`'s; None when all agree. So the planners' arguments are the tower's."""
    names = helpers_called(copy)
    space = inspect.unwrap(type(copy).forward).__globals__
    own: dict[str, Any] = {}

    def recorder(name):
        def run(*args, **kwargs):
            own[name] = space_helpers[name](*args, **kwargs)
            return own[name]

        return run

    space_helpers = {n: space[n] for n in names}
    try:
        space.update({n: recorder(n) for n in names})
        with torch.no_grad():
            copy(torch.empty(shape, device="meta"), grid_thw=grid)
    except Exception:  # expected: the helpers' host tensors meet the meta ones after they ran
        pass
    finally:
        space.update(space_helpers)
    for name in sorted(names):
        theirs = own.get(name)
        theirs = [t for t in (theirs if isinstance(theirs, tuple) else (theirs,)) if isinstance(t, torch.Tensor)]
        mine = [t for t in PLANNERS[name](copy, grid).values() if isinstance(t, torch.Tensor)]
        if len(theirs) != len(mine) or not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(theirs, mine)):
            return name
    return None


def _meta_copy(tower: torch.nn.Module) -> torch.nn.Module:
    """A weightless copy of `tower` with the tower attention. Built by the class itself, never
    under ZeRO-3's zero.Init (as build.meta_model: a probe needs no partitions, nor their gathers)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    config = deepcopy(tower.config)
    config._attn_implementation = "sdpa"
    zero3, hf_deepspeed._hf_deepspeed_config_weak_ref = hf_deepspeed._hf_deepspeed_config_weak_ref, None
    try:
        with torch.device("meta"):
            copy = type(tower)(config)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = zero3
    _set_attention(copy)
    return copy


def _set_attention(tower: torch.nn.Module) -> None:
    register()
    for module in tower.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            config._attn_implementation = TOWER_ATTENTION


def install(model: torch.nn.Module) -> str | None:
    """Run `model`'s grid tower from host plans with `TOWER_ATTENTION` where it can
    (`host_plan_refusal`); returns why not (None: installed, or no grid tower at all)."""
    tower = tower_of(model)
    if tower is None or installed(model):
        return None
    refusal = host_plan_refusal(tower)
    if refusal is not None:
        return refusal
    _set_attention(tower)
    tower._raypack_host_plan = True
    from raypack.model.facts import inner as _inner

    inner = _inner(model)
    inner.register_forward_pre_hook(_host_grid, with_kwargs=True)
    if _same_masks(inner):
        inner.get_placeholder_mask = types.MethodType(_placeholder_mask, inner)
    text = getattr(inner, "language_model", None)
    if text is not None and _same_deepstack(text):
        text._deepstack_process = types.MethodType(_deepstack_process, text)
    return None


def installed(model: torch.nn.Module) -> bool:
    tower = tower_of(model)
    return tower is not None and getattr(tower, "_raypack_host_plan", False)


def _host_grid(module, args, kwargs):
    """With a plan in the batch, the model's forward gets the grid collate built (its host copy):
    the tower needs nothing from it, and get_image_features counts each image's features from it.
    The placeholder tokens were counted against the grid on the host (`plan_batch`)."""
    grid = kwargs.get("image_grid_thw")
    module._raypack_host_counted = PLAN_KEY in kwargs
    index = kwargs.pop(VISUAL_INDEX, None)  # not a keyword of the model's: the language model reads it
    text = getattr(module, "language_model", None)
    if text is not None:
        text._raypack_visual_index = index
    if PLAN_KEY in kwargs and isinstance(grid, torch.Tensor):
        host = host_copy(grid)
        if host is not None:
            kwargs["image_grid_thw"] = host
    return args, kwargs


def plan_batch(tower: torch.nn.Module, batch: dict[str, Any], image_token: int) -> dict[str, Any]:
    """`plan` for a packed batch, its image tokens first counted against its grid on the host (the
    check transformers makes on the device, `get_placeholder_mask`, which a planned forward skips)."""
    grid = batch["image_grid_thw"]
    features = int((grid.prod(-1) // tower.spatial_merge_size**2).sum())
    index = torch.nonzero(batch["input_ids"].reshape(-1) == image_token).squeeze(1)
    if len(index) != features:
        raise ValueError(f"a packed row holds {len(index)} image tokens for {features} image features")
    return {**plan(tower, grid), VISUAL_INDEX: index}


def _placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
    """transformers' get_placeholder_mask of the Qwen VLMs without its count check on the device,
    for a planned forward, whose count the host checked (`plan_batch`); transformers' own otherwise."""
    if input_ids is None or not getattr(self, "_raypack_host_counted", False):
        return type(self).get_placeholder_mask(self, input_ids, inputs_embeds=inputs_embeds,
                                               image_features=image_features, video_features=video_features)  # fmt: skip
    return tuple((input_ids == token).unsqueeze(-1).to(inputs_embeds.device)
                 for token in (self.config.image_token_id, self.config.video_token_id))  # fmt: skip


def _same_masks(inner: torch.nn.Module) -> bool:
    """Whether `_placeholder_mask` gives what `inner`'s own get_placeholder_mask gives (a probe row
    of text, image and video tokens): the trait that lets a planned forward skip the device check."""
    own = getattr(type(inner), "get_placeholder_mask", None)
    config = getattr(inner, "config", None)
    image, video = getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)
    if own is None or image is None or video is None:
        return False
    ids = torch.tensor([[0 if 0 not in (image, video) else 1, image, image, video]])
    embeds = torch.zeros(1, 4, 2)
    try:
        theirs = own(inner, ids, inputs_embeds=embeds, image_features=torch.zeros(2, 2),
                     video_features=torch.zeros(1, 2))
        inner._raypack_host_counted = True
        mine = _placeholder_mask(inner, ids, embeds, torch.zeros(2, 2), torch.zeros(1, 2))
    except Exception:
        return False
    finally:
        inner._raypack_host_counted = False
    return len(theirs) == len(mine) == 2 and all(torch.equal(a, b) for a, b in zip(theirs, mine))


def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
    """transformers' Qwen3-VL `_deepstack_process` (the features added at the image tokens: clone,
    gather, add, scatter) at the positions collate found (`VISUAL_INDEX`) instead of by the mask,
    whose boolean indexing reads the device; transformers' own for a forward without them."""
    index = getattr(self, "_raypack_visual_index", None)
    if index is None:
        return type(self)._deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds)
    visual_embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1]).clone()
    flat[index] = flat[index] + visual_embeds
    return flat.view_as(hidden_states)


def _same_deepstack(text: torch.nn.Module) -> bool:
    """Whether `_deepstack_process` gives what `text`'s own gives, values and gradients, on a probe
    of two rows (the trait that lets a planned forward add by host positions)."""
    own = getattr(type(text), "_deepstack_process", None)
    if own is None:
        return False
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 3, generator=gen, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    embeds = torch.randn(4, 3, generator=gen, requires_grad=True)
    try:
        theirs = own(text, hidden, mask, embeds)
        text._raypack_visual_index = torch.nonzero(mask.reshape(-1)).squeeze(1)
        mine = _deepstack_process(text, hidden, mask, embeds)
        grads = [torch.autograd.grad((out * out).sum(), (hidden, embeds)) for out in (theirs, mine)]
    except Exception:
        return False
    finally:
        text._raypack_visual_index = None
    return torch.equal(theirs, mine) and all(torch.equal(a, b) for a, b in zip(*grads))


# --- the tower's attention ------------------------------------------------------------------------


def _kernel(query: torch.Tensor) -> str | None:
    from raypack.model.attention import flash_attn_available

    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    return "flash_attn" if flash_attn_available() else "torch_varlen"


def _thd(x: torch.Tensor) -> torch.Tensor:
    return x[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)


def tower_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                    cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, **kwargs):  # fmt: skip
    """transformers attention function for a tower's block: query/key/value (1, H, T, D), every
    image (or window) of `cu_seq_lens_q` attending within itself, bidirectionally; returns
    ((1, T, H, D), None) as transformers' sdpa does."""
    if attention_mask is not None or is_causal or cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"{type(module).__name__}: raypack's tower attention takes one row of images split by "
                         "cu_seqlens, bidirectional, with no mask")  # fmt: skip
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError(f"{type(module).__name__}: raypack's tower attention is self-attention (cu_seq_lens_k == _q)")
    kernel = _kernel(query)
    if kernel is not None and max_length_q is not None:
        cu = cu_seq_lens_q.to(query.device, torch.int32)
        q, k, v = _thd(query), _thd(key), _thd(value)
        if kernel == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(q, k, v, cu, cu, max_length_q, max_length_q, dropout_p=dropout,
                                         softmax_scale=scaling, causal=False)  # fmt: skip
        else:
            from torch.nn.attention.varlen import varlen_attn

            if dropout:
                raise ValueError("torch varlen_attn has no attention dropout; the tower sets it, so install flash-attn")
            out = varlen_attn(q, k, v, cu, cu, max_length_q, max_length_q, scale=scaling)  # (-1, -1): no mask
        return out[None], None
    host = host_copy(cu_seq_lens_q)
    bounds = (host if host is not None else cu_seq_lens_q).tolist()  # a device read only without a plan
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                            scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    return torch.cat(parts, 2).transpose(1, 2).contiguous(), None


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(TOWER_ATTENTION, tower_attention)
        _registered = True
