"""`raypack sweep --config FILE [overrides]` or `raypack sweep --resume EXPERIMENT_DIR`: run or
continue the Tune sweep, print its table, say where the files are.

The sweep's folder, and with it every trial's run folder under it, is this command's while it runs
(raypack/runlock.py): a second `raypack sweep` on it, or a `raypack train --resume` of one of its
trials, is refused with one line naming the owner."""

from __future__ import annotations

import argparse
import sys

from raypack import runlock
from raypack.config import load
from raypack.errors import ConfigError
from raypack.runs import SWEEP_CONFIG, absolute_paths, run_dir, saved_config
from raypack.tune.sweep import format_table, sweep

INTERRUPTED = 130
"""Exit status of an interrupted sweep (as for a shell command stopped by Ctrl-C)."""


def run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.overrides:
            raise ConfigError("--resume continues a sweep with the config it was started with; drop the overrides")
        cfg = saved_config(args.resume, file=SWEEP_CONFIG, what="sweep")
    else:
        cfg = load(args.config, args.overrides)
    with runlock.hold(run_dir(absolute_paths(cfg)), f"sweep {cfg.run.name!r}", "sweep"):
        outcome = sweep(cfg, resume=bool(args.resume))  # checks the config and its inputs before Ray starts
    print("\n" + format_table(outcome.rows, outcome.context))
    print(f"[raypack] sweep results in {outcome.directory}/: {', '.join(outcome.files)}", file=sys.stderr)
    if outcome.interrupted:
        print(f"[raypack] the sweep was interrupted; continue it with: raypack sweep --resume {outcome.directory}",
              file=sys.stderr)
        return INTERRUPTED
    return 0 if all(r["status"] in ("OK", "STOPPED") for r in outcome.rows) else 1
