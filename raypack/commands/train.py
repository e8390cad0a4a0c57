"""`raypack train`: fine-tune one run, or continue a stopped one.

    raypack train --config FILE [overrides]     # a run named run.name under run.storage_path
    raypack train --resume RUN_DIR [overrides]  # the config that run saved, then the overrides
    raypack train ... --reprepare               # pack changed sources again (a run with no checkpoint yet)

Every input is checked before Ray starts (raypack/train/preflight.py). The config is saved as
`<run>/raypack_config.yaml` once the data is prepared, just before training, with its paths made
absolute, and never overwritten: a rerun with another config is refused (use --resume, whose
overrides apply to that invocation only). `--resume RUN_DIR` works from any working folder. A
failed start leaves no run folder behind; a finished run, run again, says so.
"""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.runs import saved_config
from raypack.train.trainer import Outcome, start


def run(args: argparse.Namespace) -> int:
    cfg = saved_config(args.resume, args.overrides) if args.resume else load(args.config, args.overrides)
    outcome = start(cfg, resume=bool(args.resume), reprepare=args.reprepare)
    if not outcome.complete_before:
        print("\n[raypack] training finished")
    print_summary(outcome)
    return 0


def print_summary(outcome: Outcome) -> None:
    for key, value in outcome.metrics.items():
        if value is not None:
            print(f"  {key:<20} {value:.4f}" if isinstance(value, float) else f"  {key:<20} {value}")
    print(f"  {'results':<20} {outcome.root}")
    if outcome.checkpoint:
        print(f"  {'checkpoint':<20} {outcome.checkpoint}  (Hugging Face model and tokenizer in model/)")
    if outcome.tensorboard:
        print(f"  {'tensorboard':<20} tensorboard --logdir {outcome.tensorboard}")
