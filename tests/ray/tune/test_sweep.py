"""`raypack sweep` end to end on the CPU: the bundled CPU sweep config, at least three packing
strategies, one short Ray Train run each, then the table, CSV and plot in the experiment dir."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import uuid
import pytest

from raypack.config import load
from raypack.tune.sweep import CSV, PLOT, TABLE

from paths import REPO

CONFIG = REPO / "jobs" / "configs" / "sweeps" / "packing_cpu.yaml"

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_cpu_sweep(tmp_path):
    name = f"sweep-{uuid.uuid4().hex[:6]}"  # a reused name would resume an old run
    env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}
    env.pop("RAY_ADDRESS", None)  # its own local Ray instance, never a cluster left on the machine
    out = subprocess.run(
        [sys.executable, "-m", "raypack.cli", "sweep", "--config", str(CONFIG),
         f"run.storage_path={tmp_path}", f"run.name={name}"],
        cwd=REPO, env=env, timeout=1500, capture_output=True, text=True,
    )
    logs = out.stdout[-5000:] + out.stderr[-5000:]
    assert out.returncode == 0, logs
    exp = tmp_path / name
    strategies = load(CONFIG).tune.strategies
    assert len(strategies) >= 3
    rows = list(csv.DictReader((exp / CSV).open()))
    assert [r["strategy"] for r in rows] == list(strategies), logs
    for r in rows:
        assert r["status"] == "OK", r
        assert float(r["tokens_per_s"]) > 0 and float(r["loss"]) > 0
        assert 0 < float(r["packing_efficiency"]) <= 1
    # packing beats padding on efficiency
    eff = {r["strategy"]: float(r["packing_efficiency"]) for r in rows}
    assert eff["bfd"] > eff["pad"]
    table = (exp / TABLE).read_text()
    assert all(f"| {s} |" in table for s in strategies)
    assert (exp / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep_results" in out.stdout + out.stderr  # the table and where the files are, printed
    assert len(list((exp / "runs").iterdir())) == len(strategies)  # one Train run per trial
