"""benchmarks/fp32_matmuls.py's counter catches what it is for: the torch engine's precision mixed
step (fp32 master weights, the forward under autocast) with the chunked loss's head in the
weights' fp32, as it ran before issue 60 (a loss built without the compute dtype), shows fp32
matmuls at raypack's chunked cross-entropy; the loss the engine builds shows none. Every model
kind on every engine path is counted by the script's smoke run (tests/unit/benchmarks/test_smoke.py
checks its total of hot-path fp32 matmuls is 0)."""

from __future__ import annotations

import torch

from raypack.data.collate import collate_packed


def _step(loss_dtype):
    from benchmarks.fp32_matmuls import MatmulCounter
    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.objectives.loss import CausalLMLoss

    cfg = TrainConfig(engine="torch", zero_stage=0)  # precision mixed
    torch.manual_seed(0)
    model = load_model("tiny-llama", dtype=engines.weights_dtype(cfg, "bfloat16"), vocab_size=97)
    engine = engines.build(model, cfg, dtype=engines.compute_dtype(cfg, "bfloat16"), world_size=1, total_steps=1)
    loss = CausalLMLoss(engine.module, "chunked", 8, loss_dtype)
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = collate_packed([{"input_ids": ids, "labels": ids, "position_ids": list(range(12)) + list(range(8))}],
                           padded=False, pad_token_id=0)
    counter = MatmulCounter()
    with counter, torch.autograd.detect_anomaly(check_nan=False):
        loss(engine, batch).backward()
    return counter


def test_the_counter_finds_a_head_computing_in_fp32_and_the_engines_loss_has_none():
    before = _step(None).hot_path_fp32()
    sites = {site for (_, site, _, _) in before}
    assert sites and all(site.startswith("raypack/train/objectives/chunked_ce.py") for site in sites), before
    assert {phase for (phase, _, _, _) in before} == {"forward"}  # its gradient matmuls run inside the forward
    after = _step(torch.bfloat16)
    assert not after.hot_path_fp32(), after.hot_path_fp32()
    assert sum(n for k, n in after.counts.items() if k[3] == "bfloat16") > 0  # it counted the step's matmuls
