"""`raypack plan`: dry-run the packing plan a run would train, on its data or on a lengths file.

    raypack plan --config FILE [overrides]                 # the configured data, tokenized
    raypack plan --lengths FILE.npy [--config FILE] [overrides]   # what-if over given lengths
                 [--strategy NAME ... | --strategy all] [--json] [--out PLAN.parquet]

The config and dotted overrides are every other command's (`pack.budget=4096 train.num_workers=64`);
the plan is `strategies.make_plan(lengths, cfg.pack, train.num_workers, train.grad_accum)` over
`prepare.training_examples`, the calls data preparation makes (tokenized, or read back from
`data.cache_path`, and `data.eval_fraction` held out exactly as training does), so the printed
plan is the plan training uses; a mixture (`data.sources`) is drawn as training draws it, and a line
per source says what it contributes (examples, label tokens, shares). --lengths plans every given length
(no eval hold-out). --strategy compares other strategies under the same config (default: the
configured `pack.strategy`).

One row per strategy: packs, micro-steps per rank, optimizer steps per epoch, real tokens per
optimizer step, efficiency, padding fraction, and the wall-time overhead of imbalance for tokens
and attention (Σ busiest rank / Σ mean rank over steps) with the worst single step; see
raypack/data/stats.py. `--out` writes the first strategy's assignment as Parquet, one row per
example (per piece for wrapped): example_id, pack, rank, step, start, end.

Image data on a VLM: a line says how `balanced` weighs each example's vision-tower work (its
patches and patches², by the tower's FLOPs over the language model's: raypack/data/tower.py), and
one more gives, per strategy, the tower's imbalance, that of all the step's FLOPs and the widest
micro-batch in patches (also in --json, with the image counts), which the memory line sizes the
tower's activations for.

With --config, a line estimates the memory per GPU of the configured run (full fine-tuning,
LoRA or QLoRA; ZeRO stage, gradient checkpointing, budget): raypack/train/memory/estimate.py's arithmetic
on the model's config, no weights loaded; and a last one names the model's rows in the
supported-models table (raypack/model/families.py, docs/reference/models.md), or says it has none. With --lengths only a model config found without the
network counts (tiny-*, a local folder, the Hugging Face cache); otherwise the line is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq

from raypack.config import Config, load
from raypack.data.strategies import STRATEGIES, check_strategy_name, make_plan
from raypack.data.tower import tower_extra, tower_stats
from raypack.errors import ConfigError, InputError

COLUMNS = ("strategy", "packs", "steps", "optimizer_steps", "tokens_per_optimizer_step", "efficiency",
           "padding_fraction", "token_imbalance", "attention_imbalance", "token_imbalance_worst",
           "attention_imbalance_worst", "split_padding", "seconds")
"""split_padding: the share of a row's tokens that pads it to a multiple of train.sequence_parallel."""


def _from_config(cfg: Config) -> tuple[np.ndarray, np.ndarray, dict, np.ndarray | None, list[dict]]:
    """Lengths and example ids of the examples a training run plans over (eval held out, a
    mixture's draw made), the tokenize counts of all of them, for image data their vision-tower
    work (patches, Σ patches²), and what each source of a mixture contributes."""
    # Imported here, not at the top: these take 3 s to import on 2 cores (Ray Data and the
    # tokenizer stack), which a dry run over a --lengths file, 0.2 s in all, never needs.
    from raypack.data.cache import tokenized
    from raypack.data.mixture import split
    from raypack.runtime import init_ray
    from raypack.train.preflight import check_data

    checked = check_data(cfg)  # before Ray starts
    init_ray()
    tok = tokenized(checked.cfg, checked.sources)
    parts = split(tok, checked.cfg, checked.sources)  # what prepare.training_examples gives
    tower = None if tok.tower is None else tok.tower[parts.take]
    return tok.lengths[parts.take], tok.ids[parts.take], tok.stats, tower, parts.figures(tok)


def _load_lengths(path: str) -> np.ndarray:
    try:
        lengths = np.load(path)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"--lengths {path}: not a readable .npy file ({e})") from None
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ConfigError(f"--lengths {path}: expected a 1-d integer array, got {lengths.dtype} of shape {lengths.shape}")
    return lengths


