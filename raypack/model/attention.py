"""Varlen attention for packed rows, registered with transformers' attention interfaces.

A packed batch is one row of concatenated examples (see `raypack.data.collate`). Collate
computes `cu_seq_lens_q/k` (int32 offsets of every example) and `max_length_q/k` (a Python
int) once on the host; transformers forwards them as keyword arguments to every attention
call, so no layer recomputes boundaries.

Backends (`model.attention`), the transformers name each is registered under, and where
`auto` (`raypack_varlen`) picks them at call time:

    flash_attn    raypack_fa_varlen     flash_attn.flash_attn_varlen_func     CUDA, flash-attn installed
    torch_varlen  raypack_torch_varlen  torch.nn.attention.varlen.varlen_attn  CUDA, fp16/bf16
    sdpa_varlen   raypack_exact_varlen  SDPA (or the eager formula) per example  any device and dtype

The registered names contain neither `sdpa` nor `flash`: transformers decides behaviour by
substring. A name with `sdpa` runs the model's SDPA-support check (which refuses Gemma2 and
GPT-OSS although this path handles them exactly); one with `flash` makes transformers try to
load it as a flash kernel (from_pretrained fails: "Could not find the currently requested
flash attention implementation") and makes Falcon, GPT-J and GPT-Neo swap in their own
flash-attention classes, which never call ours.

The exact path (`exact.py`) runs every example (every chunk, for chunked-attention layers) on
its own: its cost is Σ len², like the CUDA kernels', not (Σ len)². It applies what
transformers' eager attention applies: scaling, GQA, sliding windows, logit softcapping,
attention sinks (`s_aux`, an extra per-head logit in the softmax denominator), chunked
attention and dropout. The kernels get chunked layers as cu_seqlens cut at chunk boundaries
and refuse sinks.

No mask function is registered next to the names (transformers' AttentionMaskInterface), so
transformers' mask code returns None at once for them: boundaries come from cu_seqlens, a 4D mask
would cost O(T^2) memory for nothing, and with a mask function registered transformers first
looks for packed rows in `position_ids` (masking_utils.find_packed_sequence_indices), reading the
device once a forward (twice with sliding-window layers) for a mask nobody uses. A real padding
mask, which that early return would drop, is refused where the decoder is called instead
(`refuse_padding_masks`, installed by build.load_model).
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

import torch
from transformers import AttentionInterface

from raypack.model import ulysses
from raypack.model.exact import LastCache, chunk_cu_seqlens, exact_attention
from raypack.model.traits import PADDED, UnsupportedModelError, decoder, row_scaled_layers

__all__ = ["NAMES", "BACKENDS", "attn_implementation_name", "chunk_cu_seqlens", "refuse_padding_masks", "register"]

NAMES = {
    "auto": "raypack_varlen",
    "flash_attn": "raypack_fa_varlen",
    "torch_varlen": "raypack_torch_varlen",
    "sdpa_varlen": "raypack_exact_varlen",
}
"""`model.attention` value -> the attn_implementation name registered with transformers."""
BACKENDS = ("flash_attn", "torch_varlen", "sdpa_varlen")
"""Explicit backend names accepted by `attn_implementation_name`; plus `auto`."""
AUTO_NAME = NAMES["auto"]
BACKEND_OF = {name: attention for attention, name in NAMES.items()}
"""Registered name -> `model.attention` value."""


def attn_implementation_name(attention: str = "auto") -> str:
    """The transformers `attn_implementation` string for a raypack backend (registers them)."""
    register()
    if attention not in NAMES:
        raise ValueError(f"unknown packed attention backend {attention!r}; expected auto or one of {', '.join(BACKENDS)}")
    if attention == "flash_attn" and not flash_attn_available():
        raise ValueError("attention='flash_attn' needs the flash-attn package, which is not importable here")
    return NAMES[attention]


_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
"""Looked up once: a lookup inside a compiled layer's attention would break its graph."""


def flash_attn_available() -> bool:
    return _FLASH_ATTN


def candidate_backends(attention: str, device_type: str) -> tuple[str, ...]:
    """The backends `attention` may run as on `device_type`; `auto` on CUDA is flash_attn where
    the flash-attn package is importable on the worker, else torch_varlen (either, seen from a
    driver that can't know)."""
    if attention != "auto":
        return (attention,)
    if device_type != "cuda":
        return ("sdpa_varlen",)
    return ("flash_attn", "torch_varlen")


# --- metadata -------------------------------------------------------------------------------------

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


