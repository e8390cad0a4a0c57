"""Trainer pieces that need no Ray: the DeepSpeed config overlay, the LR schedule, the reporter."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from raypack.config import TrainConfig
from raypack.data.plan import fold_accumulation
from raypack.data.prepare import is_eval
from raypack.train.engine import deepspeed_config, lr_lambda
from raypack.train.metrics import Reporter


def test_typed_config_overlays_preset_and_leaves_no_auto():
    cfg = TrainConfig(zero_stage=3, grad_accum=4, grad_clip=0.5, deepspeed_preset="zero3_offload",
                      offload_optimizer=False, offload_params=False)
    ds = deepspeed_config(cfg, dtype=torch.bfloat16, world_size=8)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero and "offload_param" not in zero
    assert zero["overlap_comm"] is True  # the preset's tuning survives
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert "optimizer" not in ds and "scheduler" not in ds  # raypack passes its own
    assert "auto" not in json.dumps(ds)


def test_offload_uses_deepspeeds_optimizer_and_auto_is_refused(tmp_path):
    ds = deepspeed_config(TrainConfig(zero_stage=2, offload_optimizer=True), dtype=torch.float32, world_size=2)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW"
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": "auto"}}))
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size is still 'auto'"):
        deepspeed_config(TrainConfig(deepspeed_preset=str(preset)), dtype=torch.float32, world_size=1)
    with pytest.raises(ValueError, match="no preset 'zero9'"):
        deepspeed_config(TrainConfig(deepspeed_preset="zero9"), dtype=torch.float32, world_size=1)


def test_warmup_then_cosine():
    lrs = [lr_lambda(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_eval_split_is_stable_and_near_the_fraction():
    ids = torch.arange(0, 200_000, 7).numpy()
    held = is_eval(ids, 0.1, seed=0)
    assert 0.09 < held.mean() < 0.11
    assert (held == is_eval(ids, 0.1, seed=0)).all()
    assert not is_eval(ids, 0.0, seed=0).any()


def test_fold_accumulation_gives_each_rank_accum_microsteps_per_virtual_step():
    import numpy as np

    from raypack.config import PackConfig
    from raypack.data.strategies import make_plan

    lengths = np.random.default_rng(0).integers(1, 64, 500)
    plan = fold_accumulation(make_plan(lengths, PackConfig(strategy="balanced", budget=64), 2 * 3), 2, 3)
    assert plan.num_ranks == 2 and plan.num_steps % 3 == 0
    cells = set(zip(plan.rank.tolist(), plan.step.tolist()))
    assert len(cells) == len(set(plan.pack.tolist()))  # still one pack per (rank, step)
    assert max(plan.step) < plan.num_steps and set(plan.rank.tolist()) <= {0, 1}


def test_reporter_weights_loss_by_label_tokens_and_logs(tmp_path, monkeypatch):
    logged = []
    fake = types.SimpleNamespace(
        set_tracking_uri=lambda uri: logged.append(("uri", uri)),
        set_experiment=lambda name: None,
        start_run=lambda run_name: logged.append(("run", run_name)),
        log_params=lambda params: None,
        log_metrics=lambda metrics, step: logged.append(("metrics", step, metrics["loss"])),
        end_run=lambda: logged.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = Reporter(rank=0, total_steps=2, report_every=2, static={"packing_efficiency": 0.9},
                 tb_dir=str(tmp_path / "tb"), mlflow_uri=f"file://{tmp_path}/mlruns", run_name="t")
    step = {"tokens": 100.0, "step_time_s": 0.1, "data_wait_s": 0.0, "rank_imbalance": 1.0, "lr": 1e-3}
    r.log_step(1, {**step, "loss": 2.0, "label_tokens": 10.0})
    r.log_step(2, {**step, "loss": 5.0, "label_tokens": 30.0})
    m = r.summary(2, 0)
    r.close()
    assert m["loss"] == pytest.approx((2.0 * 10 + 5.0 * 30) / 40)
    assert m["packing_efficiency"] == 0.9 and m["mfu"] is None  # no known peak FLOP/s on the CPU
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert ("uri", f"file://{tmp_path}/mlruns") in logged and ("metrics", 2, m["loss"]) in logged
    assert logged[-1] == ("end",)
