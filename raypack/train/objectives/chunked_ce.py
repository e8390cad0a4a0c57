"""The chunked cross-entropy: Σ CE(transform(hidden @ W.T + b), targets) a chunk of rows at a
time, so that the [rows, vocab] logits never exist at once (raypack/train/objectives/loss.py says where the
hidden states come from and why).

    loss = chunked_cross_entropy(hidden, head.weight, head.bias, targets, chunk=2048, transform=fn,
                                 dtype=torch.bfloat16)

`dtype` is the compute dtype (precision mixed keeps fp32 weights, the master copy, and computes in
bf16): the head's matmuls run in it, as they would inside the model's forward under autocast (a
bf16 copy of W, made once a call, as autocast's weight cache makes it); the log-softmax and its
reductions run in fp32 (`.float()` before the cross-entropy), as every fused cross-entropy does,
because a sum over a 128k vocabulary in bf16 loses the small terms; dW is summed in fp32 and
returned in the weight's dtype. None: the inputs' own dtype.

Each chunk's gradients are taken at once, inside the forward (autograd from the chunk's loss to
its logits, then the head's two matmuls, dW summed in fp32), and held until backward scales them
by the incoming gradient: no chunk's logits outlive it and nothing is recomputed, so the loss
costs O(chunk x vocab) memory and the same FLOPs as the full-logit loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Transform = Callable[[torch.Tensor], torch.Tensor]
"""What a model applies to head(hidden) before returning logits (softcapping, scaling)."""


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, chunk: int, transform: Transform,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ cross-entropy (fp32 scalar) of the rows of `hidden` [N, H] against `targets` [N], the
    head's matmuls in `dtype` (module docstring)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, chunk, transform, dtype)
    return _loss_only(hidden, weight, bias, targets, chunk, transform, dtype)


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`t` in the compute dtype (itself where it is already, or where no dtype is asked)."""
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def _grad_buffers(needs, hidden, weight, bias, dtype) -> list:
    """Where a call's gradients are gathered: the hidden states' rows in the compute dtype (each
    written once by one matmul), the head's weight and bias summed over the chunks in fp32 and
    rounded once, as the one big matmul of `full` does."""
    return [
        torch.empty(hidden.shape, dtype=dtype or hidden.dtype, device=hidden.device) if needs[0] else None,
        torch.zeros(weight.shape, dtype=_accum_dtype(weight), device=weight.device) if needs[1] else None,
        torch.zeros(bias.shape, dtype=_accum_dtype(bias), device=bias.device) if needs[2] else None,
    ]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Σ CE(transform(hidden @ W.T + b), targets), chunk by chunk, with the gradients taken in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, transform: Transform, dtype: torch.dtype | None):
        needs = ctx.needs_input_grad[:3]
        grads = _grad_buffers(needs, hidden, weight, bias, dtype)
        w, b = cast(weight, dtype), cast(bias, dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = cast(hidden[start:end], dtype)
            # Only dL/dlogits comes from autograd (through the transforms and the fp32 cross-entropy);
            # the head's two gradient matmuls are written out so that dW goes straight into its fp32 sum.
            logits = F.linear(h, w, b).requires_grad_()
            with torch.enable_grad():
                loss = F.cross_entropy(transform(logits).float(), targets[start:end], reduction="sum")
                (dlogits,) = torch.autograd.grad(loss, logits)
            _head_grads(grads, needs, dlogits, h, w, start, end)
            total += loss.detach()
        ctx.grads = grads
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        out = []
        for g, dtype in zip(ctx.grads, ctx.dtypes):
            out.append(None if g is None else g.mul_(grad_out).to(dtype))
        ctx.grads = None
        return (*out, None, None, None, None)


def _head_grads(grads: list, needs, dlogits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, start: int,
                end: int) -> None:
    """One chunk's share of the head's gradients from its dL/dlogits: the hidden states' rows
    [start, end), and the weight's and bias's sums (fp32), each where `needs` asks for it."""
    if needs[0]:
        torch.mm(dlogits, weight, out=grads[0][start:end])
    if needs[1]:
        _add_matmul(grads[1], dlogits.t(), h)
    if needs[2]:
        grads[2] += dlogits.sum(0, dtype=grads[2].dtype)


def _accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, where acc may be fp32 and a, b 16-bit.

    The dW of one chunk is as large as W (V x H), so how it is added up matters: on CUDA one cuBLAS
    call accumulates the 16-bit product in fp32 straight into the fp32 sum (addmm's out_dtype),
    where a bf16 product added in a second kernel would write, read and round a V x H tensor more
    per chunk."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # the CPU has no mixed-dtype matmul
        acc += (a @ b).to(acc.dtype)


def _loss_only(hidden, weight, bias, targets, chunk: int, transform: Transform,
               dtype: torch.dtype | None) -> torch.Tensor:
    """No gradients wanted (evaluation): the same chunks without the local autograd."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    weight, bias = cast(weight, dtype), cast(bias, dtype)
    for start in range(0, hidden.shape[0], chunk):
        logits = transform(F.linear(cast(hidden[start : start + chunk], dtype), weight, bias))
        total += F.cross_entropy(logits.float(), targets[start : start + chunk], reduction="sum")
    return total


# --- per-sequence log-probabilities, for losses over whole sequences (DPO) -------------------------


def chunked_sequence_objective(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               targets: torch.Tensor, sequence: torch.Tensor, num_sequences: int, chunk: int,
                               transform: Transform, objective: Callable[[torch.Tensor], torch.Tensor],
                               sums_out: list | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """objective(S) (an fp32 scalar), where S[k] = Σ log p(target_i) over the rows i of `hidden`
    whose `sequence[i]` is k, computed a chunk of rows at a time like `chunked_cross_entropy`.

    The objective of a whole sequence's log-probability (a DPO pair's loss) is not a sum over
    tokens, so its gradients take two passes over the chunks: the first finds S (no gradients),
    then dL/dS is taken on the small objective, and the second takes each chunk's gradients with
    its tokens weighted by dL/dS of their sequence. Both inside the forward, held until backward
    scales them, as for the cross-entropy: one more pass of the head's forward matmul, the same
    O(chunk x vocab) memory. `sums_out`, when given, receives S (detached). `dtype`: the compute
    dtype of the head's matmuls, as for `chunked_cross_entropy`."""
    needs = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs:
        loss, sums = _ChunkedSequenceObjective.apply(hidden, weight, bias, targets, sequence, num_sequences, chunk,
                                                     transform, objective, dtype)
    else:
        sums = _sequence_sums(cast(hidden, dtype), cast(weight, dtype), cast(bias, dtype), targets, sequence,
                              num_sequences, chunk, transform)
        loss = objective(sums).float()
    if sums_out is not None:
        sums_out.append(sums.detach())
    return loss


def _token_logps(h, weight, bias, targets, transform: Transform) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h, weight, bias)
    return logits, -F.cross_entropy(transform(logits).float(), targets, reduction="none")


