"""`raypack data --config FILE [overrides]`: read and tokenize the configured data, print a summary."""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.data.tokenize import require_supervised, tokenize_dataset
from raypack.runtime import init_ray
from raypack.train.preflight import check_data


def run(args: argparse.Namespace) -> int:
    checked = check_data(load(args.config, args.overrides))  # paths, formats, tokenizer, small data's rows
    cfg = checked.cfg
    init_ray()
    _, stats = tokenize_dataset(cfg, checked.sources)
    print(stats.summary())
    require_supervised(stats, cfg)  # after the summary, which says where the examples went
    return 0
