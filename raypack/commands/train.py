"""`raypack train`: fine-tune one run, or continue a stopped one.

    raypack train --config FILE [overrides]     # a run named run.name under run.storage_path
    raypack train --resume RUN_DIR [overrides]  # the config that run saved, then the overrides
    raypack train ... --reprepare               # pack changed sources again (a run with no checkpoint yet)

Every input is checked before Ray starts (raypack/train/preflight.py). The config is saved as
`<run>/raypack_config.yaml` once the data is prepared, just before training, with its paths made
absolute, and never overwritten: a rerun with another config is refused (use --resume, which
takes no --config and only the overrides a rerun may change, runs.RERUN_FIELDS, for that
invocation). `--resume RUN_DIR` works from any working folder. A
failed start leaves no run folder behind; a finished run, run again, says so. SIGTERM (a pod
evicted, `ray job stop`, Slurm, `kill`) and Ctrl-C stop the workers after their step, with a
checkpoint, within train.stop_grace_s (raypack/train/stop.py); a second one, or one before
training, stops at once. Either way the run keeps every checkpoint it registered and none it
didn't, and the command prints one line saying how to go on and exits 128 + the signal (143, 130).

One command at a time trains a run: it holds the run folder's lock (raypack/runlock.py) from
before its inputs are checked until it ends, and a second `raypack train` on the same folder (or
on a trial's folder while its sweep runs) is refused with one line naming the owner's host, pid
and start; a lock a killed run left behind is taken over, with a line saying so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from raypack import runlock, runs, storage
from raypack.config import Config, load
from raypack.errors import ConfigError
from raypack.runs import SAVED_CONFIG, absolute_paths, check_rerun, run_dir, saved_config
from raypack.train.resize import check_resizable, keep_step_size, last_position
from raypack.train.startup import describe
from raypack.train.stop import resumes, signal_of, stopped_by
from raypack.train.tracking import offline_runs
from raypack.train.trainer import Outcome, start


def run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config:
            raise ConfigError(f"--resume {args.resume} continues the run with the config it saved ({SAVED_CONFIG} "
                              f"there), not --config {args.config}; drop --config, or start a new run with "
                              "--config and run.name=NEW_NAME")
        check_rerun(args.overrides, args.resume)
    cfg = saved_config(args.resume, args.overrides) if args.resume else load(args.config, args.overrides)
    root = run_dir(absolute_paths(cfg))
    if args.resume:  # on another worker count than its checkpoint's: a step keeps its size where it can
        accum_given = any(o.startswith("train.grad_accum=") for o in args.overrides)
        position = last_position(root)
        check_resizable(cfg, position)  # state that can't be resharded: refused before anything runs
        cfg, line = keep_step_size(cfg, position, accum_given)
        if line:
            print(line, flush=True)
    fresh = not storage.exists(root)
    # The run's folder is this command's until it ends: a second one on it is refused (raypack/runlock.py)
    with runlock.hold(root, f"run {cfg.run.name!r}", "train", guards=runs.sweep_of(root)):
        return train(args, cfg, root, fresh)


def train(args: argparse.Namespace, cfg: Config, root: str, fresh: bool) -> int:
    try:
        outcome = start(cfg, resume=bool(args.resume), reprepare=args.reprepare)
    except KeyboardInterrupt as e:
        return interrupted(root, fresh, signal_of(e))
    except Exception:
        free_name(root, fresh)
        raise
    if outcome.stopped:
        return stopped(outcome, fresh)
    if not outcome.complete_before:
        print("\n[raypack] training finished")
    print_summary(outcome)
    return 0


def print_summary(outcome: Outcome) -> None:
    rows = [(key, f"{value:.4f}" if isinstance(value, float) else str(value))
            for key, value in outcome.metrics.items() if value is not None and key != "trained"]
    if trained := outcome.metrics.get("trained"):
        per = trained["epochs"]
        rows.append(("trained", f"{trained['examples']} examples, {trained['label_tokens']} label tokens"
                     + (" (" + "; ".join(f"epoch {e + 1}: {p['examples']}, {p['label_tokens']}" for e, p in enumerate(per))
                        + ")" if len(per) > 1 else "")))
    if outcome.startup:
        rows.append(("start-up", describe(outcome.startup)))
    rows.append(("results", outcome.root))
    if outcome.checkpoint:
        rows.append(("checkpoint", f"{outcome.checkpoint}  ({_holds(outcome.checkpoint)})"))
    tracking = outcome.tracking
    if tracking.tensorboard_dir:
        rows.append(("tensorboard", tensorboard_command(tracking.tensorboard_dir)))
    if tracking.wandb and tracking.wandb["mode"] == "offline" and (offline := offline_runs(outcome.root)):
        # each start (a resume) writes its own segment of the one W&B run: sync them all
        shown = offline[0] if len(offline) == 1 else offline[0].parent / "offline-run-*"
        rows.append(("wandb", f"wandb sync {shown}"))
    elif tracking.wandb:
        w = tracking.wandb
        rows.append(("wandb", f"project {w['entity'] + '/' if w['entity'] else ''}{w['project']}, run {w['id']}"))
    width = max(20, *(len(key) for key, _ in rows))  # DPO's eval_rewards/accuracies is 23 long
    for key, text in rows:
        print(f"  {key:<{width}} {text}")


def tensorboard_command(logdir: str) -> str:
    """What shows `logdir` from the user's shell: `tensorboard` where it is on PATH, else the one
    installed beside this raypack's Python (`.venv/bin/tensorboard` after `make run`, whose venv
    is not on PATH), else how to install it."""
    beside = Path(sys.executable).parent / "tensorboard"  # not resolved: a venv's python is a link
    if shutil.which("tensorboard"):
        program = "tensorboard"
    elif beside.is_file():
        program = os.path.relpath(beside) if beside.absolute().is_relative_to(Path.cwd()) else str(beside)
    else:
        return f"pip install tensorboard, then: tensorboard --logdir {logdir}"
    return f"{program} --logdir {logdir}"


def _holds(checkpoint: str) -> str:
    """What the final checkpoint offers to load (a LoRA run: the adapter, and the merged model unless merge: false)."""
    has = set(storage.list_dirs(checkpoint))
    parts = []
    if "adapter" in has:
        on = "base/" if "base" in has else "the base model"
        parts.append(f"peft adapter in adapter/: PeftModel.from_pretrained(<{on}>, adapter/)")
    if "model" in has:
        parts.append(("merged " if "adapter" in has else "") + "Hugging Face model and tokenizer in model/")
    return "; ".join(parts) or "DeepSpeed state only"


def stopped(outcome: Outcome, fresh: bool) -> int:
    """The workers stopped after a step, as a signal asked: say where, and how to go on. A run
    this command started that registered no checkpoint leaves nothing, as `interrupted` says."""
    s, root = outcome.stopped, outcome.root
    signum = signal.Signals[s["signal"]]
    if not runs.has_checkpoint(root):
        free_name(root, fresh)
        then = "no checkpoint was registered; run the same command again"
    else:
        then = f"continue it with: raypack train --resume {root}"
    print(f"[raypack] {stopped_by(signum)} after step {s['step']} ({resumes(s['step'], s['resume_from'])}); {then}",
          file=sys.stderr, flush=True)
    return 128 + signum


def interrupted(root: str, fresh: bool, signum: int = signal.SIGINT) -> int:
    """Stop the workers now, keep what the run registered, say how to go on; the exit status. A
    run this command started that registered no checkpoint leaves nothing, so its name stays free."""
    import ray

    # Disconnecting ends the Train controller this driver owns, and with it the workers (a local
    # instance ends whole), so nothing writes into the run folder after this.
    ray.shutdown()
    for orphan in runs.orphan_checkpoints(root):  # being written as it stopped: never registered
        storage.remove_dir(orphan)
    if runs.has_checkpoint(root):
        then = f"continue it with: raypack train --resume {root}"
    else:
        then = "no checkpoint was registered; run the same command again"
    free_name(root, fresh)
    print(f"\n[raypack] {stopped_by(signum)}; {then}", file=sys.stderr, flush=True)
    return 128 + signum


def free_name(root: str, fresh: bool) -> None:
    """A run this command started that stopped before its first checkpoint leaves nothing behind,
    so the same command can run again. Here, not in `start`: a sweep trial's folder stays (Tune reads it)."""
    if fresh and not runs.has_checkpoint(root):
        storage.remove_dir(root)
