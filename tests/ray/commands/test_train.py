"""`raypack train` end to end on a local Ray cluster: what the screen shows, what a finished run
says when run again, and data that trains on nothing refused before training starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from raypack.cli import main

import trackfiles
from checkpoints import as_user
from paths import REPO
from trackfiles import history, tensorboard_scalars

pytestmark = pytest.mark.ray


def test_data_without_an_assistant_turn_fails_before_training(ray_local, tmp_path, capsys, monkeypatch):
    import raypack.train.trainer

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(raypack.train.trainer, "TorchTrainer", no_training)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"}]}) + "\n" for i in range(8)))
    code = main(["train", f"run.storage_path={tmp_path / 'runs'}", "run.name=r", f"data.paths=[{path}]"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"nothing to train on: of 8 examples, 8 had no token that carries loss (first: {path} line 1)" in err
    assert not (tmp_path / "runs" / "r").exists(), "a failed start left a run folder behind"


NOT_OURS_ALLOWED = (
    # Ray's core worker in the driver, for the tokenize stage's actor (raypack/console.py says why
    # this one can't be routed); Ray Data's progress bars are not drawn off a terminal.
    "has constructor arguments in the object store",
)


def test_a_run_prints_its_own_lines_once_resumes_from_another_folder_and_then_says_it_is_complete(tmp_path):
    """As a user runs it: the quickstart's config from a folder outside the repository (its bundled
    assets are found wherever raypack is installed), stopped at step 2, with W&B offline; the screen
    holds raypack's lines and at most the known Ray line, uncoloured, and the W&B run holds what
    TensorBoard holds. `--resume` from yet another folder, by a relative path, continues it to step
    4; then the same command and a plain `--resume` say the run is complete without starting Ray."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)  # its own local Ray instance
    first_dir, other_dir = tmp_path / "first", tmp_path / "other"
    first_dir.mkdir()
    other_dir.mkdir()
    name = f"screen-{uuid.uuid4().hex[:6]}"
    base = [sys.executable, "-m", "raypack.cli", "train"]
    cmd = [*base, "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml"),
           f"run.storage_path={tmp_path / 'results'}", f"run.name={name}", "pack.budget=256",
           "train.max_steps=2", "train.report_every_steps=1", "train.checkpoint_every_steps=0", "run.wandb.mode=offline",
           *as_user()]
    out = subprocess.run(cmd, cwd=first_dir, env={k: v for k, v in env.items() if not k.startswith("WANDB_")},
                         capture_output=True, text=True, timeout=900)
    screen = out.stdout + out.stderr
    assert out.returncode == 0, screen[-5000:]
    assert "[raypack] started a local Ray instance (listening on 127.0.0.1" in out.stdout
    for step in (1, 2):
        assert screen.count(f"[raypack] step {step}/2 epoch 1/2 ") == 1, screen[-5000:]  # once, not once per stream
    finished = out.stdout.split("[raypack] training finished\n")[1]  # heading and values on one stream
    assert finished.startswith("  step                 2\n") and "  checkpoint " in finished
    summary = finished.splitlines()
    not_ours = [line for line in screen.replace(finished, "").splitlines()
                if line.strip() and not line.startswith("[raypack] ")]
    assert all(any(known in line for known in NOT_OURS_ALLOWED) for line in not_ours), "\n".join(not_ours)
    assert len(not_ours) <= len(NOT_OURS_ALLOWED), "\n".join(not_ours)
    assert "\x1b[" not in screen, "colour codes off a terminal"

    run = tmp_path / "results" / name
    (sync,) = [line.split("wandb sync ")[1] for line in summary if line.startswith("  wandb ")]
    (run_file,) = Path(sync).glob("run-*.wandb")
    tensorboard = tensorboard_scalars(run / "tensorboard")
    wandb = {}
    for row in history(run_file):
        for key, value in row.items():
            if key.startswith("train/"):
                wandb.setdefault(key, {})[row["_step"]] = value
    assert set(wandb) == set(tensorboard) and {"train/loss", "train/tokens_per_s", "train/packing_efficiency"} <= set(wandb)
    for key, steps in tensorboard.items():
        assert wandb[key] == pytest.approx(steps, rel=1e-6), key
    assert trackfiles.config(run_file)["train"]["lr"] == 3.0e-3  # the resolved config, once

    from transformers import AutoTokenizer

    checkpoint = finished.split("  checkpoint ")[1].split()[0]
    assert AutoTokenizer.from_pretrained(f"{checkpoint}/model").chat_template  # the exported model is usable

    resume = [*base, "--resume", f"../results/{name}"]
    more = subprocess.run([*resume, "train.max_steps=4"], cwd=other_dir, env=env, capture_output=True, text=True,
                          timeout=900)
    screen = more.stdout + more.stderr
    assert more.returncode == 0, screen[-5000:]
    assert f"run '{name}' exists in {tmp_path / 'results' / name}: continuing from its last checkpoint" in more.stdout
    assert "[raypack] step 2/4" not in screen and screen.count("[raypack] step 4/4 ") == 1, screen[-5000:]
    assert not list(other_dir.iterdir()), "the resume wrote into the working folder"
    last = more.stdout.split("[raypack] training finished\n")[1]
    assert last.startswith("  step                 4\n")
    # the resume went on in the same W&B run: a second segment of it, synced together
    wandb_id = (run / "raypack_wandb_id").read_text()
    segments = sorted((run / "wandb" / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and all(s.name.endswith(f"-{wandb_id}") for s in segments), segments
    assert f"  wandb                wandb sync {run}/wandb/wandb/offline-run-*" in last

    for again_cmd, cwd in ((resume, other_dir), (cmd, first_dir)):
        again = subprocess.run(again_cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "is complete (4 steps); nothing to train" in again.stdout, again.stdout[-2000:]
        assert "started a local Ray instance" not in again.stdout  # it knew without starting Ray


def _join_session_ray(ray_local) -> dict:
    """The environment of a `raypack` subprocess that joins the session's Ray instance (its ray.init
    costs seconds), as `ray job submit` joins a cluster; raypack still takes it for a local one."""
    from raypack.runtime import LOOPBACK_ONLY

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["RAY_ADDRESS"] = ray_local.get_runtime_context().gcs_address  # 127.0.0.1:<port>
    env[LOOPBACK_ONLY] = "0"  # else Ray swaps 127.0.0.1 for the host's address, where the instance doesn't listen
    return env


def _train_until(cmd: list[str], env: dict, cwd: Path, step: int):
    """Start `cmd` and read its screen until the progress line of `step`; (process, lines so far)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    screen = []
    for line in proc.stdout:  # ends when the process does: no timeout decides the test
        screen.append(line)
        if f"[raypack] step {step}/" in line:
            break
    assert proc.poll() is None, "".join(screen)[-3000:]
    return proc, screen


# DeepSpeed's under -m slow (67 s before it changed size; 367 s with its three sizes at load 10-20): its
# stop and resume are the Ctrl-C test's, its export test_export's, and its refusal to resume on another
# worker count (fp32) is checked after the Ctrl-C below
# LoRA on FSDP2's sharded base under -m slow too: its base checksum checked at each change of size
@pytest.mark.parametrize("engine", [pytest.param([], marks=pytest.mark.slow),
                                    ["train.engine=torch", "train.zero_stage=3"],
                                    pytest.param(["train.engine=torch", "train.zero_stage=3", "model.peft.method=lora",
                                                  "model.peft.r=4", "train.lr=1e-2"], marks=pytest.mark.slow)],
                         ids=["deepspeed", "torch-fsdp3", "torch-fsdp3-lora"])
def test_sigterm_mid_epoch_checkpoints_exits_143_and_the_resume_trains_every_example_once(ray_local, tmp_path, engine,
                                                                                          capsys):
    """SIGTERM (a pod evicted, `ray job stop`, Slurm, kill) to the driver in the middle of an epoch:
    the workers stop after one step, save a checkpoint there and register it, the command prints
    one line with the resume command and exits 143, leaving no unregistered checkpoint and no
    result file (the run isn't finished). `--resume` then trains the rest of the epoch: every step
    once in the final model's step logs and in TensorBoard, every example once, and the curve
    goes on from where it stopped (the learning rate on its schedule, the loss not back at its start).
    On either engine (the torch engine's FSDP2 resharding: its shards and schedule come back). Then
    `raypack export` of the last checkpoint is the final model/ bit for bit, and `raypack chat` on
    the export answers as transformers' generate does (folded in here: a full fine-tune on each
    engine, which the export tests' runs are not).

    The torch engine's run also changes size (issue 62): stopped on 2 workers, it goes on with 3
    (4 packs a step don't divide over 3: one line says a step now trains 6), is stopped again in
    the middle of the epoch's rest, and finishes on 1 (grad_accum 2 -> 6: the 3 workers' step
    size). Its DCP state reshards both times; the epoch still trains every example once, and the
    result's trained totals are the data's. DeepSpeed's run (ZeRO-2, bf16) changes size the same way:
    its ZeRO partitions are converted to DeepSpeed's universal checkpoint (one line, the folder kept
    beside ds/) and cut again for 3 workers, then for 1. LoRA on FSDP2's sharded base changes size
    too: each resume checks the base it loaded against the checkpoint's checksum of it, which no
    sharding changes (adapters.frozen_sum)."""
    import signal
    import time

    from raypack.config import load

    from trackfiles import tensorboard_events
    from trained import planned_label_tokens, planned_train_ids, trained_ids

    name = f"sigterm-{uuid.uuid4().hex[:6]}"
    root = tmp_path / "results" / name
    overrides = [f"run.storage_path={tmp_path / 'results'}", f"run.name={name}", "pack.budget=256",
                 "train.report_every_steps=1", "train.checkpoint_every_steps=4", "train.stop_checkpoint_after_s=0",
                 *as_user(), *engine]
    config = str(REPO / "jobs" / "configs" / "tiny_cpu.yaml")
    cmd = [sys.executable, "-m", "raypack.cli", "train", "--config", config, *overrides]
    proc, screen = _train_until(cmd, _join_session_ray(ray_local), tmp_path, step=6)
    proc.send_signal(signal.SIGTERM)
    t0 = time.perf_counter()
    rest = proc.stdout.read()
    code = proc.wait()
    waited = time.perf_counter() - t0
    assert rest.strip(), f"exit {code} with nothing after the signal: " + "".join(screen)[-3000:]
    last = rest.strip().splitlines()[-1]
    assert code == 143, rest[-3000:]
    assert last.startswith("[raypack] stopped by SIGTERM after step ") and last.endswith(
        f" (a checkpoint saved there); continue it with: raypack train --resume {root}"), rest[-3000:]
    assert "Traceback" not in rest and "SIGTERM received" not in rest, rest[-3000:]
    assert waited < 25, f"took {waited:.0f} s to stop (train.stop_grace_s is 25)"
    stopped = int(last.split("after step ")[1].split()[0])
    snapshot = json.loads((root / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"]
    assert snapshot[-1]["metrics"]["step"] == stopped, snapshot
    # Folders are named by the time they were saved; one newer than the last registered would be
    # half-written. (Older ones may still be there: Ray deletes those past keep_checkpoints a moment later.)
    names = sorted(p.name for p in root.glob("checkpoint_*") if p.is_dir())
    assert names[-1] == snapshot[-1]["checkpoint_dir_name"], names
    assert not (root / "raypack_result.json").exists()
    epoch = int(next(line for line in screen if "[raypack] step 6/" in line).split("/")[1].split()[0])
    assert stopped < epoch // 2, "the stop came too late to test a resume mid-epoch"

    # on 3 workers, stopped again in the middle of the epoch's rest
    resume = [sys.executable, "-m", "raypack.cli", "train", "--resume", str(root), "train.num_workers=3"]
    proc, screen = _train_until(resume, _join_session_ray(ray_local), tmp_path, step=stopped + 3)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait() == 143, rest[-3000:]
    shown = "".join(screen)
    assert ("[raypack] resuming on 3 workers, the checkpoint's 2: an optimizer step now trains 6 packs instead "
            "of 4 (4 packs don't divide over 3 ranks), with train.grad_accum 2;") in shown, shown[-3000:]
    assert f"examples trained by step {stopped}; the other " in shown, shown[-3000:]
    if not engine:  # DeepSpeed: its ZeRO-2 partitions converted for 3 (ds/ as it was: test_universal.py)
        assert (f"[raypack] step {stopped}'s DeepSpeed ZeRO state, partitioned for 2 workers, converted for 3 "
                "(DeepSpeed's universal checkpoint, in ") in shown, shown[-3000:]
    # (DeepSpeed's 3 workers may log after raypack's last line as they exit)
    said = [line for line in rest.splitlines() if line.startswith("[raypack] stopped by SIGTERM after step ")]
    assert len(said) == 1 and "Traceback" not in rest, rest[-3000:]
    stopped = int(said[0].split("after step ")[1].split()[0])
    capsys.readouterr()
    assert main(["train", "--resume", str(root), "train.num_workers=1"]) == 0
    shown = capsys.readouterr().out
    assert ("[raypack] resuming on 1 worker, the checkpoint's 3: train.grad_accum 2 -> 6, so an optimizer step "
            "still trains 6 packs") in shown, shown[-3000:]
    if not engine:
        assert "partitioned for 3 workers, converted for 1" in shown, shown[-3000:]
    cfg = load(config, overrides)
    result = json.loads((root / "raypack_result.json").read_text())
    ids, steps = trained_ids(Path(result["checkpoint"]))
    # the steps are the ones the three sizes took, one after another, each once
    epoch = result["step"]
    assert sorted(set(s for rank in steps for s in rank)) == list(range(1, epoch + 1)), steps
    assert len(ids) == len(set(ids)) and sorted(ids) == planned_train_ids(cfg), "an example trained twice or never"
    assert result["trained"] == {"examples": len(ids), "label_tokens": planned_label_tokens(cfg),
                                 "epochs": [{"examples": len(ids), "label_tokens": planned_label_tokens(cfg)}]}
    logged = {}
    for tag, step, value in tensorboard_events(root / "tensorboard"):
        logged.setdefault(tag, []).append((step, value))
    assert [s for s, _ in logged["train/loss"]] == list(range(1, epoch + 1)), "a step logged twice or not at all"
    assert all(len({s for s, _ in v}) == len(v) for v in logged.values()), "a value logged twice at one step"
    loss = dict(logged["train/loss"])
    lr = dict(logged["train/lr"])
    # cosine decay after 2 warmup steps: the resumed schedule goes on, it does not start over (a
    # resize recomputes its total steps, which may move the curve a little, never back to the top)
    assert lr[stopped + 1] < lr[3], lr
    assert abs(loss[stopped + 1] - loss[stopped]) < 0.5 * (loss[1] - loss[stopped]), loss

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from answers import greedy

    capsys.readouterr()
    assert main(["export", str(root), "--out", str(tmp_path / "export")]) == 0, capsys.readouterr().err
    final = Path(result["checkpoint"]) / "model"
    ours, theirs = (load_file(f / "model.safetensors") for f in (tmp_path / "export" / "model", final))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    capsys.readouterr()
    assert main(["chat", str(tmp_path / "export"), "--prompt", "hello", "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    model = AutoModelForCausalLM.from_pretrained(final, dtype="auto")
    assert capsys.readouterr().out == greedy(model, final) + "\n"


def test_ctrl_c_in_training_exits_130_with_one_line_and_the_resume_continues(ray_local, tmp_path):
    """Ctrl-C (SIGINT) once training reported a checkpoint: the workers stop after their step,
    the command exits 130 within seconds with one line saying how to continue and no traceback;
    `--resume` then goes on from the last registered checkpoint, and a checkpoint folder the run
    saved but never registered is removed. (A resume on another worker count: the SIGTERM test;
    the DeepSpeed states raypack can't reshard are refused in one line: tests/unit/train/test_resize.py.)"""
    import signal
    import time

    root = tmp_path / "results" / "interrupted"
    cmd = [sys.executable, "-m", "raypack.cli", "train", "--config", str(REPO / "jobs" / "configs" / "tiny_cpu.yaml"),
           f"run.storage_path={tmp_path / 'results'}", "run.name=interrupted", "pack.budget=256",
           "train.report_every_steps=1", "train.checkpoint_every_steps=2", "train.epochs=3", *as_user()]
    env = _join_session_ray(ray_local)
    proc, _ = _train_until(cmd, env, tmp_path, step=4)
    proc.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    rest = proc.stdout.read()
    code = proc.wait()
    waited = time.perf_counter() - t0
    tail = rest.strip().splitlines()
    assert code == 130, rest[-3000:]
    assert tail[-1].startswith("[raypack] interrupted after step "), rest[-3000:]
    assert tail[-1].endswith(f"; continue it with: raypack train --resume {root}"), rest[-3000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-3000:]
    assert waited < 30, f"took {waited:.0f} s to stop"

    orphan = root / "checkpoint_2000-01-01_00-00-00.000000"  # as if saved when the signal came, never registered
    orphan.mkdir()
    out = subprocess.run([sys.executable, "-m", "raypack.cli", "train", "--resume", str(root), "train.max_steps=8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"[raypack] removed {orphan}: saved as the run stopped, never registered" in out.stdout
    assert not orphan.exists()
    assert "continuing from its last checkpoint" in out.stdout


@pytest.mark.slow
def test_quickstart_on_tiny_qwen3_moe_logs_the_router_loss_and_the_expert_heatmap(ray_local, tmp_path, capsys):
    """`raypack train --config jobs/configs/quickstart.yaml model.name=tiny-qwen3_moe`, cut to 5
    steps: the router loss (auto: Qwen3-MoE's own coefficient) at every step, the per-layer expert
    load and the layers-by-experts heatmap at the report, all in TensorBoard's event file; the
    summary names the worst layer."""
    code = main(["train", "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml"), *as_user("tiny-qwen3_moe"),
                 f"run.storage_path={tmp_path}", "run.name=moe", "train.max_steps=5", "data.eval_fraction=0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "expert_load_worst_layer" in out and "router_aux_loss" in out  # the summary (workers' lines go to Ray's logs)
    board = tmp_path / "moe" / "tensorboard"
    scalars = tensorboard_scalars(board)
    assert sorted(scalars["train/router_aux_loss"]) == [1, 2, 3, 4, 5]
    assert all(1.0 < v < 4.0 for v in scalars["train/router_aux_loss"].values())  # top-2: 2 when even
    assert 1.0 <= scalars["train/expert_load/layer_0"][5] <= 4.0 and 5 in scalars["train/expert_load/layer_1"]
    height, width, png = trackfiles.tensorboard_images(board)["train/expert_load"][5]
    assert (height, width) == (2 * 8, 4 * 8) and png.startswith(b"\x89PNG")


def test_a_second_run_on_one_name_is_refused_and_a_killed_runs_lock_is_taken_over_by_its_resume(
        ray_local, tmp_path, capsys):
    """Two `raypack train` on one run name at once: the second exits 2 with one line naming the
    first (pid, host, start) and writes nothing; the first trains on. Killed outright (SIGKILL: no
    handler of its runs), the first leaves its lock behind, and `--resume` takes it over with one
    line saying so and trains the epoch to its end, every step once."""
    import signal
    import socket
    import time

    from trained import trained_ids

    name = f"twice-{uuid.uuid4().hex[:6]}"
    root = tmp_path / "results" / name
    cmd = [sys.executable, "-m", "raypack.cli", "train", "--config", str(REPO / "jobs" / "configs" / "tiny_cpu.yaml"),
           f"run.storage_path={tmp_path / 'results'}", f"run.name={name}", "pack.budget=256",
           "train.report_every_steps=1", "train.checkpoint_every_steps=2", *as_user()]
    env = _join_session_ray(ray_local)
    first, screen = _train_until(cmd, env, tmp_path, step=3)
    first.send_signal(signal.SIGSTOP)  # alive, holding its lock, however fast its workers train on
    try:
        # In this process, whose imports are done: it meets the lock while the first one trains
        second = main(cmd[3:])
        out, err = capsys.readouterr()
        assert second == 2 and out == "" and err.count("\n") == 1, out + err
        assert err.startswith(f"raypack: error: run '{name}' in {root} is in use by raypack train (pid {first.pid} on "
                              f"host {socket.gethostname()}, started 20"), err
        assert first.poll() is None, "the first run stopped"
        assert len(list((root / "tensorboard").iterdir())) == 1, "the second run wrote TensorBoard events"
        deadline = time.time() + 120
        while not (root / "checkpoint_manager_snapshot.json").exists():  # the controller registers them
            assert time.time() < deadline, "no checkpoint registered"
            time.sleep(0.5)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert json.loads((root / "raypack_lock.json").read_text())["pid"] == first.pid
    epoch = int(next(line for line in screen if "[raypack] step 3/" in line).split("/")[1].split()[0])

    assert main(["train", "--resume", str(root)]) == 0
    out = capsys.readouterr().out
    assert (f"[raypack] run '{name}': took over the lock raypack train (pid {first.pid} on host {socket.gethostname()}, "
            f"started ") in out and f" left in {root}: that process is gone\n" in out, out[-3000:]
    assert "continuing from its last checkpoint" in out
    assert not (root / "raypack_lock.json").exists()
    result = json.loads((root / "raypack_result.json").read_text())
    assert result["step"] == epoch
    _, steps = trained_ids(Path(result["checkpoint"]))
    assert steps == [list(range(1, epoch + 1))] * 2, "a step trained twice or never"
