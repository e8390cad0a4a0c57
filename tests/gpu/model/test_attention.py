"""CUDA varlen attention (flash-attn or torch varlen_attn) against per-example SDPA in bf16."""

from __future__ import annotations

import pytest
import torch

from raypack.data.collate import collate_packed, move_batch
from raypack.model import attention as attn
from raypack.model.build import load_model

pytestmark = pytest.mark.gpu

LENGTHS = [[300, 41, 1, 150], [500, 77]]


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, examples = [], []
    for lengths in LENGTHS:
        exs = [torch.randint(3, 1024, (n,), generator=g) for n in lengths]
        examples += exs
        ids = torch.cat(exs).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": [p for n in lengths for p in range(n)]})
    return rows, examples


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("backend", ["auto", "torch_varlen", "flash_attn"])
@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {"sliding_window": 64}), ("qwen3", {})])
def test_cuda_varlen_matches_sdpa_in_bf16(backend, family, overrides):
    if backend == "flash_attn" and not attn.flash_attn_available():
        pytest.skip("flash-attn not installed")
    torch.manual_seed(0)
    cfg_overrides = dict(overrides, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = load_model(f"tiny-{family}", attention=backend, dtype="bfloat16", **cfg_overrides).cuda()
    ref = load_model(model.config, attention="sdpa", dtype="bfloat16").cuda()
    ref.load_state_dict(model.state_dict())
    rows, examples = _rows()
    batch = move_batch(collate_packed(rows), "cuda")

    out = model(**batch)
    out.loss.backward()
    ref_logits = torch.cat([ref(input_ids=e[None].cuda()).logits[0] for e in examples])
    assert _rel(out.logits[0], ref_logits) < 2e-2  # bf16: a few ulps after two layers

    # gradient check: the same mean loss over the same label tokens
    labels = batch["labels"][0]
    ref_loss = torch.nn.functional.cross_entropy(
        ref_logits[:-1].float(), labels[1:], ignore_index=-100
    )
    ref_loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 5e-2


def test_attention_function_does_not_sync():
    rows, _ = _rows()
    batch = move_batch(collate_packed(rows), "cuda")
    total = batch["input_ids"].shape[1]
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q[:, :2]), torch.randn_like(q[:, :2])
    meta = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    fn = attn._make_forward(None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = fn(torch.nn.Module(), q, k, v, None, scaling=0.125, sliding_window=128, **meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (1, total, 8, 64)


def test_torch_varlen_refuses_softcap_clearly():
    if attn.flash_attn_available():
        pytest.skip("flash-attn handles softcap")
    model = load_model("tiny-gemma2", attention="torch_varlen", dtype="bfloat16").cuda()
    rows, _ = _rows()
    with pytest.raises(ValueError, match="softcapping"):
        model(**move_batch(collate_packed(rows), "cuda"))