_derived = LastCache()


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Example offsets over the flattened [B, T] position_ids: a new example starts at every row
    start and wherever a position does not follow its predecessor by one. Syncs with the device."""
    batch, length = position_ids.shape
    flat = position_ids.reshape(-1)
    step = torch.ones_like(flat, dtype=torch.bool)
    step[1:] = flat[1:] != flat[:-1] + 1
    step[::length] = True
    starts = step.nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _metadata(query: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, int]:
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and max_len is not None:
        if kwargs.get("cu_seq_lens_k") is not None and kwargs["cu_seq_lens_k"] is not cu:
            if not torch.equal(kwargs["cu_seq_lens_k"], cu):  # pragma: no cover - collate passes one tensor
                raise ValueError("raypack varlen attention needs cu_seq_lens_k == cu_seq_lens_q (self-attention)")
        if isinstance(max_len, torch.Tensor):
            _warn_once("max_tensor", "max_length_q is a tensor; pass a Python int (collate does) to avoid a sync per layer")
            max_len = int(max_len)
        return cu.to(query.device), max_len
    batch, _, length, _ = query.shape
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # no packing information: every row is one sequence
        cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
        return cu, length
    _warn_once(
        "derive",
        "raypack varlen attention got no cu_seq_lens_q/max_length_q; deriving them from position_ids "
        "(one device sync per forward). Build batches with raypack.data.collate.collate_packed.",
    )
    hit = _derived.get(position_ids, "derived")
    if hit is None:
        hit = _derived.put(position_ids, "derived", cu_seqlens_from_position_ids(position_ids.expand(batch, -1)))
    return hit


def layer_chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's RoPE layers), else None. As in
    transformers' masks: the config's `layer_types[layer_idx]` says chunked_attention, and
    `attention_chunk_size` is the chunk."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if not types or "chunked_attention" not in types:
        return None
    index = getattr(module, "layer_idx", None)
    if index is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: the config has chunked-attention layers but the module carries no layer_idx, "
            f"so raypack can't tell whether this layer is one; use a padded strategy ({PADDED})"
        )
    return config.attention_chunk_size if types[index] == "chunked_attention" else None


def check_row_scaling(module: torch.nn.Module, total: int) -> None:
    """Refuse a row long enough for Llama 4's row-position query temperature to differ from the
    example's (traits.row_scaled_layers); `total` is a shape, so this never syncs."""
    config = getattr(module, "config", None)
    floor = row_scaled_layers(config) if config is not None else None
    if floor is None or total < floor:
        return
    index = getattr(module, "layer_idx", None)
    if index is not None and config.no_rope_layers[index]:
        return  # a RoPE layer: its queries are not rescaled
    raise UnsupportedModelError(
        f"{type(module).__name__}: attn_temperature_tuning scales this NoPE layer's queries by the position in "
        f"the row, and this packed row has {total} tokens, at least floor_scale={floor}: examples after the first "
        f"would be scaled as if they started at the row's start. Use rows shorter than {floor} tokens "
        f"(pack.budget) or a padded strategy ({PADDED})."
    )


# --- CUDA backends ------------------------------------------------------------------------------------


def _to_thd(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B*T, H, D), the varlen kernels' layout."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _check_cuda_kernel(query: torch.Tensor, backend: str, sinks: torch.Tensor | None) -> None:
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"raypack {backend} attention needs float16 or bfloat16 activations, got {query.dtype}. "
            "Load the model with dtype='bfloat16' (the default on CUDA), run under torch.autocast, "
            "or use attention='sdpa_varlen' for an exact fp32 path."
        )
    if sinks is not None:
        raise UnsupportedModelError(
            f"raypack {backend} attention has no attention sinks (this model's attention passes s_aux); "
            f"use attention='sdpa_varlen' (exact, slower) or a padded strategy ({PADDED})"
        )


def _flash(module, query, key, value, cu, max_len, dropout, scaling, window, softcap, sinks) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # optional package (raypack[flash]): only here

    _check_cuda_kernel(query, "flash_attn", sinks)
    out = flash_attn_varlen_func(
        _to_thd(query), _to_thd(key), _to_thd(value), cu, cu, max_len, max_len,
        dropout_p=dropout, softmax_scale=scaling, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap or 0.0,
    )  # fmt: skip
    return out


_VARLEN_PARAMS: set[str] | None = None


def prepare_compile() -> None:
    """Before layers are compiled (train.compile): what the CUDA backends look up once, looked up
    outside any graph, where an import or a signature read can't break it."""
    global _VARLEN_PARAMS
    if torch.cuda.is_available() and _VARLEN_PARAMS is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)


