"""`ray job submit` end to end on the CPU: cluster/local.sh starts a head and two worker nodes (own
temp dirs and ports, token auth on), jobs/*.py run from an uploaded working dir, and `local.sh
stop` ends only those nodes. Never `ray stop`: it would kill every Ray cluster on the machine.

A run ends the ways a cluster ends it (raypack/train/stop.py): `ray job stop` (SIGTERM to the
driver) and a worker node's `ray start` getting SIGTERM (Kubernetes evicting its pod, a spot
reclaim), the last test here, as it takes a node away."""

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
import time
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
        subprocess.run([*local_sh, "start", "2"], env=env, check=True, timeout=300, capture_output=True, text=True)
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


def submit(cluster, *entrypoint: str, timeout: int = 900, wait: bool = True) -> tuple[str, str]:
    """Submit from the repo as the working dir; wait for the end (or, without `wait`, only for the
    submission); return (status, logs), or with `wait=False` (job id, "")."""
    job_id = f"raypack-test-{uuid.uuid4().hex[:8]}"
    # Train's controller polls for node drains every 5 s by default: 1 s here, for the test's pace
    runtime_env = {"excludes": EXCLUDES, "env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
                                                     "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}}
    out = ray_cli(cluster, "job", "submit", "--address", cluster["address"], "--submission-id", job_id,
                  *([] if wait else ["--no-wait"]), "--working-dir", str(REPO), "--runtime-env-json",
                  json.dumps(runtime_env), "--", *entrypoint, timeout=timeout)
    if not wait:
        assert out.returncode == 0, out.stdout + out.stderr
        return job_id, ""
    return status_of(cluster, job_id), out.stdout[-6000:] + out.stderr[-6000:]


def ray_cli(cluster, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=cluster["env"], cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)


def status_of(cluster, job_id: str) -> str:
    out = ray_cli(cluster, "job", "status", "--address", cluster["address"], job_id)
    # `ray job status` prints "Job '<id>' succeeded" / "failed" / "was stopped", else the state.
    text = (out.stdout + out.stderr).upper()
    words = {"SUCCEEDED": "SUCCEEDED", "' FAILED": "FAILED", "WAS STOPPED": "STOPPED", "RUNNING": "RUNNING",
             "PENDING": "PENDING"}
    return next((state for word, state in words.items() if word in text), "UNKNOWN: " + text[-500:])


def logs_of(cluster, job_id: str) -> str:
    return ray_cli(cluster, "job", "logs", "--address", cluster["address"], job_id).stdout


def wait_for(cluster, job_id: str, text: str, timeout: float = 900) -> str:
    """The job's logs once they hold `text` (or it ended: then the test fails with them)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        logs = logs_of(cluster, job_id)
        if text in logs:
            return logs
        if status_of(cluster, job_id) not in ("RUNNING", "PENDING"):
            pytest.fail(f"the job ended before {text!r}:\n{logs[-5000:]}")
        time.sleep(2)
    pytest.fail(f"no {text!r} in {timeout:.0f} s:\n{logs_of(cluster, job_id)[-5000:]}")


def wait_end(cluster, job_id: str, timeout: float = 900) -> str:
    t0 = time.monotonic()
    while (state := status_of(cluster, job_id)) in ("RUNNING", "PENDING") and time.monotonic() - t0 < timeout:
        time.sleep(2)
    return state


def trained_once(run: Path, result: dict, epochs: int = 1) -> None:
    """The final model's step logs hold every step once, and in each epoch every example the
    packed data holds once (the plan's rows, as prepare wrote them: independent of the loop)."""
    import pyarrow.parquet as pq

    from raypack.train.checkpoint import read_steps_log

    planned = sorted(i for f in sorted((run / "packed" / "train").rglob("*.parquet"))
                     for row in pq.read_table(f, columns=["example_ids"]).column(0).to_pylist() for i in row)
    by_epoch: dict[int, list[int]] = {}
    for log in sorted(Path(result["checkpoint"]).glob("steps_rank*.npz")):
        entries = read_steps_log(log)
        assert [step for step, _, _ in entries] == list(range(1, result["step"] + 1)), "a step taken twice or never"
        for _, epoch, ids in entries:
            by_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == planned, f"epoch {epoch + 1}: an example trained twice or never"


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


def test_ray_job_stop_checkpoints_and_the_job_resumes(cluster):
    """`ray job stop` sends the driver SIGTERM (and SIGKILL RAY_JOB_STOP_WAIT_TIME_S later, which
    local.sh sets to 30 on the head): the run stops after a step with a checkpoint, says how to
    resume, and a second job with --resume trains the rest, every example once."""
    from trackfiles import tensorboard_events

    results = cluster["tmp"] / "results"
    name = f"stop-{uuid.uuid4().hex[:6]}"
    run = results / name
    job, _ = submit(cluster, "python", "jobs/sft.py", "--config", "jobs/configs/tiny_cpu.yaml",
                    f"run.storage_path={results}", f"run.name={name}", "pack.budget=256", "train.report_every_steps=1",
                    "train.checkpoint_every_steps=4", "train.stop_checkpoint_after_s=0", "train.epochs=4", wait=False)
    wait_for(cluster, job, "[raypack] step 6/")
    assert ray_cli(cluster, "job", "stop", "--address", cluster["address"], job).returncode == 0
    assert wait_end(cluster, job) == "STOPPED"
    logs = logs_of(cluster, job)
    last = [line for line in logs.splitlines() if line.startswith("[raypack] stopped by SIGTERM after step ")]
    assert last and last[-1].endswith(f" (a checkpoint saved there); continue it with: raypack train --resume {run}"), \
        logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]
    stopped = int(last[-1].split("after step ")[1].split()[0])
    assert not (run / "raypack_result.json").exists()

    state, logs = submit(cluster, "python", "jobs/sft.py", "--resume", str(run))
    assert state == "SUCCEEDED", logs
    result = json.loads((run / "raypack_result.json").read_text())
    trained_once(run, result, epochs=4)
    steps = [step for tag, step, _ in tensorboard_events(run / "tensorboard") if tag == "train/loss"]
    assert steps == list(range(1, result["step"] + 1)) and stopped < result["step"], "a step logged twice or never"


def _node_of_train_workers(cluster) -> list[int]:
    """Which of local.sh's nodes (0: the head) hold a Ray Train worker of this cluster: the node's
    temp dir is on its raylet's command line, and the worker is the raylet's child."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or not (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                continue
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            raylet = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="ignore")
        except OSError:
            continue
        for i in range(3):
            if f"{cluster['dir']}/t{i}/" in raylet or raylet.endswith(f"{cluster['dir']}/t{i}"):
                found.append(i)
    return found


def test_a_worker_nodes_sigterm_checkpoints_and_ray_train_restarts_on_the_nodes_left(cluster):
    """Last in this module: it takes a node away. SIGTERM to a worker node's `ray start` (what
    Kubernetes sends a pod it evicts) drains the node; Ray Train tells the workers it is being
    preempted; they stop after one step with a checkpoint; when the node is gone Ray Train restarts
    them on the nodes left from that checkpoint, and the job finishes: every step and example
    once, no step trained (or logged) twice."""
    import signal

    from trackfiles import tensorboard_events

    results = cluster["tmp"] / "results"
    name = f"node-{uuid.uuid4().hex[:6]}"
    run = results / name
    job, _ = submit(cluster, "python", "jobs/sft.py", "--config", "jobs/configs/tiny_cpu.yaml",
                    f"run.storage_path={results}", f"run.name={name}", "pack.budget=256", "train.report_every_steps=1",
                    "train.checkpoint_every_steps=5", "train.stop_checkpoint_after_s=0", "train.epochs=6",
                    "train.placement_strategy=STRICT_SPREAD", wait=False)
    wait_for(cluster, job, "[raypack] step 6/")
    nodes = [i for i in _node_of_train_workers(cluster) if i > 0]  # a worker node, not the head
    assert nodes, "no Train worker on a worker node"
    pids = (cluster["dir"] / "pids").read_text().split()
    os.kill(int(pids[nodes[0]]), signal.SIGTERM)
    logs = wait_for(cluster, job, "[raypack] a node of this run is being preempted: stopped after step ")
    line = next(x for x in logs.splitlines() if "is being preempted: stopped after step " in x)
    assert "(a checkpoint saved there); Ray Train restarts the workers" in line, line
    stopped = int(line.split("after step ")[1].split()[0])
    assert wait_end(cluster, job, timeout=1200) == "SUCCEEDED", logs_of(cluster, job)[-5000:]
    result = json.loads((run / "raypack_result.json").read_text())
    snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    trained_once(run, result, epochs=6)
    steps = [step for tag, step, _ in tensorboard_events(run / "tensorboard") if tag == "train/loss"]
    assert steps == list(range(1, result["step"] + 1)) and stopped < result["step"], \
        f"stopped after {stopped}: a step logged twice or never"
    assert snapshot["checkpoint_results"][-1]["metrics"]["step"] == result["step"]
