"""`raypack sweep` on the CPU, end to end: ASHA stops a stalled trial and releases its workers
(three times in one pytest run: the earlier deadlock slipped through single runs), tokenization
runs once per sweep, an interrupted sweep resumes without rerunning finished trials, and the
bundled CPU sweep compares strategies at equal work per optimizer step."""

from __future__ import annotations

import csv
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from raypack.config import load
from raypack.runs import SWEEP_CONFIG as CONFIG
from raypack.tune.sweep import CSV, CURVES, EVAL_PLOT, PLOT, TABLE

from paths import REPO

CPU_SWEEP = REPO / "jobs" / "configs" / "sweeps" / "packing_cpu.yaml"
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def tiny(tmp_path, name, *overrides):
    """The CPU sweep made small: budget 256, 8 steps, a report every 2."""
    return load(CPU_SWEEP, [
        "pack.budget=256", "train.max_steps=8", "train.report_every_steps=2", "train.eval_every_steps=4",
        f"run.storage_path={tmp_path}", f"run.name={name}", *overrides,
    ])


def rows_of(exp: Path) -> list[dict]:
    return json.loads((exp / "sweep_rows.json").read_text())


def data_entries(exp: Path, kind: str) -> list[Path]:
    """Committed cache entries of `kind` (tokenized, packed): the data folders their manifests name."""
    return [p for p in (exp / "cache" / kind).glob("*/*") if p.is_dir()]


def train_held() -> dict[str, str]:
    """Train actors alive and placement groups reserved now, by id. The GCS tables, not the state
    API: the shared test cluster runs without a dashboard."""
    import ray
    from ray._private.state import actors

    held = {k: v["ActorClassName"] for k, v in actors().items() if v["State"] == "ALIVE" and "Train" in v["ActorClassName"]}
    held.update({k: f"placement group {k}" for k, v in ray.util.placement_group_table().items() if v["state"] == "CREATED"})
    return held


def held_by_train(before: dict[str, str], grace_s: float = 30.0) -> list[str]:
    """What this test's runs still hold (anything not in `before`, what earlier tests on the shared
    cluster left), once `grace_s` has passed without it all going (torn down asynchronously)."""
    deadline = time.time() + grace_s
    while True:
        left = [name for k, name in train_held().items() if k not in before]
        if not left or time.time() > deadline:
            return left
        time.sleep(1)


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_asha_stops_the_stalled_trial(ray_local, tmp_path, monkeypatch, attempt):
    import raypack.data.cache as prepare_module
    from raypack.tune.sweep import sweep

    calls = []
    real = prepare_module.tokenize_dataset
    monkeypatch.setattr(prepare_module, "tokenize_dataset", lambda cfg, *a, **k: calls.append(1) or real(cfg, *a, **k))
    name = f"asha-{attempt}-{uuid.uuid4().hex[:6]}"
    # lr 1e-6 stalls at the initial loss. In this order each later healthy trial beats the ones
    # before it at the rung (step 4), so ASHA (rf 2: keep the better half) stops only the stall.
    # A report every step: each waits until Tune asks for more, so the stopped run gets at most
    # two steps past its stop at step 4 and never reaches step 8 (with a report every 2 steps it
    # could: its worker holds one report while the controller waits on Tune).
    cfg = tiny(tmp_path, name, "tune.strategies=[bfd]", "tune.lrs=[1e-3, 2e-3, 1e-6, 3e-3]", "train.report_every_steps=1",
               "tune.scheduler=asha", "tune.metric=loss", "tune.asha.grace_period=4", "tune.asha.reduction_factor=2")
    before = train_held()
    faulthandler.dump_traceback_later(900, exit=True)  # a hang fails the run, with every thread's stack
    try:
        outcome = sweep(cfg)
    finally:
        faulthandler.cancel_dump_traceback_later()
    exp = tmp_path / name
    rows = {r["lr"]: r for r in outcome.rows}
    assert [r["status"] for r in outcome.rows] != [] and rows[1e-6]["status"] == "STOPPED", outcome.rows
    assert rows[1e-6]["steps"] == 4 and rows[1e-6]["total_steps"] == 8
    assert all(rows[lr]["status"] == "OK" and rows[lr]["steps"] == 8 for lr in (2e-3, 3e-3))
    # Live metrics: every Train report of a trial reached Tune while it ran.
    for r in outcome.rows:
        steps = [h["step"] for h in r["history"]]
        assert steps == list(range(1, r["steps"] + 1)), steps
        seen = [h["tokens_seen"] for h in r["history"]]
        assert all(b > a for a, b in zip(seen, seen[1:])) and all(h["loss"] > 0 for h in r["history"])
        assert all(h["tokens_per_s"] > 0 for h in r["history"])
        assert [h["step"] for h in r["history"] if h["eval_loss"] is not None] == [s for s in steps if s % 4 == 0]
    # The stop released the stalled trial's Train run: it never reached its final step, whose
    # checkpoint the healthy trials wrote, though two more trials' worth of time went by.
    (stalled,) = (exp / "runs").glob("bfd-b256-lr1e-06-*")
    (healthy,) = (exp / "runs").glob("bfd-b256-lr0.003-*")
    assert not list(stalled.glob("checkpoint_*")) and list(healthy.glob("checkpoint_*"))
    assert held_by_train(before) == []
    table = (exp / TABLE).read_text()
    assert "bfd-b256-lr1e-06" in table and "stopped early by the scheduler at step 4 of 8" in table
    # Tokenized once, packed once (one pack config), and no trial prepared data of its own.
    assert len(calls) == 1 and len(data_entries(exp, "tokenized")) == 1 and len(data_entries(exp, "packed")) == 1
    assert not [p for p in (exp / "runs").rglob("packed")]


