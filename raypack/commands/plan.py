"""`raypack plan`: dry-run the packing strategies on a lengths file or a configured dataset.

    raypack plan (--config FILE | --lengths FILE.npy) --budget N --ranks R [--strategy NAME ...]
                 [--seed S] [--json] [--out PLAN.parquet]

Prints one row per strategy (packs, steps, efficiency, padding fraction, token and attention
imbalance, planning seconds; see raypack/data/stats.py for the definitions). `--out` writes the
first strategy's assignment as Parquet, one row per example (per piece for wrapped): example_id
(index into the lengths), pack, rank, step, start, end.

It plans every example over `--ranks` ranks. A training run first holds out `data.eval_fraction`
and plans over ranks x `train.grad_accum` virtual ranks (raypack/data/prepare.py), so its step
count differs by those factors; efficiency and balance carry over.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from raypack.config import ConfigError, PackConfig, load
from raypack.data.strategies import STRATEGIES, make_plan

COLUMNS = ("strategy", "packs", "steps", "efficiency", "padding_fraction", "token_imbalance",
           "attention_imbalance", "seconds")


def _lengths_from_config(args: argparse.Namespace) -> np.ndarray:
    """Tokenize the configured data; lengths ordered by example_id, as the pack stage orders them."""
    # Imported here, not at the top: these two take 3.1 s to import on 2 cores (Ray Data and the
    # tokenizer stack), which a dry run over a --lengths file, 0.2 s in all, never needs.
    from raypack.data.tokenize import lengths_and_ids, require_supervised, tokenize_dataset
    from raypack.runtime import absolute_paths, init_ray
    from raypack.train.preflight import check_data

    cfg = absolute_paths(load(args.config, args.overrides))
    check_data(cfg)  # before Ray starts
    init_ray()
    cfg = replace(cfg, pack=replace(cfg.pack, budget=args.budget))
    ds, stats = tokenize_dataset(cfg)
    require_supervised(stats, cfg)
    lengths, _ = lengths_and_ids(ds)
    return lengths


def run(args: argparse.Namespace) -> int:
    names = args.strategy or list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategy: expected names from {', '.join(STRATEGIES)}, got {unknown[0]!r}")
    lengths = np.load(args.lengths) if args.lengths else _lengths_from_config(args)
    rows = []
    for i, name in enumerate(names):
        cfg = PackConfig(strategy=name, budget=args.budget, batch_size=args.batch_size, seed=args.seed)
        plan = make_plan(lengths, cfg, args.ranks)
        stats = plan.stats()
        rows.append({k: stats[k] for k in COLUMNS})
        if i == 0 and args.out:
            plan.write_parquet(args.out)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{len(lengths)} examples, {int(np.sum(lengths))} tokens, budget {args.budget}, {args.ranks} ranks")
    header = f"{'strategy':<16}{'packs':>10}{'steps':>10}{'effic.':>9}{'padding':>9}{'tok.imb':>9}{'attn.imb':>9}{'seconds':>9}"
    print(header)
    for r in rows:
        print(f"{r['strategy']:<16}{r['packs']:>10}{r['steps']:>10}{r['efficiency']:>9.4f}{r['padding_fraction']:>9.4f}"
              f"{r['token_imbalance']:>9.4f}{r['attention_imbalance']:>9.4f}{r['seconds']:>9.3f}")
    if args.out:
        print(f"wrote the {names[0]} assignment to {args.out}")
    return 0
