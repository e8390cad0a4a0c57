"""Training metrics without Ray: the reporter's aggregation and logging, and the MFU FLOP count."""

from __future__ import annotations

import sys
import types

import pytest

from raypack.model.build import tiny_config
from raypack.train.metrics import Reporter, model_flops_per_token


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


def test_flops_grow_with_the_causal_context():
    cfg = tiny_config("llama")
    short, long = model_flops_per_token(cfg, 100.0**2), model_flops_per_token(cfg, 1000.0**2)
    assert long - short == pytest.approx(12 * 2 * 64 * (500 - 50))


def test_frozen_weights_cost_forward_and_input_gradients_only():
    """With adapters, the frozen weights' N cost 4 FLOPs a token (no weight gradient), the A
    adapter weights 6; attention is unchanged."""
    cfg = tiny_config("llama")
    full, lora = model_flops_per_token(cfg, 100.0**2), model_flops_per_token(cfg, 100.0**2, adapter_params=1000)
    n = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128) + 64 * cfg.vocab_size
    assert full - lora == pytest.approx(2 * n - 6 * 1000)


def test_steps_without_label_tokens_weigh_nothing_and_a_window_of_them_has_no_loss(capsys):
    r = Reporter(rank=0, total_steps=3, report_every=1, static={})
    step = {"tokens": 100.0, "step_time_s": 0.1, "data_wait_s": 0.0, "rank_imbalance": 1.0, "lr": 1e-3}
    r.log_step(1, {**step, "loss": float("nan"), "label_tokens": 0.0, "skipped_steps": 1.0})
    m = r.summary(1, 0)
    assert m["loss"] is None and m["skipped_steps"] == 1.0  # not 0.0: nothing was trained
    assert "step 1/3 loss - " in capsys.readouterr().out
    r.log_step(2, {**step, "loss": float("nan"), "label_tokens": 0.0, "skipped_steps": 1.0})
    r.log_step(3, {**step, "loss": 4.0, "label_tokens": 8.0, "skipped_steps": 0.0})
    m = r.summary(3, 0)
    assert m["loss"] == 4.0 and m["skipped_steps"] == 1.0
