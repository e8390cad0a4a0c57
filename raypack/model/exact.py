"""Exact attention for packed rows, one example at a time: raypack's `sdpa_varlen` backend.

Each example (each chunk of an example, on chunked-attention layers) runs on its own, so the cost
is Σ len², like the CUDA varlen kernels', not (Σ len)² as a masked attention over the whole row
would be. Where the model needs nothing SDPA lacks, each example is one SDPA call (causal, or with
a window mask); with logit softcapping or attention sinks it is transformers' eager formula.
Boundaries come from cu_seqlens, read as a list once per forward: free on the CPU, one sync per
forward on CUDA. `chunk_cu_seqlens`, which the CUDA kernels use too, needs no read at all.

    row        [a0 a1 a2 a3 | b0 b1 b2 | c0 c1 c2 c3 c4]     cu_seqlens [0, 4, 7, 12]
    attention   causal(a)     causal(b)  causal(c)            three SDPA calls, nothing across
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F


class LastCache:
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


_per_batch = LastCache()


def chunk_cu_seqlens(cu: torch.Tensor, chunk: int, total: int) -> torch.Tensor:
    """`cu` with a boundary added at every multiple of `chunk` from each example's start
    (positions restart per example, so chunks do too): chunked causal attention within an
    example is causal attention within each chunk. Built on the device without a sync, so its
    size is fixed at N + total // chunk + 1 (an upper bound on the chunks) and it ends with
    empty segments at `total`."""
    n = cu.numel() - 1
    idx = torch.arange(total, device=cu.device)
    cu_long = cu.to(torch.long)
    example = torch.searchsorted(cu_long[1:], idx, right=True)
    boundary = (idx - cu_long[example]) % chunk == 0
    size = n + total // chunk + 1
    slot = torch.where(boundary, torch.cumsum(boundary, 0) - 1, size - 1)  # slot size-1 is never a boundary's
    out = torch.full((size,), total, dtype=cu.dtype, device=cu.device)
    return out.scatter_(0, slot, torch.where(boundary, idx, total).to(cu.dtype))


def _segments(cu: torch.Tensor, chunk: int | None, total: int) -> list[int]:
    """Lengths of the examples, or of the chunks of the examples, in row order (none empty), read
    once per forward."""
    hit = _per_batch.get(cu, ("segments", chunk, total))
    if hit is None:
        bounds = (chunk_cu_seqlens(cu, chunk, total) if chunk else cu).tolist()
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seqlens must run from 0 to the row's {total} tokens, got {bounds[0]}..{bounds[-1]}")
        hit = [e - s for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        _per_batch.put(cu, ("segments", chunk, total), hit)
    return hit


def _allowed(cu: torch.Tensor, size: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Causal (and windowed) bool mask [size, size]; any example's mask is its top-left corner.
    One per forward per window, so no layer builds it again."""
    hit = _per_batch.get(cu, ("mask", size, window, device))
    if hit is None:
        idx = torch.arange(size, device=device)
        hit = idx[None, :] <= idx[:, None]
        if window:
            hit &= idx[:, None] - idx[None, :] < window
        _per_batch.put(cu, ("mask", size, window, device), hit)
    return hit


def _eager(q, k, v, allowed, scale, dropout, softcap, sinks) -> torch.Tensor:
    """transformers' eager formula for one example: q (H, L, D), k/v (H, L, D), allowed (L, L)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # softmax in float32 at least, as transformers' eager attention does for half precision
    work = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(work).masked_fill(~allowed, torch.finfo(work).min)
    if sinks is not None:
        # GPT-OSS: one learned logit per head joins every row's softmax and is then dropped.
        sink = sinks.to(work).reshape(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs.to(v.dtype), p=dropout, training=dropout > 0)
    return probs @ v


def exact_attention(query, key, value, cu, dropout, scaling, window, softcap, sinks, chunk) -> torch.Tensor:
    """Attention per example (per chunk of an example on chunked layers): exact, Σ len² cost."""
    batch, heads, length, dim = query.shape
    total, kv_heads = batch * length, key.shape[1]
    q = query.transpose(0, 1).reshape(heads, total, dim)
    k = key.transpose(0, 1).reshape(kv_heads, total, key.shape[-1])
    v = value.transpose(0, 1).reshape(kv_heads, total, value.shape[-1])
    scale = scaling if scaling is not None else dim**-0.5
    eager = bool(softcap) or sinks is not None
    if eager and kv_heads != heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=0), v.repeat_interleave(heads // kv_heads, dim=0)
    sizes = _segments(cu, chunk, total)
    longest = max(sizes)
    outs = []
    # split, not slices: a slice's backward writes a row-sized zero gradient per example (O(N·T)),
    # split's backward concatenates the pieces' gradients once
    for n, qs, ks, vs in zip(sizes, q.split(sizes, dim=1), k.split(sizes, dim=1), v.split(sizes, dim=1)):
        if eager:
            allowed = _allowed(cu, longest, window, q.device)[:n, :n]
            outs.append(_eager(qs, ks, vs, allowed, scale, dropout, softcap, sinks))
        elif window and n > window:
            mask = _allowed(cu, longest, window, q.device)[:n, :n]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scale,
                                                       enable_gqa=kv_heads != heads))  # fmt: skip
        else:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=dropout, scale=scale,
                                                       enable_gqa=kv_heads != heads))  # fmt: skip
    # (H, T, Dv) -> (T, H, Dv)
    return torch.cat(outs, dim=1).transpose(0, 1)


