"""`raypack data --config FILE [overrides]`: read and tokenize the configured data, print a summary.

Data of up to `data.driver_max_mb` is read and tokenized in this process, as `raypack train`
prepares it (raypack/data/cache.py), without starting Ray: the bundled 300 rows in about a second,
where Ray Data's read tasks and tokenizer actors took 43-61 s to start on 2 cores. Larger data
goes through Ray Data, in parallel across the cluster; either way no rows are kept (counts only).
"""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.data.listing import source_bytes
from raypack.data.tokenize import on_driver, require_supervised, tokenize_dataset, tokenize_here
from raypack.train.preflight import check_data


def run(args: argparse.Namespace) -> int:
    checked = check_data(load(args.config, args.overrides))  # paths, formats, tokenizer, small data's rows
    cfg = checked.cfg
    if on_driver(cfg, source_bytes(checked.sources)):
        stats = tokenize_here(cfg, checked.sources, "")
    else:
        from raypack.runtime import init_ray

        init_ray()
        _, stats = tokenize_dataset(cfg, checked.sources, out_dir="")
    print(stats.summary())
    require_supervised(stats, cfg)  # after the summary, which says where the examples went
    return 0
