"""Driver-side data preparation: tokenize, hold out eval, plan globally, write per-rank packs.

    tokenized(cfg) ──> split by example_id hash ──> make_plan (lengths only) ──> materialize
                                                                                └─ <root>/train/rank=R/
                                                                                └─ <root>/eval/rank=R/

The plan is `strategies.make_plan(lengths, cfg.pack, ranks, grad_accum)`, the same call `raypack
plan` makes: built for ranks × accum virtual ranks and folded, so every optimizer step sees
ranks × accum packs balanced together. One set of rows serves every epoch (each epoch reads it in
its own order, see shards.py); under `pack.repack_each_epoch` each epoch gets its own plan and rows
under `<root>/train_epoch=E/` instead. The folder carries a fingerprint of everything that shaped
it, so a resumed run or a restarted worker group reuses it instead of re-planning: the config that
shaped it (`packed_key`), and the identity of every source file (`raypack.data.fingerprint`).
Same config but changed sources is an error, never a silent reuse and never a silent re-pack under
a run whose checkpoints index the old packs. What the workers get is a `shards.Prepared` record;
they read their rows with `shards.py` alone.

Two keys, two caches. With `data.cache_path` set, the tokenized examples are kept as Parquet
under `<cache>/tokenized/<tokenized_key>/` and the packed rows under
`<cache>/packed/<packed_key>/`, so runs (and sweep trials) that differ only in the pack config
tokenize once, and those with the same pack config pack once:

    tokenized_key: data (less eval_fraction and cache_path), tokenize (less its speed knobs),
                   the effective max_length (tokenize.max_length or pack.budget)
    packed_key:    tokenized_key, pack, data.eval_fraction, ranks, grad_accum

A cache entry is written into a fresh folder and committed by writing its manifest last, so a
reader never sees a half-written entry and two runs that prepare the same entry at once each
leave a complete one (the last manifest wins). A tokenized entry records its sources' identity
too; one made from sources that have changed since is tokenized again (the packed-level check
above still refuses to repack under an existing run).

Before packing it refuses data that trains on nothing: no example with a label token, or a rank
that would get none (more ranks x grad_accum than examples).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from raypack import storage
from raypack.config import Config, InputError
from raypack.data.encode import load_tokenizer
from raypack.data.fingerprint import changed_sources, sources_fingerprint
from raypack.data.pack import materialize
from raypack.data.plan import Plan
from raypack.data.shards import Prepared, group_steps_for
from raypack.data.sources import ROW_SHIFT
from raypack.data.strategies import make_plan
from raypack.data.tokenize import TokenizeStats, lengths_and_ids, ordered, require_supervised, tokenize_dataset

FORMAT_VERSION = 5  # 4: rows without a label token are dropped; the manifest records the sources
# 5: row groups of whole optimizer steps; epoch orders; per-epoch plans
TOKENIZE_SPEED_KNOBS = ("batch_size", "num_actors", "num_cpus")
"""tokenize fields that change how fast, never what: left out of the keys."""


class SourcesChangedError(InputError):
    """The sources differ from those a run's packed data was made from."""


def _digest(shaped_by: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shaped_by, sort_keys=True).encode()).hexdigest()[:16]


def tokenized_key(cfg: Config) -> str:
    """Hash of everything that shapes the tokenized examples (and nothing that only packs them)."""
    tokenize = {k: v for k, v in dataclasses.asdict(cfg.tokenize).items() if k not in TOKENIZE_SPEED_KNOBS}
    tokenize["max_length"] = cfg.tokenize.max_length or cfg.pack.budget  # what tokenize_dataset uses
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("eval_fraction", "cache_path")}
    return _digest({"version": FORMAT_VERSION, "data": data, "tokenize": tokenize})


def packed_key(cfg: Config, num_ranks: int) -> str:
    """Hash of everything that shapes the packed rows: the tokenized examples, the eval split and the plan."""
    return _digest({
        "version": FORMAT_VERSION,
        "tokenized": tokenized_key(cfg),
        "eval_fraction": cfg.data.eval_fraction,
        "pack": dataclasses.asdict(cfg.pack),
        "ranks": num_ranks,
        "accum": cfg.train.grad_accum,
        # how many per-epoch plans exist; without repacking every epoch reads the same rows
        "epochs": [cfg.train.epochs, cfg.train.max_steps] if cfg.pack.repack_each_epoch else None,
    })


