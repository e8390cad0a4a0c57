"""DPO on CUDA in bf16 (raypack/train/objectives/dpo.py): packed pairs on the varlen kernels give the pairs'
log-probability sums of each sequence run alone (the model's own SDPA), and the chunked DPO loss
and its gradients match the full-logit path's."""

from __future__ import annotations

import pytest
import torch
from dpo_check import SAMPLE, packed_pair_rows

from raypack.config import DpoConfig
from raypack.data.collate import move_batch
from raypack.model.build import load_model
from raypack.train.objectives.dpo import DPOLoss
from raypack.train.objectives.dpo_reference import rows_logps
from raypack.train.objectives.loss import make_loss

pytestmark = pytest.mark.gpu


def model(attention="auto"):
    torch.manual_seed(0)
    return load_model("tiny-llama", attention=attention, dtype="bfloat16", vocab_size=768, hidden_size=256,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32).cuda()


def test_packed_sums_on_the_varlen_kernels_match_each_sequence_alone():
    rows = packed_pair_rows(SAMPLE, 8, budget=600)[0]
    packed = model()
    loss = DPOLoss(make_loss(packed, "chunked"), DpoConfig(), gather=None)
    sums = rows_logps(loss, packed, rows, False, 2, "cuda")
    alone = model("sdpa")
    for row in rows:
        for eid, (lo, hi) in zip(row["example_ids"], _bounds(row)):
            ids = torch.tensor(row["input_ids"][lo:hi], device="cuda")[None]
            labels = torch.tensor(row["labels"][lo:hi], device="cuda")
            with torch.no_grad():
                logps = torch.log_softmax(alone(input_ids=ids).logits[0, :-1].float(), -1)
            keep = labels[1:] != -100
            expected = logps.gather(1, ids[0, 1:, None])[:, 0][keep].sum().item()
            assert sums[eid] == pytest.approx(expected, rel=2e-2, abs=0.5), eid


def test_chunked_dpo_matches_full_logits_in_bf16():
    rows = packed_pair_rows(SAMPLE, 8, budget=600)[0]
    results = []
    for kind in ("chunked", "full"):
        m = model()
        loss = DPOLoss(make_loss(m, kind), DpoConfig(beta=0.1, sft_weight=0.2), gather=None)
        reference = rows_logps(loss, m, rows, False, 2, "cuda")
        loss = DPOLoss(loss.base, loss.cfg, gather=None, reference={k: v - 1.0 for k, v in reference.items()})
        step = loss.prepare_step(rows)
        total = sum(loss(m, {**move_batch(b, "cuda"), "sft_scale": 0.1}) for b in step.batches)
        total.backward()
        results.append((total.item(), m.lm_head.weight.grad.float().clone()))
    (chunked, g_chunked), (full, g_full) = results
    assert chunked == pytest.approx(full, rel=1e-2)
    assert ((g_chunked - g_full).abs().max() / g_full.abs().max()).item() < 2e-2


def _bounds(row):
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
    return list(zip(starts[:-1], starts[1:]))

