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

from raypack import storage
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
        print(f"  {'checkpoint':<20} {outcome.checkpoint}  ({_holds(outcome.checkpoint)})")
    if outcome.tensorboard:
        print(f"  {'tensorboard':<20} tensorboard --logdir {outcome.tensorboard}")


def _holds(checkpoint: str) -> str:
    """What the final checkpoint offers to load (a LoRA run: the adapter, and the merged model unless merge: false)."""
    fs, path = storage.resolve(checkpoint)
    has = {name for name in ("adapter", "model", "base") if fs.get_file_info(f"{path}/{name}").type == storage.pafs.FileType.Directory}
    parts = []
    if "adapter" in has:
        on = "base/" if "base" in has else "the base model"
        parts.append(f"peft adapter in adapter/: PeftModel.from_pretrained(<{on}>, adapter/)")
    if "model" in has:
        parts.append(("merged " if "adapter" in has else "") + "Hugging Face model and tokenizer in model/")
    return "; ".join(parts) or "DeepSpeed state only"