fingerprint = packed_key  # the name checkpoints and Prepared records have always used


def packed_root(cfg: Config, num_ranks: int, run_dir: str) -> str:
    """Where a run's packed rows go: the shared cache when `data.cache_path` is set, else `<run>/packed`."""
    if cfg.data.cache_path:
        return f"{storage.absolute(cfg.data.cache_path)}/packed/{packed_key(cfg, num_ranks)}"
    return f"{run_dir}/packed"


@dataclass
class Tokenized:
    """The tokenized examples, their lengths and ids (in example_id order), and how they came to be."""

    key: str
    """Its `tokenized_key`."""
    ds: Any
    """Materialized Ray Dataset: example_id, input_ids, labels, length."""
    lengths: np.ndarray
    ids: np.ndarray
    stats: dict[str, Any]
    """TokenizeStats' counts (not the lengths)."""
    reused: bool
    """True when read back from `data.cache_path` instead of tokenized now."""
    seconds: float


def tokenized(cfg: Config, vocab_size: int | None = None, sources: dict | None = None) -> Tokenized:
    """Tokenize `cfg`'s data, or read it back from `data.cache_path` when an entry with the same
    `tokenized_key`, made from sources that have not changed since, is there (then nothing is
    tokenized). `vocab_size`: the model's, which bounds the ids of pre-tokenized rows. `sources`:
    the sources' fingerprint, when the caller already has it."""
    t0 = time.perf_counter()
    key = tokenized_key(cfg)
    if sources is None:
        sources = sources_fingerprint(cfg.data.paths)  # before reading: an edit while we read shows next time
    cache = cfg.data.cache_path
    folder = f"{storage.absolute(cache)}/tokenized/{key}" if cache else None
    if folder and storage.exists(f"{folder}/manifest.json"):
        saved = json.loads(storage.read_text(f"{folder}/manifest.json"))
        changes = changed_sources(saved.get("sources", {}), sources)
        if not changes:
            ds = ray.data.read_parquet(saved["data_dir"]).materialize()
            lengths, ids = lengths_and_ids(ds)
            print(f"[raypack] reusing tokenized data in {saved['data_dir']}", flush=True)
            return Tokenized(saved["key"], ds, lengths, ids, saved["stats"], True, time.perf_counter() - t0)
        print(f"[raypack] the sources changed since {folder} was tokenized ({changes[0]}): tokenizing again", flush=True)

    print(f"[raypack] reading and tokenizing {len(sources)} source file(s)", flush=True)
    ds, tok_stats = tokenize_dataset(cfg, vocab_size)
    require_supervised(tok_stats, cfg)
    stats = {k: v for k, v in dataclasses.asdict(tok_stats).items() if k not in ("lengths", "ids")}
    lengths, ids = ordered(tok_stats.lengths, tok_stats.ids)
    print(f"[raypack] {tok_stats.examples_in} examples: {tok_stats.examples_out} rows, {tok_stats.tokens} tokens "
          f"({tok_stats.label_tokens} with loss); dropped {tok_stats.dropped} over {tok_stats.max_length} tokens and "
          f"{tok_stats.no_labels} without a label token, truncated {tok_stats.truncated}, split {tok_stats.split}, "
          f"{tok_stats.bad_rows} bad rows skipped ({time.perf_counter() - t0:.1f} s)", flush=True)
    if folder:
        data_dir = f"{folder}/{uuid.uuid4().hex[:12]}"  # fresh: write_parquet appends, and a reader may hold an older one
        ds.write_parquet(data_dir)
        manifest = {"key": key, "data_dir": data_dir, "stats": stats, "sources": sources,
                    "seconds": time.perf_counter() - t0}
        storage.write_text(f"{folder}/manifest.json", json.dumps(manifest, indent=1))
        print(f"[raypack] tokenized {len(ids)} examples into {data_dir}", flush=True)
    return Tokenized(key, ds, lengths, ids, stats, False, time.perf_counter() - t0)


