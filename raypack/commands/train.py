"""`raypack train`: fine-tune one run, or continue a stopped one.

    raypack train --config FILE [overrides]     # a run named run.name under run.storage_path
    raypack train --resume RUN_DIR [overrides]  # the config that run saved, then the overrides

The config is saved as `<run>/raypack_config.yaml` before training, which is what --resume reads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from raypack import storage
from raypack.config import Config, ConfigError, dumps, load, loads
from raypack.runtime import run_dir
from raypack.train.trainer import fit

SAVED_CONFIG = "raypack_config.yaml"


def resume_config(path: str, overrides: Sequence[str] = ()) -> Config:
    """The config a stopped run was started with, for --resume."""
    saved = f"{path.rstrip('/')}/{SAVED_CONFIG}"
    if not storage.exists(saved):
        raise ConfigError(f"--resume {path}: no {SAVED_CONFIG} there; is it a raypack run folder?")
    return loads(storage.read_text(saved), overrides, saved)


def run(args: argparse.Namespace) -> int:
    cfg = resume_config(args.resume, args.overrides) if args.resume else load(args.config, args.overrides)
    root = run_dir(cfg)
    if not args.resume and storage.exists(f"{root}/checkpoint_manager_snapshot.json"):
        print(f"[raypack] run {cfg.run.name!r} exists in {root}: continuing from its last checkpoint "
              "(set run.name to start a fresh run)")
    storage.write_text(f"{root}/{SAVED_CONFIG}", dumps(cfg))
    result = fit(cfg)
    metrics = result.metrics or {}
    print("\n[raypack] training finished", file=sys.stderr)
    for key in ("step", "loss", "eval_loss", "tokens_per_s", "packing_efficiency", "peak_memory_gb"):
        if metrics.get(key) is not None:
            value = metrics[key]
            print(f"  {key:<20} {value:.4f}" if isinstance(value, float) else f"  {key:<20} {value}")
    print(f"  results             {result.path}")
    if result.checkpoint:
        print(f"  checkpoint          {result.checkpoint.path}  (Hugging Face model in model/)")
    if cfg.train.tensorboard and not storage.is_uri(root):
        print(f"  tensorboard         tensorboard --logdir {root}/tensorboard")
    return 0 if result.error is None else 1
