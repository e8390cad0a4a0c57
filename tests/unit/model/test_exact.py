"""The exact per-example path against a dense masked reference (values and gradients, float64),
the chunk boundaries it and the CUDA kernels use, and its one read per forward, of the host's
boundaries."""

from __future__ import annotations

import pytest
import torch
from exactness import make_rows

from raypack.data.collate import collate_packed, move_batch
from raypack.model.build import load_model
from raypack.model.exact import chunk_cu_seqlens, exact_attention


def chunks_by_hand(lengths, chunk):
    """The expected segments: each example cut every `chunk` tokens from its own start."""
    bounds, start = [], 0
    for n in lengths:
        bounds += list(range(start, start + n, chunk))
        start += n
    return bounds + [start]


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunk_cu_seqlens(chunk):
    lengths = [21, 6, 13, 1, 9, 16, 8]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lengths)
    got = chunk_cu_seqlens(cu, chunk, total)
    assert got.dtype == cu.dtype and got.shape == (len(lengths) + total // chunk + 1,)
    expected = chunks_by_hand(lengths, chunk)
    assert got[: len(expected)].tolist() == expected
    assert (got[len(expected) :] == total).all()  # trailing empty segments


def test_exact_path_reads_boundaries_once_per_forward(monkeypatch):
    """The per-example loop needs the boundaries on the host: one read per forward, not per layer."""
    model = load_model("tiny-llama", num_hidden_layers=3)
    batch = collate_packed(make_rows()[0])
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real(self))
    with torch.no_grad():
        model(**batch)
    assert len(calls) == 1


def test_exact_path_reads_the_host_boundaries_collate_built_never_the_moved_tensor(monkeypatch):
    """On CUDA the cu_seq_lens_q a model gets is a device tensor, and reading it (.tolist())
    makes the host wait for the device: once a micro-batch. The exact path reads the host tensor
    collate built instead, which move_batch keeps beside the moved one (collate.host_copy).

    What the CPU can show: (1) a moved tensor with no values at all (meta) still gives the right
    example and chunk lengths, so the values found never came from it; (2) a forward and backward
    of a model on the exact path, its cu_seq_lens_q moved (a stand-in: a distinct CPU tensor, kept
    as move_batch keeps a CUDA one), reads the host tensor once and never the moved one: the op
    gets the very tensor the batch holds. The training step keeps the host copy as it moves a
    micro-batch (tests/unit/train/test_prefetch.py). What it can't: that nothing else in a CUDA
    step syncs (benchmarks/step_syncs.py, with torch's sync debug mode, on a GPU)."""
    from raypack.model.exact import _segments, keep_host_copy

    batch = collate_packed(make_rows()[0])
    host = batch["cu_seq_lens_q"]
    lengths = (host[1:] - host[:-1]).tolist()
    meta = move_batch(batch, "meta")["cu_seq_lens_q"]
    keep_host_copy(meta, host)
    total = int(host[-1])
    assert _segments(meta, None, total) == lengths
    assert sum(_segments(meta, 4, total)) == total and max(_segments(meta, 4, total)) <= 4

    moved = host.clone()  # what the step moves to CUDA: another tensor, the host one kept
    keep_host_copy(moved, host)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self) or real(self))
    model = load_model("tiny-llama", num_hidden_layers=3, attention="sdpa_varlen", gradient_checkpointing="full")
    model.train()
    out = model(**{**{k: v for k, v in batch.items() if k != "labels"}, "cu_seq_lens_q": moved, "cu_seq_lens_k": moved})
    out.logits.sum().backward()  # the checkpointed layers' recompute and the op's backward too
    assert not any(r is moved for r in reads), "the exact path read the moved cu_seq_lens_q"
    assert sum(r is host for r in reads) == 1, "the host boundaries: once a forward"


def dense_reference(q, k, v, lengths, scale, window=None, softcap=None, sinks=None, chunk=None):
    """Attention over the whole row with an explicit [T, T] mask: same example, causal, within
    the window and the same chunk of the example. Written independently of raypack."""
    total = sum(lengths)
    example = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    pos = torch.arange(total) - starts[example]
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    allowed = (example[:, None] == example[None, :]) & (j <= i)
    if window:
        allowed &= i - j < window
    if chunk:
        allowed &= pos[:, None] // chunk == pos[None, :] // chunk
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, total, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :total]
    return probs @ v  # (H, T, D)


@pytest.mark.parametrize(
    "window,softcap,sinks,chunk",
    [(None, None, False, None), (5, None, False, None), (None, 30.0, False, None), (None, None, True, None),
     (None, None, False, 4), (5, 20.0, True, 4)],
)  # fmt: skip
def test_exact_path_against_dense_reference(window, softcap, sinks, chunk):
    """Values and gradients (q, k, v and the sinks) of the per-example path, GQA 4:2."""
    lengths = [11, 1, 7, 3]
    total, g = sum(lengths), torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, total, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    s = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = exact_attention(q[None], k[None], v[None], cu, 0.0, 0.3, window, softcap, s, chunk)
    expected = dense_reference(q, k, v, lengths, 0.3, window, softcap, s, chunk).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad((out * expected.detach().cos()).sum(), [x for x in (q, k, v, s) if x is not None])
    want = torch.autograd.grad((expected * expected.detach().cos()).sum(), [x for x in (q, k, v, s) if x is not None])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "window,softcap,sinks,chunk,dropout",
    [(None, None, False, None, 0.0), (5, 20.0, True, 4, 0.0), (None, None, False, None, 0.3),
     (5, 30.0, True, None, 0.5)],
)  # fmt: skip
def test_exact_op_gradients_by_finite_differences(window, softcap, sinks, chunk, dropout):
    """raypack::exact_varlen's hand-written backward (a second op that recomputes the scores)
    against finite differences in float64, dropout included: one seed, so forward and backward
    draw the same masks."""
    lengths, g = [6, 1, 4], torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(1, h, total, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    s = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seed = torch.tensor([7]) if dropout else None

    def attention(q, k, v, s):
        return torch.ops.raypack.exact_varlen(q, k, v, cu, 0.4, window or 0, softcap or 0.0, s, chunk or 0, dropout, seed)

    assert torch.autograd.gradcheck(attention, (q, k, v, s), eps=1e-6, atol=1e-7, fast_mode=True)


def test_exact_backward_works_a_block_of_heads_at_a_time(monkeypatch):
    """A long example's backward in blocks of heads gives the gradients it gives in one block."""
    from raypack.model import exact

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    s = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    grads = []
    for budget in (exact.BACKWARD_BYTES, 4 * 9 * 9):  # all heads at once, then one head at a time
        monkeypatch.setattr(exact, "BACKWARD_BYTES", budget)
        out = exact_attention(q, k, v, cu, 0.0, 0.4, None, 20.0, s, None)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v, s)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