def is_eval(example_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A stable hash split: the same examples are held out on every run and resume. It hashes the
    source row, not the piece, so the pieces of a split example never straddle train and eval."""
    if fraction <= 0:
        return np.zeros(len(example_ids), dtype=bool)
    rows = example_ids.astype(np.uint64) >> np.uint64(ROW_SHIFT)
    mixed = (rows + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(40)) % np.uint64(10_000) < np.uint64(round(fraction * 10_000))


def held_out_mask(ids: np.ndarray, cfg: Config) -> np.ndarray:
    """Which examples (by example_id) are held out for eval; the rest are what the train plan
    covers (`raypack plan --config` asks this too, so it shows the plan training uses)."""
    held_out = is_eval(ids, cfg.data.eval_fraction, cfg.pack.seed)
    if held_out.all():
        held_out[:] = False  # too few examples to hold any out: train on all, report no eval loss
    return held_out


def _plan_split(ds, lengths, ids, cfg: Config, num_ranks: int, out_dir: str,
                epoch: int = 0) -> tuple[Plan, dict[str, Any], list[int]]:
    accum = cfg.train.grad_accum
    plan = make_plan(lengths, cfg.pack, num_ranks, accum, epoch=epoch)
    stats = plan.stats()
    stats["packing_efficiency"] = stats.pop("efficiency")
    info = materialize(ds, plan, ids, out_dir, group_rows=group_steps_for(cfg.pack.budget, accum) * accum)
    return plan, stats, info["rank_label_tokens"]


def _repacked_epochs(ds, lengths, ids, cfg: Config, num_ranks: int, root: str, first: Plan,
                     first_stats: dict[str, Any]) -> list[dict[str, Any]]:
    """pack.repack_each_epoch: a plan and rows per epoch (epoch 0's are `first`), as many as the
    run's epochs or max_steps can use."""
    accum, t = cfg.train.grad_accum, cfg.train
    epochs = [{"dir": f"{root}/train", "steps_per_rank": int(first.num_steps), "stats": first_stats}]
    steps = first.num_steps // accum
    for e in range(1, t.epochs):
        if t.max_steps and steps >= t.max_steps:
            break
        print(f"[raypack] packing epoch {e + 1}/{t.epochs} (pack.repack_each_epoch)", flush=True)
        plan, stats, _ = _plan_split(ds, lengths, ids, cfg, num_ranks, f"{root}/train_epoch={e}", epoch=e)
        epochs.append({"dir": f"{root}/train_epoch={e}", "steps_per_rank": int(plan.num_steps), "stats": stats})
        steps += plan.num_steps // accum
    return epochs


def reusable(cfg: Config, num_ranks: int, root: str, reprepare: bool = False, sources: dict | None = None) -> Prepared | None:
    """The packed data already in `root` if it was made from this config and these sources;
    None if there is none, or it was made from another config (it is then made again), or
    `reprepare` is set. Same config but changed sources raises SourcesChangedError. Starts no
    Ray work: one listing and stat per source file, a hash of the small ones (or `sources`,
    the fingerprint when the caller already has it)."""
    manifest = f"{storage.absolute(root)}/manifest.json"
    if not storage.exists(manifest):
        return None
    saved = json.loads(storage.read_text(manifest))
    if saved.get("fingerprint") != packed_key(cfg, num_ranks):
        return None
    changes = changed_sources(saved["sources"], sources if sources is not None else sources_fingerprint(cfg.data.paths))
    if not changes:
        return Prepared.from_dict(saved["prepared"])
    if reprepare:
        return None
    more = f" (and {len(changes) - 1} more changes)" if len(changes) > 1 else ""
    raise SourcesChangedError(
        f"data.paths changed since this run's data was prepared in {root}: {changes[0]}{more}. "
        "Start a new run with run.name=NEW_NAME, or re-prepare this one with `raypack train --reprepare`"
    )


def prepare(cfg: Config, num_ranks: int, root: str, *, vocab_size: int | None = None, reprepare: bool = False,
            tok: Tokenized | None = None) -> Prepared:
    """Tokenize, split, plan and pack `cfg`'s data into `root` (a folder or URI every node can
    read; `packed_root` says which), or reuse what is already there (see `reusable`).
    `vocab_size`: the model's, which bounds the ids of pre-tokenized rows. `tok`: `cfg`'s
    tokenized examples, when the caller already has them (a sweep packs several configs from one)."""
    root = storage.absolute(root)
    manifest = f"{root}/manifest.json"
    key = packed_key(cfg, num_ranks)
    sources = sources_fingerprint(cfg.data.paths)  # before reading: an edit while we read shows next time
    found = reusable(cfg, num_ranks, root, reprepare, sources)
    if found is not None:
        print(f"[raypack] reusing packed data in {root}", flush=True)
        return found

    t0 = time.perf_counter()
    if tok is None:
        tok = tokenized(cfg, vocab_size, sources)
    elif tok.key != tokenized_key(cfg):
        raise ValueError("prepare: the tokenized examples passed in were made with another data or tokenize config")
    else:
        require_supervised(TokenizeStats(**tok.stats), cfg)
    ds, lengths, ids = tok.ds, tok.lengths, tok.ids
    # In the shared cache, a fresh folder committed by the manifest (see the module docstring);
    # a run's own packed/ folder is rewritten in place, as only that run uses it.
    out = f"{root}/{uuid.uuid4().hex[:12]}" if cfg.data.cache_path else root
    held_out = held_out_mask(ids, cfg)
    held_ids = np.sort(ids[held_out])

    def keep(batch, want_eval: bool):
        # pyarrow in and out: the numpy format would turn the token lists into tensor columns.
        mask = np.isin(batch["example_id"].to_numpy(), held_ids, assume_unique=True) == want_eval
        return batch.filter(mask)

    train_ds = ds.map_batches(keep, fn_kwargs={"want_eval": False}, batch_format="pyarrow") if len(held_ids) else ds
    train_plan, stats, rank_labels = _plan_split(train_ds, lengths[~held_out], ids[~held_out], cfg, num_ranks, f"{out}/train")
    if train_plan.num_steps < cfg.train.grad_accum:
        raise InputError(f"data.paths: {len(lengths)} examples make no full optimizer step for {num_ranks} ranks")
    idle = [r for r, n in enumerate(rank_labels) if n == 0]
    if idle:
        # Its gradients would be zeros averaged into every step: not wrong, but not what was asked.
        raise InputError(
            f"data.paths: rank {idle[0]} of {num_ranks} gets no label token to train on "
            f"({int((~held_out).sum())} training examples for {num_ranks} ranks x {cfg.train.grad_accum} "
            "micro-batches); add data or lower train.num_workers or train.grad_accum"
        )
    eval_dir = None
    if len(held_ids):
        # Eval packs with one exact strategy whatever trains: whole examples, positions reset
        # (pad for padded runs, whose model attends with a padding mask), so eval loss compares
        # across strategies in a sweep.
        eval_pack = dataclasses.replace(cfg.pack, strategy="pad" if train_plan.padded else "bfd", repack_each_epoch=False)
        eval_cfg = dataclasses.replace(cfg, pack=eval_pack, train=dataclasses.replace(cfg.train, grad_accum=1))
        eval_ds = ds.map_batches(keep, fn_kwargs={"want_eval": True}, batch_format="pyarrow")
        _plan_split(eval_ds, lengths[held_out], ids[held_out], eval_cfg, num_ranks, f"{out}/eval")
        eval_dir = f"{out}/eval"

    tokenizer = load_tokenizer(cfg.tokenize.tokenizer, cfg.tokenize.chat_template)
    trained = lengths[~held_out].astype(np.float64)
    prepared = Prepared(
        root=root,
        fingerprint=key,
        train_dir=f"{out}/train",
        eval_dir=eval_dir,
        steps_per_rank=int(train_plan.num_steps),
        padded=bool(train_plan.padded),
        pad_token_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id),
        vocab_size=len(tokenizer),
        length_mean=float(trained.mean()) if len(trained) else 0.0,
        length_sq_mean=float((trained**2).mean()) if len(trained) else 0.0,
        grad_accum=cfg.train.grad_accum,
        group_steps=group_steps_for(cfg.pack.budget, cfg.train.grad_accum),
        order_seed=cfg.pack.seed,
        epochs=(_repacked_epochs(train_ds, lengths[~held_out], ids[~held_out], cfg, num_ranks, out, train_plan, stats)
                if cfg.pack.repack_each_epoch else []),
        stats={
            **tok.stats,
            **stats,
            "tokenize_reused": tok.reused,
            "tokenize_s": tok.seconds,
            "prepare_s": time.perf_counter() - t0,
            "train_examples": int((~held_out).sum()),
            "eval_examples": int(held_out.sum()),
        },
    )
    storage.write_text(manifest, json.dumps({"fingerprint": key, "sources": sources, "prepared": prepared.to_dict()}, indent=1))
    print(f"[raypack] packed {prepared.steps_per_rank} steps x {num_ranks} ranks with {cfg.pack.strategy} "
          f"(efficiency {stats['packing_efficiency']:.3f}) in {root} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return prepared
