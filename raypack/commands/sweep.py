"""`raypack sweep --config FILE [overrides]`: run the Tune sweep, print its table, say where the files are."""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.runtime import run_dir
from raypack.train.preflight import preflight
from raypack.tune.sweep import CSV, PLOT, TABLE, format_table, sweep


def run(args: argparse.Namespace) -> int:
    cfg = load(args.config, args.overrides)
    preflight(cfg)  # the base config's data, tokenizer and model, before Ray starts
    rows = sweep(cfg)
    print("\n" + format_table(rows))
    print(f"[raypack] sweep results in {run_dir(cfg)}/: {TABLE}, {CSV}, {PLOT}")
    return 0 if all(r["status"] == "OK" for r in rows) else 1
