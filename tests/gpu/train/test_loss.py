"""The chunked loss on CUDA in bf16: close to the full loss, a fraction of its memory, and no host
sync once the targets come from the host; the prefetcher's pinned batches."""

from __future__ import annotations

import pytest
import torch

from raypack.data.collate import collate_packed, move_batch
from raypack.model.build import load_model
from raypack.train.objectives.loss import CausalLMLoss, label_targets, make_loss
from raypack.train.prefetch import prepare_step

pytestmark = pytest.mark.gpu

VOCAB = 32000


def row(tokens: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]
    ids = torch.randint(3, VOCAB, (tokens,), generator=g).tolist()
    return {"input_ids": ids, "labels": ids, "position_ids": [p for n in lengths for p in range(n)],
            "num_tokens": tokens, "example_ids": [0, 1, 2]}  # fmt: skip


def model(**overrides):
    torch.manual_seed(0)
    sizes = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    return load_model("tiny-llama", attention="auto", dtype="bfloat16", vocab_size=VOCAB, **sizes, **overrides).cuda()


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}])
def test_chunked_matches_full_in_bf16(overrides):
    m = model(**overrides)
    batch = move_batch(collate_packed([row(2048)]), "cuda")
    grads = {}
    for kind in ("full", "chunked"):
        loss = CausalLMLoss(m, kind, chunk_tokens=300)
        m.zero_grad(set_to_none=True)
        value = loss(m, batch)
        (value / 2047).backward()
        grads[kind] = (value.item(), {n: p.grad.clone() for n, p in m.named_parameters()})
    (lf, gf), (lc, gc) = grads["full"], grads["chunked"]
    assert abs(lc - lf) / lf < 1e-3
    for name, g in gf.items():
        assert rel(gc[name], g) < 3e-2, name  # bf16 rounding, summed over 7 chunks instead of one matmul


def test_chunked_peak_memory_is_a_fraction_of_full():
    m = model()
    batch = move_batch(collate_packed([row(8192)]), "cuda")
    peaks = {}
    for kind in ("full", "chunked"):
        loss = CausalLMLoss(m, kind, chunk_tokens=512)
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss(m, batch).backward()
        torch.cuda.synchronize()
        peaks[kind] = torch.cuda.max_memory_allocated() - base
    # full: 8192 x 32000 logits in bf16 and fp32 with their gradients (~2.5 GB); chunked: 512 rows at a time
    assert peaks["chunked"] < 0.3 * peaks["full"], peaks


def test_chunked_loss_does_not_sync_with_host_targets():
    m = model()
    loss = make_loss(m, "chunked", chunk_tokens=300)
    host = collate_packed([row(1024)])
    batch = move_batch({**host, **label_targets(host["labels"])}, "cuda")
    hidden = loss.hidden_states(m, {k: v for k, v in batch.items() if k not in ("labels", "loss_positions", "loss_targets")})
    hidden = hidden.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["loss_positions"])
        value = loss._call_head(selected, batch["loss_targets"])
        value.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.grad is not None and m.lm_head.weight.grad is not None


def test_prefetched_batches_are_pinned_and_move_unchanged():
    step = prepare_step([row(512, seed=1), row(256, seed=2)], pin=True)
    for batch in step.batches:
        assert all(v.is_pinned() for v in batch.values() if isinstance(v, torch.Tensor))
        assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
        moved = move_batch(batch, "cuda")
        torch.cuda.synchronize()
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(moved[key].cpu(), value), key
        assert moved["cu_seq_lens_k"] is moved["cu_seq_lens_q"]
