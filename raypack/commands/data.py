"""`raypack data --config FILE [overrides]`: read and tokenize the configured data, print a summary."""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.data.tokenize import tokenize_dataset
from raypack.runtime import init_ray


def run(args: argparse.Namespace) -> int:
    cfg = load(args.config, args.overrides)
    init_ray()
    _, stats = tokenize_dataset(cfg)
    print(stats.summary())
    return 0
