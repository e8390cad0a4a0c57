"""`ray job submit` end to end on the CPU: cluster/local.sh starts a head and a worker node (own
temp dirs and ports, token auth on), jobs/*.py run from an uploaded working dir, and `local.sh
stop` ends only those nodes. Never `ray stop`: it would kill every Ray cluster on the machine."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from paths import REPO

BIN = Path(sys.executable).parent
EXCLUDES = [".venv", ".git", ".cache", "results", "__pycache__", ".pytest_cache", ".hypothesis", "benchmarks/results"]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_base_port() -> int:
    """A base port whose head ports are free; local.sh derives every other port from it."""
    for _ in range(50):
        base = random.randrange(20000, 40000, 10)
        try:
            for port in (base, base - 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port")


@pytest.fixture(scope="module")
def cluster():
    # A short temp dir: Ray's unix sockets live under it and paths are limited to 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    port = _free_base_port()
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",  # jobs run `python` from the head's PATH: the venv's
        # This test's own token, so ~/.ray/auth_token is neither needed nor touched; the client
        # below authenticates with the same two variables.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAYPACK_LOCAL_DIR": str(tmp / "c"),
        "RAYPACK_LOCAL_PORT": str(port),
        "RAYPACK_DASH_PORT": str(port - 1),
        "RAYPACK_NODE_CPUS": "4",
        "RAY": str(BIN / "ray"),
    }
    env.pop("RAY_ADDRESS", None)
    local_sh = [str(REPO / "cluster" / "local.sh")]
    try:
        subprocess.run([*local_sh, "start", "1"], env=env, check=True, timeout=300, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        subprocess.run([*local_sh, "stop"], env=env, timeout=120)
        pytest.fail(f"local.sh start failed:\n{e.stdout}\n{e.stderr}")
    yield {"env": env, "tmp": tmp, "address": f"http://127.0.0.1:{port - 1}", "dir": tmp / "c"}
    subprocess.run([*local_sh, "stop"], env=env, timeout=120, check=True)
    assert not _pids_under(tmp / "c"), "local.sh stop left processes running"
    shutil.rmtree(tmp, ignore_errors=True)


def _pids_under(path: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(path) in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def submit(cluster, *entrypoint: str, timeout: int = 900) -> tuple[str, str]:
    """Submit from the repo as the working dir; wait for the end; return (status, logs)."""
    job_id = f"raypack-test-{uuid.uuid4().hex[:8]}"
    runtime_env = {"excludes": EXCLUDES, "env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}}
    ray = str(BIN / "ray")
    out = subprocess.run(
        [ray, "job", "submit", "--address", cluster["address"], "--submission-id", job_id,
         "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint],
        env=cluster["env"], cwd=REPO, timeout=timeout, capture_output=True, text=True,
    )
    status = subprocess.run(
        [ray, "job", "status", "--address", cluster["address"], job_id],
        env=cluster["env"], timeout=120, capture_output=True, text=True,
    )
    # `ray job status` prints "Job '<id>' succeeded" / "failed" / "was stopped", else the state.
    text = (status.stdout + status.stderr).upper()
    words = {"SUCCEEDED": "SUCCEEDED", "' FAILED": "FAILED", "WAS STOPPED": "STOPPED", "RUNNING": "RUNNING",
             "PENDING": "PENDING"}
    state = next((state for word, state in words.items() if word in text), "UNKNOWN: " + text[-500:])
    return state, out.stdout[-6000:] + out.stderr[-6000:]


def test_client_without_token_is_refused(cluster):
    env = {k: v for k, v in cluster["env"].items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = "not-the-token"
    out = subprocess.run([str(BIN / "ray"), "job", "list", "--address", cluster["address"]],
                         env=env, timeout=120, capture_output=True, text=True)
    assert out.returncode != 0 and "uthentication" in out.stdout + out.stderr


def test_plan_job(cluster):
    lengths = cluster["tmp"] / "lengths.npy"
    np.save(lengths, np.random.default_rng(0).integers(16, 1000, 3000))
    state, logs = submit(cluster, "python", "jobs/plan.py", "--lengths", str(lengths),
                         "pack.budget=1024", "train.num_workers=2", "--strategy", "pad", "bfd", "balanced")
    assert state == "SUCCEEDED", logs
    assert "balanced" in logs and "bfd" in logs


def test_sft_job(cluster):
    results = cluster["tmp"] / "results"
    name = f"job-{uuid.uuid4().hex[:6]}"
    state, logs = submit(cluster, "python", "jobs/sft.py", "--config", "jobs/configs/tiny_cpu.yaml",
                         f"run.storage_path={results}", f"run.name={name}", "train.max_steps=4",
                         "train.checkpoint_every_steps=0")
    assert state == "SUCCEEDED", logs
    run = results / name
    assert run.is_dir(), logs
    assert list(run.glob("checkpoint_*")), f"no checkpoint in {sorted(p.name for p in run.iterdir())}"
