"""Training metrics without Ray: the reporter's aggregation and logging, and the MFU FLOP count."""

from __future__ import annotations

import sys
import types

import pytest

from raypack.model.build import tiny_config
from raypack.train.metrics import Eta, Reporter, due_between, model_flops_per_token
from raypack.train.tracking import Trackers, TrackingTargets

from trackfiles import history, tensorboard_scalars


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
    trackers = Trackers.open(TrackingTargets(tensorboard_dir=str(tmp_path / "tb"), mlflow_uri=f"file://{tmp_path}/mlruns"),
                             "t", {"train": {"lr": 1e-3}})
    r = Reporter(rank=0, total_steps=2, report_every=2, static={"packing_efficiency": 0.9}, trackers=trackers)
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


def test_flops_of_a_config_that_sizes_attention_per_layer_count_each_layer():
    """Gemma 4's full-attention layers have their own head_dim (transformers refuses to read one
    global value): the count sums each layer's own attention, and doesn't fail."""
    from raypack.model.family_table import FAMILIES

    cfg = FAMILIES["gemma4"].build_config("gemma4")
    widths = [layer.num_attention_heads * layer.head_dim for layer in cfg.per_layer_config]
    assert len(set(widths)) > 1, "the tiny Gemma 4 should mix attention widths"
    short, long = model_flops_per_token(cfg, 100.0**2), model_flops_per_token(cfg, 1000.0**2)
    assert long - short == pytest.approx(12 * sum(widths) * (500 - 50))


def test_steps_without_label_tokens_weigh_nothing_and_a_window_of_them_has_no_loss(capsys):
    r = Reporter(rank=0, total_steps=3, report_every=1, static={})
    step = {"tokens": 100.0, "step_time_s": 0.1, "data_wait_s": 0.0, "rank_imbalance": 1.0, "lr": 1e-3}
    r.log_step(1, {**step, "loss": float("nan"), "label_tokens": 0.0, "skipped_steps": 1.0})
    m = r.summary(1, 0)
    assert m["loss"] is None and m["skipped_steps"] == 1.0  # not 0.0: nothing was trained
    assert "step 1/3 epoch 1/1 loss - " in capsys.readouterr().out
    r.log_step(2, {**step, "loss": float("nan"), "label_tokens": 0.0, "skipped_steps": 1.0})
    r.log_step(3, {**step, "loss": 4.0, "label_tokens": 8.0, "skipped_steps": 0.0})
    m = r.summary(3, 0)
    assert m["loss"] == 4.0 and m["skipped_steps"] == 1.0


def test_wandb_offline_gets_what_tensorboard_gets_and_the_config(tmp_path):
    """Per step and per report, W&B's rows hold the TensorBoard scalars, name for name and step for
    step; the run config is logged once. Offline: no network, no API key."""
    wandb = {"mode": "offline", "project": "p", "entity": None, "group": "g", "tags": ("t",), "dir": str(tmp_path / "w"),
             "id": "abc123"}
    trackers = Trackers.open(TrackingTargets(tensorboard_dir=str(tmp_path / "tb"), wandb=wandb), "run", {"train": {"lr": 1e-3}})
    r = Reporter(rank=0, total_steps=4, report_every=2, static={"packing_efficiency": 0.9, "token_imbalance": 1.01},
                 trackers=trackers)
    for step in range(1, 5):
        r.log_step(step, {"tokens": 100.0, "step_time_s": 0.1, "data_wait_s": 0.0, "rank_imbalance": 1.0, "lr": 1e-3,
                          "loss": 5.0 - step, "label_tokens": 10.0})
        if r.due(step):
            r.summary(step, 0, {"eval_loss": 3.5} if step == 4 else None)
    r.close()
    tb = tensorboard_scalars(tmp_path / "tb")
    (run_file,) = (tmp_path / "w" / "wandb").glob("offline-run-*-abc123/run-abc123.wandb")
    logged: dict[str, dict[int, float]] = {}
    for row in history(run_file):
        for key, value in row.items():
            if key.startswith("train/"):
                logged.setdefault(key, {})[row["_step"]] = value
    assert {"train/loss", "train/eval_loss", "train/tokens_per_s", "train/packing_efficiency", "train/token_imbalance",
            "train/peak_memory_gb", "train/lr"} <= set(tb)
    assert set(logged) == set(tb)
    for key, steps in tb.items():
        assert logged[key] == pytest.approx(steps, rel=1e-6), key
    assert tb["train/loss"] == {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0} and tb["train/eval_loss"] == {4: 3.5}


def test_eta_counts_steps_at_their_own_pace_and_each_pause_still_due():
    """10 steps, an eval and a checkpoint every 5: after 5 steps of 2 s, an eval of 3 s and a
    checkpoint of 4 s, one of each is still due (at step 10) besides 5 steps."""
    eta = Eta(total_steps=10, eval_every=5, checkpoint_every=5)
    eta.trained(5, 10.0)
    assert eta.left(5) == pytest.approx(10.0)  # no pause measured yet: steps only
    eta.evaluated(3.0)
    eta.checkpointed(4.0)
    assert eta.left(5) == pytest.approx(5 * 2.0 + 3.0 + 4.0)
    eta.trained(3, 6.0 + 4.0)  # the next window holds the checkpoint's 4 s: not a slower step
    assert eta.left(8) == pytest.approx(2 * 2.0 + 3.0 + 4.0)


def test_pauses_due_count_the_last_step_once():
    assert due_between(0, 10, 5) == 2 and due_between(5, 10, 5) == 1 and due_between(10, 10, 5) == 0
    assert due_between(0, 12, 5) == 3  # 5, 10, and the last step
    assert due_between(3, 12, 0) == 1  # only the last step
