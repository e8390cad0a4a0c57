"""Exact attention for packed rows, one example at a time: raypack's `sdpa_varlen` backend.

Each example (each chunk of an example, on chunked-attention layers) runs on its own, so the cost
is Σ len², like the CUDA varlen kernels', not (Σ len)² as a masked attention over the whole row
would be. Where the model needs nothing SDPA lacks, each example is one SDPA call (causal, or with
a window mask); with logit softcapping or attention sinks it is transformers' eager formula.
Boundaries come from cu_seqlens as a list, once per forward: from the host tensor collate built
them in, which the training step keeps beside the device copy (`keep_host_copy`, by
raypack.train.prefetch.to_device), so on CUDA no device value is read; only a batch moved some
other way is read back from the device (one sync per forward). `chunk_cu_seqlens`, which the CUDA kernels use too, needs no read at all.

The whole path is one torch.library custom op, `raypack::exact_varlen` (see `exact_attention`), so
torch.compile keeps a layer's graph whole around it. Its backward is written out (the eager
formula's gradients, scores recomputed per example, heads in blocks): nothing [L, L] is kept
between forward and backward. On the CPU, side by side in one process on this 2-core host, a
forward and backward of the attention alone took 1.25x (128 tokens) to 1.37x (1,024 tokens) the
time of autograd through SDPA, the path before the op.

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


class HostCopies:
    """A tensor moved off the host -> the host tensor it was moved from, for as long as the moved
    one lives (keyed by identity: a freed tensor's address reused by a new one never hits)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def put(self, moved: torch.Tensor, host: torch.Tensor) -> None:
        key = id(moved)
        self._by_id[key] = (weakref.ref(moved, lambda _, key=key: self._by_id.pop(key, None)), host)

    def get(self, moved: torch.Tensor) -> torch.Tensor | None:
        hit = self._by_id.get(id(moved))
        return hit[1] if hit is not None and hit[0]() is moved else None

    def __len__(self) -> int:
        return len(self._by_id)


_host_copies = HostCopies()


def keep_host_copy(moved: torch.Tensor, host: torch.Tensor) -> None:
    """`moved` (a batch's cu_seq_lens_q on the device) holds the values of `host` (the host tensor
    collate built): the exact path reads those instead, with no device sync, while `moved` lives."""
    if moved is not host:
        _host_copies.put(moved, host)


def host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host tensor kept for `tensor` (`keep_host_copy`), or None."""
    return _host_copies.get(tensor)


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
    """Lengths of the examples, or of the chunks of the examples, in row order (none empty), found
    once per forward: from the host copy of `cu` that collate computed (`keep_host_copy`, by
    raypack.train.prefetch.to_device), or, where there is none (a batch moved some other way),
    read from `cu`."""
    hit = _per_batch.get(cu, ("segments", chunk, total))
    if hit is None:
        host = host_copy(cu)
        source = cu if host is None else host
        bounds = (chunk_cu_seqlens(source, chunk, total) if chunk else source).tolist()
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


def _eager(q, k, v, allowed, scale, softcap, sinks, keep) -> torch.Tensor:
    """transformers' eager formula for one example: q (H, L, D), k/v (H, L, D), allowed (L, L);
    `keep`: the dropout mask already scaled by 1 / (1 - p), or None."""
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
    probs = probs.to(v.dtype)
    return (probs if keep is None else probs * keep.to(probs.dtype)) @ v


def _eager_backward(go, q, k, v, allowed, scale, softcap, sinks, keep):
    """Gradients of `_eager` for one example, in float32 at least: (dq, dk, dv, dsinks or None).
    The scores are recomputed from q and k, as flash attention's backward does, so no [L, L]
    tensor lives between forward and backward."""
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, v, go = q.to(work), k.to(work), v.to(work), go.to(work)
    scores = (q @ k.transpose(-1, -2)) * scale
    capped = torch.tanh(scores / softcap) if softcap else None
    logits = (capped * softcap if softcap else scores).masked_fill(~allowed, torch.finfo(work).min)
    if sinks is not None:
        sink = sinks.to(work).reshape(-1, 1, 1).expand(logits.shape[0], logits.shape[1], 1)
        full = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)
        probs, sink_probs = full[..., :-1], full[..., -1]
    else:
        probs, sink_probs = torch.softmax(logits, dim=-1), None
    dropped = probs if keep is None else probs * keep.to(work)
    dv = dropped.transpose(-1, -2) @ go
    dprobs = go @ v.transpose(-1, -2)
    if keep is not None:
        dprobs = dprobs * keep.to(work)
    # softmax backward; a sink's column has no gradient coming in (it is dropped after the softmax)
    row = (dprobs * probs).sum(-1, keepdim=True)
    dlogits = probs * (dprobs - row)
    dsinks = -(sink_probs * row[..., 0]).sum(-1) if sinks is not None else None
    dscores = dlogits * (1 - capped * capped) if softcap else dlogits
    return dscores @ k * scale, dscores.transpose(-1, -2) @ q * scale, dv, dsinks


def _flatten(query, key, value):
    """(B, H, L, D) -> (H, B*L, D): a row's tokens in one run per head."""
    return tuple(x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1]) for x in (query, key, value))