def run(args: argparse.Namespace) -> int:
    cfg = load(args.config, args.overrides)
    names = args.strategy or [cfg.pack.strategy]
    # --lengths holds example lengths; a DPO config's own data holds (chosen, rejected) pairs
    pairs = cfg.train.objective == "dpo" and not args.lengths
    if names == ["all"]:
        names = [n for n, s in STRATEGIES.items() if not (pairs and s.splits_examples)]
    for name in names:
        if "=" in name:  # --strategy takes every word after it
            raise ConfigError(f"--strategy {name}: looks like a dotted override; put overrides before --strategy")
        check_strategy_name(name, "--strategy")
    counts: dict = {}
    work, figures = None, []
    if args.lengths:
        lengths = _load_lengths(args.lengths)
        ids = np.arange(len(lengths), dtype=np.int64)
    else:
        # With --json, stdout holds the JSON alone: the progress lines of preparing go to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            lengths, ids, counts, work, figures = _from_config(cfg)
    ranks, split, accum = cfg.train.data_parallel, cfg.train.sequence_parallel, cfg.train.grad_accum
    tower = _tower_cost(cfg) if work is not None else None
    extra = tower_extra(work, tower)
    rows, padded, patches = [], None, None
    for i, name in enumerate(names):
        pack = cfg.pack if name == cfg.pack.strategy else _with_strategy(cfg, name)
        plan = make_plan(lengths, pack, ranks, accum, pairs=pairs, extra=extra)
        padded = padded or plan.widest_padded()  # the first strategy's: the memory line's
        stats = plan.stats()
        optimizer_steps = plan.num_steps // accum
        stats["optimizer_steps"] = optimizer_steps
        tokens = plan.pack_tokens()
        stats["tokens_per_optimizer_step"] = float(tokens.sum()) / max(optimizer_steps, 1)
        stats["split_padding"] = float((-tokens % split).sum() / max((tokens + -tokens % split).sum(), 1))
        rows.append({k: stats[k] for k in COLUMNS})
        if figures:
            rows[-1]["sources"] = figures
        if counts.get("images"):
            rows[-1].update({k: counts[k] for k in IMAGE_COLUMNS})
            if tower is not None:
                rows[-1].update(tower_stats(plan, tower, work, lengths))
                patches = patches if patches is not None else rows[-1]["widest_patches"]
        if i == 0 and args.out:
            table = plan.to_table()
            pq.write_table(table.set_column(0, "example_id", [ids[plan.example]]), args.out)
    if args.json:
        print(json.dumps(rows))
        return 0
    counted = f"{len(lengths) // 2} pairs ({len(lengths)} sequences)" if pairs else f"{len(lengths)} examples"
    print(f"{counted}, {int(np.sum(lengths))} tokens, budget {cfg.pack.budget}, {ranks} ranks x "
          f"{accum} micro-steps per optimizer step, {cfg.train.epochs} epoch(s)"
          + (", a new plan per epoch" if cfg.pack.repack_each_epoch else ", a new step order per epoch"))
    if figures:
        from raypack.data.mixture import lines

        print("\n".join(lines(figures, cfg.data.examples_per_epoch)))
    if counts.get("images"):
        print(image_line(counts, tower))
    if split > 1:
        print(f"sequence parallel: {ranks} groups of {split} workers ({cfg.train.num_workers} in all), each row's "
              f"tokens split {split} ways: at most {-(-cfg.pack.budget // split)} tokens a worker; rows padded to a "
              f"multiple of {split}: {rows[0]['split_padding']:.4%} padding ({names[0]})")
    header = (f"{'strategy':<16}{'packs':>9}{'steps':>8}{'opt.steps':>10}{'tok/opt.step':>13}{'effic.':>8}"
              f"{'padding':>8}{'tok.imb':>8}{'attn.imb':>9}{'worst tok/attn':>15}{'seconds':>8}")
    print(header)
    for r in rows:
        worst = f"{r['token_imbalance_worst']:.2f}/{r['attention_imbalance_worst']:.2f}"
        print(f"{r['strategy']:<16}{r['packs']:>9}{r['steps']:>8}{r['optimizer_steps']:>10}"
              f"{r['tokens_per_optimizer_step']:>13,.0f}{r['efficiency']:>8.4f}{r['padding_fraction']:>8.4f}"
              f"{r['token_imbalance']:>8.4f}{r['attention_imbalance']:>9.4f}{worst:>15}{r['seconds']:>8.2f}")
    if tower is not None:
        print("vision tower (its FLOPs; all = the language model's and the tower's together): " + ", ".join(
            f"{r['strategy']} tower.imb {r['tower_imbalance']:.4f} (worst step {r['tower_imbalance_worst']:.2f}), "
            f"all.imb {r['work_imbalance']:.4f}, widest micro-batch {r['widest_patches']} patches" for r in rows))
    print("imbalance = wall-time overhead: sum over steps of the busiest rank / of the mean rank (1.0 = none)")
    if args.config:
        for line in (memory_line(cfg, offline=bool(args.lengths), padded=padded, patches=patches),
                     model_line(cfg, offline=bool(args.lengths))):
            if line:
                print(line)
    if args.out:
        print(f"wrote the {names[0]} assignment to {args.out}")
    return 0