def _sequence_sums(hidden, weight, bias, targets, sequence, num_sequences: int, chunk: int,
                   transform: Transform) -> torch.Tensor:
    sums = torch.zeros(num_sequences, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        _, logps = _token_logps(hidden[start:end], weight, bias, targets[start:end], transform)
        sums.index_add_(0, sequence[start:end], logps)
    return sums


class _ChunkedSequenceObjective(torch.autograd.Function):
    """objective(per-sequence log-prob sums), with the gradients taken in forward (two passes)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sequence, num_sequences: int, chunk: int, transform: Transform,
                objective, dtype: torch.dtype | None):
        needs = ctx.needs_input_grad[:3]
        grads = _grad_buffers(needs, hidden, weight, bias, dtype)
        dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        hidden, weight, bias = cast(hidden, dtype), cast(weight, dtype), cast(bias, dtype)
        with torch.no_grad():
            sums = _sequence_sums(hidden, weight, bias, targets, sequence, num_sequences, chunk, transform)
        with torch.enable_grad():
            s = sums.clone().requires_grad_()
            loss = objective(s).float()
            (weights,) = torch.autograd.grad(loss, s, allow_unused=True)
        weights = torch.zeros_like(sums) if weights is None else weights
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            with torch.enable_grad():
                logits = F.linear(h, weight, bias).detach().requires_grad_()
                logps = -F.cross_entropy(transform(logits).float(), targets[start:end], reduction="none")
                (dlogits,) = torch.autograd.grad((logps * weights[sequence[start:end]]).sum(), logits)
            _head_grads(grads, needs, dlogits, h, weight, start, end)
        ctx.grads = grads
        ctx.dtypes = dtypes
        ctx.mark_non_differentiable(sums)
        return loss.detach(), sums

    @staticmethod
    def backward(ctx, grad_out, _grad_sums):
        out = [None if g is None else g.mul_(grad_out).to(dtype) for g, dtype in zip(ctx.grads, ctx.dtypes)]
        ctx.grads = None
        return (*out, None, None, None, None, None, None, None)