def _keep(generator, heads: int, n: int, dropout: float, device) -> torch.Tensor:
    """One example's dropout mask, scaled as F.dropout scales (1 / (1 - p)); drawn in the same
    order in forward and backward from a generator seeded with the same seed."""
    draw = torch.rand(heads, n, n, generator=generator, device=device)
    return (draw >= dropout).to(torch.float32) / (1 - dropout)


def _generator(seed: torch.Tensor | None, device: torch.device):
    return None if seed is None else torch.Generator(device=device).manual_seed(int(seed))


@torch.library.custom_op("raypack::exact_varlen", mutates_args=())
def _exact_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float,
              window: int, softcap: float, sinks: torch.Tensor | None, chunk: int, dropout: float,
              seed: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(T, H, Dv): every example's attention; see `exact_attention`. 0 means none for window,
    softcap and chunk (an op's schema has no Optional float)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    q, k, v = _flatten(query, key, value)
    total = q.shape[1]
    eager = bool(softcap) or sinks is not None or dropout > 0
    if eager and kv_heads != heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=0), v.repeat_interleave(heads // kv_heads, dim=0)
    sizes = _segments(cu, chunk or None, total)
    longest, generator = max(sizes), _generator(seed, q.device)
    outs = []
    # split, not slices: a slice's backward writes a row-sized zero gradient per example (O(N·T)),
    # split's backward concatenates the pieces' gradients once
    for n, qs, ks, vs in zip(sizes, q.split(sizes, dim=1), k.split(sizes, dim=1), v.split(sizes, dim=1)):
        if eager:
            keep = _keep(generator, heads, n, dropout, q.device) if dropout > 0 else None
            allowed = _allowed(cu, longest, window or None, q.device)[:n, :n]
            outs.append(_eager(qs, ks, vs, allowed, scale, softcap, sinks, keep))
        elif window and n > window:
            mask = _allowed(cu, longest, window, q.device)[:n, :n]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                       enable_gqa=kv_heads != heads))  # fmt: skip
        else:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                       enable_gqa=kv_heads != heads))  # fmt: skip
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous()  # (H, T, Dv) -> (T, H, Dv)


@_exact_op.register_fake
def _(query, key, value, cu, scale, window, softcap, sinks, chunk, dropout, seed):
    return query.new_empty(query.shape[0] * query.shape[2], query.shape[1], value.shape[-1])


BACKWARD_BYTES = 1 << 28
"""The backward's working set per block of heads: one example's recomputed float32 scores."""


