"""`raypack data --config FILE [overrides]`: read and tokenize the configured data, print a summary.

Data of up to `data.driver_max_mb` is read and tokenized in this process, as `raypack train`
prepares it (raypack/data/cache.py), without starting Ray: the bundled 300 rows in about a second,
where Ray Data's read tasks and tokenizer actors took 43-61 s to start on 2 cores. Larger data
goes through Ray Data, in parallel across the cluster; either way no rows are kept (counts only).
`--show N` prints the first N examples instead, as the model sees them (raypack/data/show.py).
"""

from __future__ import annotations

import argparse

from raypack.config import load
from raypack.errors import InputError
from raypack.data.listing import source_bytes
from raypack.data.tokenize import on_driver, require_supervised, tokenize_dataset, tokenize_here
from raypack.train.preflight import check_data


def run(args: argparse.Namespace) -> int:
    show = getattr(args, "show", None)
    if getattr(args, "json", False) and show is None:
        raise InputError("--json goes with --show N: it prints those examples as JSON lines")
    if show is not None and show < 1:
        raise InputError(f"--show {show}: the number of examples to print, at least 1")
    checked = check_data(load(args.config, args.overrides))  # paths, formats, tokenizer, small data's rows
    cfg = checked.cfg
    if show is not None:  # what the model sees, from the first rows only: no pass over the rest
        from raypack.data.encode import load_tokenizer
        from raypack.data.show import first_examples, write

        write(first_examples(cfg, checked.sources, show), load_tokenizer(cfg.tokenize.tokenizer, cfg.tokenize.chat_template),
              args.json)
        return 0
    if on_driver(cfg, source_bytes(checked.sources)):
        stats = tokenize_here(cfg, checked.sources, "")
    else:
        from raypack.runtime import init_ray

        init_ray()
        _, stats = tokenize_dataset(cfg, checked.sources, out_dir="")
    print(stats.summary())
    require_supervised(stats, cfg)  # after the summary, which says where the examples went
    return 0