def _torch_varlen(module, query, key, value, cu, max_len, dropout, scaling, window, softcap, sinks) -> torch.Tensor:
    # Imported on first use: it pulls in torch._dynamo, 1.7 s on 2 cores, which the CPU path and
    # flash-attn never need (Python caches it after the first call).
    from torch.nn.attention.varlen import varlen_attn

    global _VARLEN_PARAMS
    _check_cuda_kernel(query, "torch_varlen", sinks)
    if softcap:
        raise ValueError(
            f"torch varlen_attn has no logit softcapping (this model sets {softcap}); install flash-attn "
            "or use attention='sdpa_varlen' (exact, slower)."
        )
    if dropout:
        raise ValueError(
            f"torch varlen_attn has no attention dropout (this model sets {dropout}); load with "
            "attention_dropout=0.0, install flash-attn, or use attention='sdpa_varlen'."
        )
    if _VARLEN_PARAMS is None:
        _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
    q, k, v = _to_thd(query), _to_thd(key), _to_thd(value)
    extra: dict[str, Any] = {"scale": scaling}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            extra["enable_gqa"] = True
        else:  # torch < 2.13: expand the kv heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in _VARLEN_PARAMS:
        # (-1, 0) is exactly what varlen_attn recognises as causal; (W, 0) is causal with a window.
        extra["window_size"] = (window - 1, 0) if window else (-1, 0)
    else:  # older signature: is_causal flag, no windows
        if window:
            raise ValueError(f"this torch's varlen_attn has no window_size; it cannot run sliding window {window}")
        extra["is_causal"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)


_KERNELS = {"flash_attn": _flash, "torch_varlen": _torch_varlen}


def _pick(query: torch.Tensor) -> str:
    if query.device.type == "cuda":
        return "flash_attn" if flash_attn_available() else "torch_varlen"
    return "sdpa_varlen"


def _make_forward(backend: str | None):
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                softcap=None, s_aux=None, is_causal=None, position_bias=None, **kwargs):  # fmt: skip
        """transformers attention function: query (B, Hq, T, D), key/value (B, Hkv, T, D);
        returns ((B, T, Hq, D), None) like transformers' own sdpa path."""
        if attention_mask is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passed an attention_mask to raypack's varlen attention. Packed rows carry "
                "none, so it is either a padded batch (use attention='sdpa' for those) or a mask or bias the model "
                f"builds itself, which packed attention can't apply: use a padded strategy ({PADDED})."
            )
        if is_causal is False or position_bias is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} asks for {'non-causal attention' if is_causal is False else 'a position bias'}, "
                f"which raypack's varlen attention does not implement; use a padded strategy ({PADDED})"
            )
        group = ulysses.active()
        if group is not None:  # this rank's shard of the row -> the whole row, H/N heads
            if kwargs.get("cu_seq_lens_q") is None:
                # Without them a shard can only see its own positions, not where the row's examples start.
                raise UnsupportedModelError(
                    f"{type(module).__name__} got no cu_seq_lens_q: its layers don't pass the forward's attention "
                    "keyword arguments through to attention, so train.sequence_parallel can't tell it where the "
                    "whole row's examples start; train it with train.sequence_parallel=1"
                )
            query, key, value, s_aux = ulysses.heads_for_row(module, query, key, value, s_aux, group)
        cu, max_len = _metadata(query, kwargs)
        check_row_scaling(module, query.shape[0] * query.shape[2])
        chunk = layer_chunk_size(module)
        chosen = backend or _pick(query)
        if chosen == "sdpa_varlen":
            out = exact_attention(query, key, value, cu, dropout, scaling, sliding_window, softcap, s_aux, chunk)
        else:
            if chunk:  # chunked layers: the same kernels over the chunks of every example
                cu, max_len = chunk_cu_seqlens(cu, chunk, query.shape[0] * query.shape[2]), min(max_len, chunk)
            out = _KERNELS[chosen](module, query, key, value, cu, max_len, dropout, scaling, sliding_window, softcap, s_aux)
        out = out.reshape(query.shape[0], query.shape[2], query.shape[1], -1)
        return (out if group is None else ulysses.tokens_for_rank(out, group)), None

    forward.__name__ = f"{NAMES[backend or 'auto']}_forward"
    # Traced whole by torch.compile (train.compile): every backend is one op in the graph (the
    # exact path's raypack::exact_varlen, torch's varlen_attn, flash-attn's own custom ops).
    return forward


def refuse_padding_masks(model: torch.nn.Module) -> None:
    """Refuse a padding attention_mask passed to `model`'s text decoder (a forward pre-hook): raypack's
    names get no mask from transformers (see the module doc), so a mask with zeros would be silently
    ignored. The check syncs, but only when a mask is passed at all, which packed batches never do.
    On the decoder, not the model: PEFT calls the model's `forward` directly, hooks bypassed."""

    def check(module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            raise ValueError(
                "raypack varlen attention got a padding attention_mask; packed rows carry none. "
                "Use attention='sdpa' (strategies pad, pad_sorted) for padded batches."
            )

    decoder(model).register_forward_pre_hook(check, with_kwargs=True)


_registered = False


def register() -> None:
    """Register every raypack attention name with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    for attention, name in NAMES.items():
        AttentionInterface.register(name, _make_forward(None if attention == "auto" else attention))
    _registered = True
