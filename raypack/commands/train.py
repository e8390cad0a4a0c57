"""`raypack train`: fine-tune one run, or continue a stopped one.

    raypack train --config FILE [overrides]     # a run named run.name under run.storage_path
    raypack train --resume RUN_DIR [overrides]  # the config that run saved, then the overrides
    raypack train ... --reprepare               # pack changed sources again (a run with no checkpoint yet)

Every input is checked before Ray starts (raypack/train/preflight.py). The config is saved as
`<run>/raypack_config.yaml` once the data is prepared, just before training, and never
overwritten: a rerun with another config is refused (use --resume, whose overrides apply to that
invocation only). A failed start leaves no run folder behind; a finished run, run again, says so.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from raypack import storage
from raypack.config import Config, ConfigError, dumps, load, loads
from raypack.runtime import init_ray, run_dir
from raypack.train.preflight import Checked, preflight

SAVED_CONFIG = "raypack_config.yaml"
RESULT = "raypack_result.json"
"""Written when training finishes: the last step and metrics, and where the checkpoint is."""
SUMMARY = ("step", "loss", "eval_loss", "tokens_per_s", "packing_efficiency", "peak_memory_gb")


def resume_config(path: str, overrides: Sequence[str] = ()) -> Config:
    """The config a stopped run was started with, for --resume."""
    saved = f"{path.rstrip('/')}/{SAVED_CONFIG}"
    if not storage.exists(saved):
        raise ConfigError(f"--resume {path}: no {SAVED_CONFIG} there; is it a raypack run folder?")
    return loads(storage.read_text(saved), overrides, saved)


def check_same_config(cfg: Config, root: str) -> str | None:
    """The run's saved config text, if it has one; a ConfigError if `cfg` differs from it."""
    path = f"{root}/{SAVED_CONFIG}"
    if not storage.exists(path):
        return None
    text = storage.read_text(path)
    saved = loads(text, (), path).to_dict()
    new = cfg.to_dict()
    diff = [f"{s}.{k}: {saved[s][k]!r} there, {new[s][k]!r} here" for s in new for k in new[s] if saved[s][k] != new[s][k]]
    if diff:
        raise ConfigError(
            f"run {cfg.run.name!r} in {root} was started with another config ({diff[0]}"
            + (f", and {len(diff) - 1} more" if len(diff) > 1 else "")
            + f"); continue it with `raypack train --resume {root}` (overrides allowed), or start a new run with run.name=NEW_NAME"
        )
    return text


def finished(root: str, cfg: Config, checked: Checked) -> dict | None:
    """The run's saved result if it already took every step this config asks for."""
    if checked.prepared is None or not storage.exists(f"{root}/{RESULT}"):
        return None
    result = json.loads(storage.read_text(f"{root}/{RESULT}"))
    total = checked.prepared.total_steps(cfg.train.grad_accum, cfg.train.epochs, cfg.train.max_steps)
    return result if result.get("step", 0) >= total else None


def print_summary(metrics: dict, path: str, checkpoint: str | None, tensorboard: str | None) -> None:
    for key in SUMMARY:
        if metrics.get(key) is not None:
            value = metrics[key]
            print(f"  {key:<20} {value:.4f}" if isinstance(value, float) else f"  {key:<20} {value}")
    print(f"  {'results':<20} {path}")
    if checkpoint:
        print(f"  {'checkpoint':<20} {checkpoint}  (Hugging Face model and tokenizer in model/)")
    if tensorboard:
        print(f"  {'tensorboard':<20} tensorboard --logdir {tensorboard}")


def run(args: argparse.Namespace) -> int:
    cfg = resume_config(args.resume, args.overrides) if args.resume else load(args.config, args.overrides)
    root = run_dir(cfg)
    saved = None if args.resume else check_same_config(cfg, root)
    has_checkpoint = storage.exists(f"{root}/checkpoint_manager_snapshot.json")
    if args.reprepare and has_checkpoint:
        raise ConfigError(
            f"--reprepare: run {cfg.run.name!r} in {root} has checkpoints taken on its packed data, which a resume "
            "on new packs would mix up; start a new run with run.name=NEW_NAME"
        )
    checked = preflight(cfg, reprepare=args.reprepare)
    tensorboard = f"{root}/tensorboard" if cfg.train.tensorboard and not storage.is_uri(root) else None
    if done := finished(root, cfg, checked):
        print(f"[raypack] run {cfg.run.name!r} is complete ({done['step']} steps); nothing to train. "
              f"Start a new run with run.name=NEW_NAME, or train on with --resume {root} train.epochs=N")
        print_summary(done["metrics"], root, done.get("checkpoint"), tensorboard)
        return 0
    if has_checkpoint:
        print(f"[raypack] run {cfg.run.name!r} exists in {root}: continuing from its last checkpoint", flush=True)

    from raypack.train.trainer import build_trainer, fit_trainer  # Ray Train: once the input is known good

    fresh = not storage.exists(root)
    init_ray()
    try:
        trainer = build_trainer(cfg, checked=checked, reprepare=args.reprepare)
    except BaseException:
        if fresh:  # a start that failed leaves nothing that looks like a run
            storage.remove_dir(root)
        raise
    if saved is None and not storage.exists(f"{root}/{SAVED_CONFIG}"):
        storage.write_text(f"{root}/{SAVED_CONFIG}", dumps(cfg))
    result = fit_trainer(trainer)
    metrics = dict(result.metrics or {})
    checkpoint = result.checkpoint.path if result.checkpoint else None
    storage.write_text(f"{root}/{RESULT}", json.dumps(
        {"step": metrics.get("step", 0), "metrics": {k: metrics.get(k) for k in SUMMARY}, "checkpoint": checkpoint}, indent=1))
    print("\n[raypack] training finished")
    print_summary(metrics, result.path, checkpoint, tensorboard)
    return 0