IMAGE_COLUMNS = ("images", "image_tokens", "vision_patches")
"""With image data, in every --json row: the data's (eval included) images, their tokens and the
vision tower's patches (tokenize's counts, raypack/data/tokenize.py); where the model's tower is
known, data.tower.tower_stats' figures too."""


def image_line(counts: dict, tower=None) -> str:
    """What images the plan's lengths hold: their tokens are in every example's length, so in the
    tokens, the efficiency and both imbalance figures (Σ tokens and Σ len² per rank); and how
    `balanced` weighs the vision tower's patches (data/tower.py), where the model's tower is known."""
    share = counts["image_tokens"] / max(counts["tokens"], 1)
    weighed = (f"balanced weighs each patch as {tower.linear_weight:.3g} token(s) and each image's patches² as "
               f"{tower.attention_weight:.3g} length², the tower's FLOPs against the language model's"
               if tower is not None else "the model's vision tower is not known here, so its patches are not weighed")
    return (f"images: {counts['images']} in the data (eval included), {counts['image_tokens']} image tokens "
            f"({share:.1%} of its {counts['tokens']} tokens), counted in each example's length and so in every "
            f"figure below; the vision tower's {counts['vision_patches']} patches: {weighed}")


def _tower_cost(cfg: Config):
    """The configured model's vision tower cost (memory.tower_cost), or None where its config
    can't be had or it has no tower the arithmetic knows (the plan then weighs no patches)."""
    from raypack.model.build import model_config  # torch and transformers: seconds, so only now
    from raypack.train.memory.estimate import tower_cost

    try:
        return tower_cost(model_config(cfg.model.name, cfg.model.trust_remote_code), cfg.model.trust_remote_code)
    except (InputError, ValueError, AttributeError, OSError):
        return None


def _with_strategy(cfg: Config, name: str):
    # repack_each_epoch is a per-strategy choice; the comparison shows each strategy's epoch-1 plan.
    return replace(cfg.pack, strategy=name, repack_each_epoch=False)


def memory_line(cfg: Config, offline: bool, padded: tuple[int, int] | None = None,
                patches: int | None = None) -> str | None:
    """"memory per GPU (estimate): ..." for `cfg`'s run. `offline`: only from a model config found
    without the network, and None (no line) where there is none; otherwise a model config that
    can't be had makes an "n/a" line, never an error (the plan itself doesn't need the model).
    `padded`: the plan's widest padded batch (Plan.widest_padded), by which a hybrid's mixers are
    sized (an upper bound of the length buckets they run: raypack/model/mixer_buckets.py);
    `patches`: the most patches a micro-batch of the plan runs through a VLM's vision tower."""
    m, prefix = cfg.model, "memory per GPU (estimate): "
    name = _local_model(m.name)
    if name is None and offline:
        return None
    from raypack.model.build import model_config  # torch and transformers: seconds, so only now
    from raypack.train.memory.estimate import Arch, summary

    try:
        config = model_config(name or m.name, m.trust_remote_code)
        arch = Arch.from_config(config, m.trust_remote_code)
        tower = ("; a VLM's vision tower not counted" if getattr(config, "vision_config", None) is not None
                 and arch.tower is None else "")  # fmt: skip
        return prefix + summary(cfg, arch, padded, patches) + tower
    except (InputError, ValueError, AttributeError) as e:  # no config, or a shape the arithmetic doesn't know
        return None if offline else f"{prefix}n/a ({str(e).splitlines()[0] if str(e) else type(e).__name__})"


def model_line(cfg: Config, offline: bool) -> str | None:
    """The configured model's rows in the supported-models table (raypack/model/families.py, the
    table the family tests run and docs/reference/models.md shows), found as memory_line finds
    its config; None where there is none to be had offline."""
    name = _local_model(cfg.model.name)
    if name is None and offline:
        return None
    from raypack.model.build import model_config
    from raypack.model.families import describe

    try:
        return describe(model_config(name or cfg.model.name, cfg.model.trust_remote_code))
    except (InputError, ValueError, OSError) as e:
        return None if offline else f"supported models: n/a ({str(e).splitlines()[0] if str(e) else type(e).__name__})"


def _local_model(name: str) -> str | None:
    """`name`, or the folder holding its cached config, where loading it needs no network."""
    from pathlib import Path

    from huggingface_hub import try_to_load_from_cache

    if name.startswith("tiny-") or Path(name).expanduser().is_dir():
        return name
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repo id either
        return None
    return str(Path(cached).parent) if isinstance(cached, str) else None
