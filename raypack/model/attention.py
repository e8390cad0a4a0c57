"""Varlen attention for packed rows, registered with transformers' attention interfaces.

A packed batch is one row of concatenated examples (see `raypack.data.collate`). Collate
computes `cu_seq_lens_q/k` (int32 offsets of every example) and `max_length_q/k` (a Python
int) once on the host; transformers forwards them as keyword arguments to every attention
call, so no layer recomputes boundaries or syncs with the device.

Backends, in the order `raypack_varlen` (attention="auto") picks them at call time:

    flash_attn     flash_attn.flash_attn_varlen_func      CUDA, flash-attn installed, fp16/bf16
    torch_varlen   torch.nn.attention.varlen.varlen_attn   CUDA, fp16/bf16
    sdpa_varlen    exact masked attention                  any device and dtype (the CPU path)

Each backend is also registered under its own name (`raypack_flash_attn`, ...) to force it.
The mask function registered next to them returns None: boundaries come from cu_seqlens, and
a 4D mask built by transformers would cost O(T^2) memory for nothing.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

BACKENDS = ("flash_attn", "torch_varlen", "sdpa_varlen")
"""Explicit backend names accepted by `attn_implementation_name`; plus `auto`."""

_PREFIX = "raypack_"
AUTO_NAME = _PREFIX + "varlen"


def attn_implementation_name(attention: str = "auto") -> str:
    """The transformers `attn_implementation` string for a raypack backend (registers them)."""
    register()
    if attention == "auto":
        return AUTO_NAME
    if attention not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {attention!r}; expected auto or one of {', '.join(BACKENDS)}")
    if attention == "flash_attn" and not flash_attn_available():
        raise ValueError("attention='flash_attn' needs the flash-attn package, which is not importable here")
    return _PREFIX + attention


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


# --- metadata -------------------------------------------------------------------------------------

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class _LastCache:
    """One entry per key, remembered only while `owner` (a per-batch tensor) is alive, so a new
    batch that reuses a freed tensor's address can never hit a stale entry."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[weakref.ref, Any]] = {}

    def get(self, owner: torch.Tensor, key: Any) -> Any:
        hit = self._entries.get(key)
        return hit[1] if hit is not None and hit[0]() is owner else None

    def put(self, owner: torch.Tensor, key: Any, value: Any) -> Any:
        self._entries[key] = (weakref.ref(owner), value)
        return value


_derived = _LastCache()
_masks = _LastCache()


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


# --- backends ---------------------------------------------------------------------------------------


def _to_thd(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B*T, H, D), the varlen kernels' layout."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _check_half(query: torch.Tensor, backend: str) -> None:
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"raypack {backend} attention needs float16 or bfloat16 activations, got {query.dtype}. "
            "Load the model with dtype='bfloat16' (the default on CUDA), run under torch.autocast, "
            "or use attention='sdpa_varlen' for an exact fp32 path."
        )


def _flash(module, query, key, value, cu, max_len, dropout, scaling, window, softcap) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # optional package (raypack[flash]): only here

    _check_half(query, "flash_attn")
    out = flash_attn_varlen_func(
        _to_thd(query), _to_thd(key), _to_thd(value), cu, cu, max_len, max_len,
        dropout_p=dropout, softmax_scale=scaling, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap or 0.0,
    )  # fmt: skip
    return out


_VARLEN_PARAMS: set[str] | None = None


def _torch_varlen(module, query, key, value, cu, max_len, dropout, scaling, window, softcap) -> torch.Tensor:
    # Imported on first use: it pulls in torch._dynamo, 1.7 s on 2 cores, which the CPU path and
    # flash-attn never need (Python caches it after the first call).
    from torch.nn.attention.varlen import varlen_attn

    global _VARLEN_PARAMS
    _check_half(query, "torch_varlen")
    if softcap:
        raise ValueError(
            f"torch varlen_attn has no logit softcapping (this model sets {softcap}); install flash-attn, "
            "use attention='sdpa_varlen' (exact, slower), or load with attn_logit_softcapping=None."
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


def _segment_mask(cu: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    """Block-diagonal causal (optionally windowed) bool mask [total, total], built on the device
    from cu_seqlens without a sync."""
    idx = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:].to(idx.dtype), idx, right=True)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    if window:
        mask &= idx[:, None] - idx[None, :] < window
    return mask


def _sdpa_varlen(module, query, key, value, cu, max_len, dropout, scaling, window, softcap) -> torch.Tensor:
    """Exact attention over the whole flattened row with a block-diagonal mask, built once per
    forward per window size. Memory is O(T^2): this is the CPU and correctness path."""
    batch, heads, length, dim = query.shape
    total = batch * length
    mask = _masks.get(cu, (window, total, cu.device))
    if mask is None:
        mask = _masks.put(cu, (window, total, cu.device), _segment_mask(cu, total, window))
    q = query.transpose(0, 1).reshape(1, heads, total, dim)
    k = key.transpose(0, 1).reshape(1, key.shape[1], total, dim)
    v = value.transpose(0, 1).reshape(1, value.shape[1], total, dim)
    if k.shape[1] != heads:
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if softcap:  # SDPA has no softcap: the eager formula, as transformers' eager path does it
        scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else dim**-0.5)
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = F.dropout(probs, p=dropout, training=dropout > 0) @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    # (1, H, B*T, D) -> (B*T, H, D)
    return out[0].transpose(0, 1)


_IMPLS = {"flash_attn": _flash, "torch_varlen": _torch_varlen, "sdpa_varlen": _sdpa_varlen}


def _pick(query: torch.Tensor) -> str:
    if query.device.type == "cuda":
        return "flash_attn" if flash_attn_available() else "torch_varlen"
    return "sdpa_varlen"


def _make_forward(backend: str | None):
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                softcap=None, **kwargs):  # fmt: skip
        """transformers attention function: query (B, Hq, T, D), key/value (B, Hkv, T, D);
        returns ((B, T, Hq, D), None) like transformers' own sdpa path."""
        if attention_mask is not None:
            raise ValueError("raypack varlen attention takes packed rows without attention_mask; use attention='sdpa'")
        cu, max_len = _metadata(query, kwargs)
        impl = _IMPLS[backend or _pick(query)]
        out = impl(module, query, key, value, cu, max_len, dropout, scaling, sliding_window, softcap)
        return out.reshape(query.shape[0], query.shape[2], query.shape[1], -1), None

    forward.__name__ = f"raypack_{backend or 'varlen'}_forward"
    return forward


def _no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """Mask function for the raypack names: boundaries come from cu_seqlens, so no 4D mask. A real
    padding mask would be silently ignored, so refuse it (the check syncs, but only when a mask
    is passed at all, which packed batches never do)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "raypack varlen attention got a padding attention_mask; packed rows carry none. "
            "Use attention='sdpa' (strategies pad, pad_sorted) for padded batches."
        )
    return None


_registered = False


def register() -> None:
    """Register every raypack attention name with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    for backend in (None, *BACKENDS):
        name = _PREFIX + (backend or "varlen")
        AttentionInterface.register(name, _make_forward(backend))
        AttentionMaskInterface.register(name, _no_mask)
    _registered = True