def _wait_for(predicate, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended (rc {proc.returncode}) before {what}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


def test_interrupted_sweep_resumes(tmp_path):
    name = f"resume-{uuid.uuid4().hex[:6]}"
    exp = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, never a leftover cluster
    base = [sys.executable, "-m", "raypack.cli", "sweep"]
    overrides = ["pack.budget=256", "train.max_steps=6", "train.report_every_steps=2", "train.eval_every_steps=2",
                 "tune.strategies=[pad, bfd, balanced]", f"run.storage_path={tmp_path}", f"run.name={name}"]
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([*base, "--config", str(CPU_SWEEP), *overrides], cwd=REPO, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        # Interrupt (Ctrl-C) once the first trial has finished and the second has started.
        _wait_for(lambda: len(list((exp / "runs").glob("*/checkpoint_*"))) >= 1
                  and len(list((exp / "runs").glob("*"))) >= 2, 900, first, "the second trial")
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=300) == 130, (tmp_path / "first.log").read_text()[-4000:]
    finally:
        if first.poll() is None:
            first.kill()
    before = {r["trial"]: r for r in rows_of(exp)}
    done = [t for t, r in before.items() if r["status"] == "OK"]
    assert len(done) == 1 and any(r["status"] == "UNFINISHED" for r in before.values()), before
    # Tune creates a trial when it starts it: the third had no row yet, and the table says so.
    assert "1 more trial(s) had not started" in (exp / TABLE).read_text()
    (finished_run,) = [d for d in (exp / "runs").iterdir() if d.name.endswith(done[0])]
    finished_files = sorted(p.relative_to(exp) for p in finished_run.rglob("*"))

    # From another working folder, by a relative path: the sweep saved absolute paths.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*base, "--resume", f"../{name}"], cwd=elsewhere, env=env, timeout=1200,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = {r["trial"]: r for r in rows_of(exp)}
    assert set(before) < set(after) and len(after) == 3
    assert all(r["status"] == "OK" and r["steps"] == 6 for r in after.values()), after
    # The finished trial was not run again: same reports, same Train run files.
    assert after[done[0]]["history"] == before[done[0]]["history"]
    assert sorted(p.relative_to(exp) for p in finished_run.rglob("*")) == finished_files
    assert len(data_entries(exp, "tokenized")) == 1  # the resume reused the tokenized data
    table = (exp / TABLE).read_text()
    assert table.count("| OK |") == 3 and "ran to the end" in table


def test_cpu_sweep_compares_at_equal_work(tmp_path):
    """The bundled CPU sweep, as a user runs it: every strategy, one epoch each."""
    name = f"sweep-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-m", "raypack.cli", "sweep", "--config", str(CPU_SWEEP),
         f"run.storage_path={tmp_path}", f"run.name={name}"],
        cwd=REPO, env=env, timeout=1800, capture_output=True, text=True,
    )
    logs = out.stdout[-5000:] + out.stderr[-5000:]
    assert out.returncode == 0, logs
    exp = tmp_path / name
    strategies = load(CPU_SWEEP).tune.strategies
    rows = list(csv.DictReader((exp / CSV).open()))
    assert [r["strategy"] for r in rows] == list(strategies), logs
    for r in rows:
        assert r["status"] == "OK", r
        assert float(r["tokens_per_s"]) > 0 and float(r["loss"]) > 0 and float(r["epoch_time_s"]) > 0
        assert 0 < float(r["packing_efficiency"]) <= 1
    # Equal work: padded and packed optimizer steps hold the same real tokens, within 15%.
    per_step = {r["strategy"]: float(r["tokens_per_step"]) for r in rows}
    padded, packed = [per_step[s] for s in ("pad", "flatten")], [per_step[s] for s in ("bfd", "balanced")]
    assert max(padded + packed) / min(padded + packed) < 1.15, per_step
    assert float(rows[0]["batch_size"]) > 1 and rows[2]["batch_size"] == ""  # pad's equal-work size; bfd has none
    table = (exp / TABLE).read_text()
    assert "Equal work per optimizer step (tune.equal_work: tokens_per_step)" in table
    assert "not representative of GPU throughput" in table
    assert all(f"| {s} |" in table for s in strategies)
    # Every trial reached its target (the worst final eval loss) at some time.
    assert all(r["time_to_target_s"] not in ("", None) for r in rows)
    for plot in (PLOT, CURVES, EVAL_PLOT):
        assert (exp / plot).read_bytes()[:8] == PNG
    assert (exp / CONFIG).exists() and "sweep_results" in out.stdout + out.stderr
    assert len(list((exp / "runs").iterdir())) == len(strategies)  # one Train run per trial
    assert len(data_entries(exp, "tokenized")) == 1 and len(data_entries(exp, "packed")) == len(strategies)


@pytest.mark.slow
def test_dpo_beta_sweep_runs_on_the_cpu(tmp_path):
    """The bundled DPO sweep as a user runs it: three betas, one reference pass shared (its entry
    sits beside the one packed folder), ranked by the held-out pairs' reward accuracy."""
    config = REPO / "jobs" / "configs" / "sweeps" / "dpo_beta_cpu.yaml"
    name = f"sweep-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-m", "raypack.cli", "sweep", "--config", str(config),
                          f"run.storage_path={tmp_path}", f"run.name={name}"],
                         cwd=REPO, env=env, timeout=1800, capture_output=True, text=True)
    logs = out.stdout[-5000:] + out.stderr[-5000:]
    assert out.returncode == 0, logs
    rows = list(csv.DictReader((tmp_path / name / CSV).open()))
    assert sorted(float(r["beta"]) for r in rows) == [0.05, 0.1, 0.5], logs
    for r in rows:
        assert r["status"] == "OK" and float(r["eval_rewards/accuracies"]) > 0.5, r
    assert len(list((tmp_path / name / "cache" / "packed").glob("*/reference/*/manifest.json"))) == 1