@torch.library.custom_op("raypack::exact_varlen_backward", mutates_args=())
def _exact_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu: torch.Tensor, scale: float, window: int, softcap: float, sinks: torch.Tensor | None,
                       chunk: int, dropout: float, seed: torch.Tensor | None) -> list[torch.Tensor]:  # fmt: skip
    """dq, dk, dv in the inputs' (B, H, L, D) shapes, and dsinks (empty without sinks)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    rep = heads // kv_heads
    q, k, v = _flatten(query, key, value)
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    go = grad.transpose(0, 1)  # (T, H, Dv) -> (H, T, Dv)
    sizes = _segments(cu, chunk or None, q.shape[1])
    longest, generator = max(sizes), _generator(seed, q.device)
    dq, dk, dv, dsinks = [], [], [], 0
    pieces = (x.split(sizes, dim=1) for x in (q, k, v, go))
    for n, qs, ks, vs, gs in zip(sizes, *pieces):
        keep = _keep(generator, heads, n, dropout, q.device) if dropout > 0 else None
        allowed = _allowed(cu, longest, window or None, q.device)[:n, :n]
        # heads a block at a time: each block's [heads, n, n] float32 scores within BACKWARD_BYTES
        step = max(1, BACKWARD_BYTES // (4 * n * n))
        parts = [_eager_backward(gs[h:h + step], qs[h:h + step], ks[h:h + step], vs[h:h + step], allowed, scale,
                                 softcap, None if sinks is None else sinks[h:h + step],
                                 None if keep is None else keep[h:h + step]) for h in range(0, heads, step)]  # fmt: skip
        dq.append(torch.cat([p[0] for p in parts])), dk.append(torch.cat([p[1] for p in parts]))
        dv.append(torch.cat([p[2] for p in parts]))
        dsinks = dsinks + torch.cat([p[3] for p in parts]) if sinks is not None else 0
    batch, length = query.shape[0], query.shape[2]

    def unflatten(pieces, like, group):  # (H, T, D) -> like's (B, H, L, D), GQA's groups summed
        x = torch.cat(pieces, dim=1)
        x = x.reshape(x.shape[0] // group, group, *x.shape[1:]).sum(1) if group > 1 else x
        return x.reshape(x.shape[0], batch, length, x.shape[-1]).transpose(0, 1).to(like.dtype).contiguous()

    no_sinks = query.new_empty(0)
    return [unflatten(dq, query, 1), unflatten(dk, key, rep), unflatten(dv, value, rep),
            dsinks.to(sinks.dtype) if sinks is not None else no_sinks]  # fmt: skip


@_exact_backward_op.register_fake
def _(grad, query, key, value, cu, scale, window, softcap, sinks, chunk, dropout, seed):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0)]  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu, scale, window, softcap, sinks, chunk, dropout, seed = inputs
    ctx.save_for_backward(query, key, value, cu, sinks, seed)
    ctx.options = (scale, window, softcap, chunk, dropout)


def _backward(ctx, grad):
    query, key, value, cu, sinks, seed = ctx.saved_tensors
    scale, window, softcap, chunk, dropout = ctx.options
    dq, dk, dv, dsinks = _exact_backward_op(grad, query, key, value, cu, scale, window, softcap, sinks, chunk,
                                            dropout, seed)  # fmt: skip
    return dq, dk, dv, None, None, None, None, dsinks if sinks is not None else None, None, None, None


_exact_op.register_autograd(_backward, setup_context=_setup_context)


def exact_attention(query, key, value, cu, dropout, scaling, window, softcap, sinks, chunk) -> torch.Tensor:
    """Attention per example (per chunk of an example on chunked layers): exact, Σ len² cost.
    query (B, H, T, D), key/value (B, Hkv, T, D); returns (B*T, H, Dv).

    One torch.library custom op (`raypack::exact_varlen`), so torch.compile keeps it whole in a
    compiled layer's graph (train.compile) instead of breaking the graph at it: it reads cu_seqlens
    on the host, and a loop over examples traced by Dynamo would be unrolled, and recompiled, once
    per example count. Its backward is a second op that recomputes each example's scores (the
    eager formula's gradients in float32 at least). Dropout draws its masks from a seed drawn here,
    so the backward (and a checkpointed layer's recompute) sees the same masks."""
    seed = torch.randint(0, 2**62, (1,)) if dropout > 0 else None
    return _exact_op(query, key, value, cu, float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                     int(window or 0), float(softcap or 0.0), sinks, int(chunk or 0), float(dropout), seed)  # fmt: skip
