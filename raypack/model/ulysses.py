"""Ulysses sequence parallelism: one packed row split over the N ranks of a group, every example
still attending to exactly its own tokens.

Rank k of a group holds tokens [kS, (k+1)S) of the row (S = T / N, the row padded to a multiple
of N by `collate.shard_batch`) and every attention head. Around the attention of every layer:

    q, k, v  (1, H, S, D) ──all-to-all──> (1, H/N, T, D)   every token of the row, H/N heads
             varlen attention with the whole row's cu_seqlens (an example cut by a shard
             boundary is whole again) and its max length
    out      (1, T, H/N, D) ──all-to-all──> (1, S, H, D)   back to this rank's tokens

Everything else in the model works per token: RoPE reads each token's own position_ids (the
example's, not the shard's), and norms, MLPs and routers never look across tokens, so each rank
computes exactly what the single-rank run computes for its tokens. The backward of each
all-to-all is the inverse all-to-all (`_AllToAll`), so the gradients that flow through another
rank's attention come back to the rank that holds the tokens, and the data-parallel all-reduce
over every rank sums each token's contribution exactly once.

Heads: the query heads are split over the ranks (H must divide by N; preflight refuses a model
whose heads don't, traits.check_packable). Key/value heads that don't divide by N are first
repeated to one per query head (exactly what grouped-query attention computes, at the cost of
the extra key/value memory); attention sinks (`s_aux`, one logit per query head) are split with
the query heads.

Why not DeepSpeed's `UlyssesSPAttentionHF`: it takes over the model's attention implementation
and its own sequence-parallel data loader and loss (built around transformers' flash-attention
path and `shift_labels`), where raypack's packed rows need its own varlen backends (the exact
CPU path included), its cu_seqlens from the whole row, and its chunked loss. The exchange itself
is two `all_to_all_single` calls (gloo has it on the CPU in torch 2.13, NCCL on GPUs).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from raypack.errors import UnsupportedModelError


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: the ranks that share one packed row."""

    size: int
    rank: int
    """This rank's place in the group: it holds shard `rank` of every row."""
    process_group: Any = None
    """The group's torch.distributed group for the all-to-alls (None: a group of one)."""
    data_group: Any = None
    """A gloo group of the same ranks, for host data (the row's shards, raypack/train/sequence.py)."""


_ACTIVE: SequenceGroup | None = None


def active() -> SequenceGroup | None:
    """The group the attention layers exchange tokens in now, or None (no sequence parallelism)."""
    return _ACTIVE


@contextmanager
def sequence_parallel(group: SequenceGroup | None) -> Iterator[None]:
    """Attention layers split rows over `group` inside this block (nothing when None or of size 1)."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, group if group is not None and group.size > 1 else None
    try:
        yield
    finally:
        _ACTIVE = saved


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: SequenceGroup) -> torch.Tensor:
    """Split `x` into group.size chunks along `scatter_dim`, send chunk j to rank j, and concatenate
    what every rank sent here along `gather_dim`, in rank order."""
    send = torch.stack(x.chunk(group.size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.process_group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: SequenceGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def heads_for_row(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  s_aux: torch.Tensor | None, group: SequenceGroup):
    """(B, H, S, D) shards -> (B, H/N, T, D): every token of the row for this rank's heads."""
    n, heads = group.size, query.shape[1]
    if heads % n:
        raise UnsupportedModelError(
            f"{type(module).__name__} has {heads} attention heads, which train.sequence_parallel={n} can't split "
            "evenly; use a sequence_parallel that divides them"
        )
    if key.shape[1] % n:  # repeat key/value heads to one per query head: what GQA computes anyway
        repeat = heads // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    query, key, value = (_AllToAll.apply(t, 1, 2, group) for t in (query, key, value))
    if s_aux is not None:
        s_aux = s_aux.chunk(n)[group.rank]
    return query, key, value, s_aux


def tokens_for_rank(out: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """(B, T, H/N, D) attention output -> (B, S, H, D): this rank's tokens, every head."""
    return _AllToAll.apply(out, 1, 2, group)
