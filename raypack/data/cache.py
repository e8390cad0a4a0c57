"""What shaped the prepared data, and where it is kept: the keys, the caches and their manifests.

Two keys, two caches. With `data.cache_path` set, the tokenized examples are kept as Parquet
under `<cache>/tokenized/<tokenized_key>/` and the packed rows under `<cache>/packed/<packed_key>/`,
so runs (and sweep trials) that differ only in the pack config tokenize once, and those with the
same pack config pack once; without it, a run's packed rows are `<run>/packed/`:

    tokenized_key: data (less the eval split and cache_path), tokenize (less its speed knobs),
                   the effective max_length (Config.max_length)
    packed_key:    tokenized_key, pack, the eval split (data.eval_fraction, eval_max_examples),
                   ranks, grad_accum, and a mixture's draw (each source's weight and name,
                   data.examples_per_epoch): a changed weight packs again from the same tokens

Both hash the config's canonical values (`Config.to_dict()`: every value in its field's type),
never its text, so a saved config that reloads (a float written `8` comes back as `8.0`) keys the
same data. A checkpoint records the packed key of the data its position indexes (`fingerprint`).

A cache entry is written into a fresh folder and committed by writing its manifest last, so a
reader never sees a half-written entry and two runs that prepare the same entry at once each leave
a complete one (the last manifest wins). Every manifest records its sources' identity
(raypack/data/fingerprint.py): a tokenized entry made from sources that have changed since is
tokenized again; a packed folder of the same config but changed sources is an error
(`SourcesChangedError`), never a silent reuse and never a silent re-pack under a run whose
checkpoints index the old packs.
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
import pyarrow as pa
import pyarrow.dataset as pads

from raypack import storage
from raypack.config import Config
from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.data.encode import template_text
from raypack.data.fingerprint import changed_sources, recorded
from raypack.data.listing import Sources, source_bytes
from raypack.data.shards import Prepared
from raypack.data.tokenize import (TokenizeStats, on_driver, ordered, require_supervised, tokenize_dataset,
                                   tokenize_here)
from raypack.data.tower import grid_work
from raypack.errors import InputError

FORMAT_VERSION = 7  # 7: vision rows (images, image_grid_thw columns); 4: rows without a label token are dropped; the manifest records the sources
# 5: row groups of whole optimizer steps; epoch orders; per-epoch plans
# 6: keys hash canonical typed values; tokenize counts carry the pad id and tokenizer size
TOKENIZE_SPEED_KNOBS = ("batch_size", "num_actors", "num_cpus")
"""tokenize fields that change how fast, never what: left out of the keys."""
DATA_NOT_SHAPING = ("eval_fraction", "eval_max_examples", "cache_path", "max_dropped_fraction", "driver_max_mb")
"""data fields that shape no tokenized row (the split is the packed key's, the rest are where and
whether): left out of the tokenized key, so that setting them never re-tokenizes or blocks a resume."""
MIXTURE_DRAW = ("examples_per_epoch",)
"""data fields (with each source's weight and name) that choose which tokenized rows an epoch
draws: the packed key's, not the tokenized key's, so a changed weight packs again from the same
tokenized rows."""
MANIFEST = "manifest.json"


class SourcesChangedError(InputError):
    """The sources differ from those a run's packed data was made from."""


def _digest(shaped_by: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shaped_by, sort_keys=True).encode()).hexdigest()[:16]


def tokenized_key(cfg: Config) -> str:
    """Hash of everything that shapes the tokenized examples (and nothing that only packs them)."""
    plain = cfg.to_dict()
    tokenize = {k: v for k, v in plain["tokenize"].items() if k not in TOKENIZE_SPEED_KNOBS}
    tokenize["max_length"] = cfg.max_length
    if cfg.tokenize.empty_answers == "train":  # the default keys as every config did before the field existed
        del tokenize["empty_answers"]
    if cfg.tokenize.chat_template is not None:  # a .jinja file keys by its text, which may change
        tokenize["chat_template"] = template_text(cfg.tokenize.chat_template)
    data = {k: v for k, v in plain["data"].items() if k not in DATA_NOT_SHAPING + MIXTURE_DRAW}
    if cfg.data.sources:  # what reads each source's rows; the draw (weights, names) is the packed key's
        data["sources"] = [{k: v for k, v in s.items() if k in ("paths", "format", "columns")} for s in data["sources"]]
    else:  # the one-source form keys as it did before data.sources existed
        del data["sources"]
    # Which images are bad rows: a limit other than the default keys otherwise; the default keys as
    # every config did before the field existed, so their cache entries and runs' packed data stand.
    if cfg.data.max_image_pixels == MAX_IMAGE_PIXELS:
        del data["max_image_pixels"]
    return _digest({"version": FORMAT_VERSION, "data": data, "tokenize": tokenize})


def packed_key(cfg: Config, num_ranks: int, tower=None) -> str:
    """Hash of everything that shapes the packed rows: the tokenized examples, the eval split and the
    plan, whose balance weighs a VLM's patches by `tower` (a data.tower.TowerCost) where given."""
    plain = cfg.to_dict()
    # No cap (what every run before data.eval_max_examples had) keys as it did then.
    capped = {"eval_max_examples": cfg.data.eval_max_examples} if cfg.data.eval_max_examples is not None else {}
    return _digest({
        "version": FORMAT_VERSION,
        "tokenized": tokenized_key(cfg),
        "eval_fraction": plain["data"]["eval_fraction"],
        **capped,
        "pack": plain["pack"],
        "ranks": num_ranks,
        "accum": cfg.train.grad_accum,
        # how many per-epoch plans exist; without repacking every epoch reads the same rows
        "epochs": [cfg.train.epochs, cfg.train.max_steps] if cfg.pack.repack_each_epoch else None,
        # only for a VLM's run: other runs key as they did before the tower was weighed
        **({"tower": tower.key()} if tower is not None else {}),
        # only for a mixture: which examples an epoch draws, and what the figures call each source
        **({"mixture": {"sources": [{k: s[k] for k in ("weight", "name")} for s in plain["data"]["sources"]],
                        "examples_per_epoch": plain["data"]["examples_per_epoch"]}} if cfg.data.sources else {}),
    })


def packed_root(cfg: Config, num_ranks: int, run_dir: str) -> str:
    """Where a run's packed rows go: the shared cache when `data.cache_path` is set, else `<run>/packed`."""
    if cfg.data.cache_path:
        return f"{storage.absolute(cfg.data.cache_path)}/packed/{packed_key(cfg, num_ranks)}"
    return f"{run_dir}/packed"


def commit(folder: str, manifest: dict[str, Any]) -> None:
    """Write an entry's manifest, last: from now on readers see the entry."""
    storage.write_text(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1))


def read_manifest(folder: str) -> dict[str, Any] | None:
    path = f"{folder}/{MANIFEST}"
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def fresh_folder(root: str) -> str:
    """A new folder under `root` for one entry's data: `write_parquet` appends, and a reader may
    still hold an older entry."""
    return f"{root}/{uuid.uuid4().hex[:12]}"


# --- tokenized examples --------------------------------------------------------------------------


@dataclass
class Tokenized:
    """The tokenized examples, their lengths and ids (in example_id order), and how they came to be."""

    key: str
    """Its `tokenized_key`."""
    data_dir: str | None
    """The folder of its rows' Parquet files (example_id, input_ids, labels, length), which the
    pack stage reads; None when they were not kept (`tokenized` with no cache and no scratch)."""
    lengths: np.ndarray
    ids: np.ndarray
    stats: dict[str, Any]
    """TokenizeStats' counts (not the lengths), the pad id and tokenizer size included."""
    reused: bool
    """True when read back from `data.cache_path` instead of tokenized now."""
    seconds: float
    tower: np.ndarray | None = None
    """Image data only: every example's vision-tower patches and Σ patches² (rows of 2, in the
    order of `ids`), what the plan's balance counts (raypack/data/tower.py)."""
    labels: np.ndarray | None = None
    """Every example's label tokens, in the order of `ids`; None for a cache entry tokenized before
    they were kept."""


def tokenized(cfg: Config, sources: Sources, vocab_size: int | None = None, scratch: str | None = None) -> Tokenized:
    """Tokenize `cfg`'s data (`sources`, its listing), or read it back from `data.cache_path`
    when an entry with the same `tokenized_key`, made from sources that have not changed since, is
    there (then nothing is tokenized). `vocab_size`: the model's, which bounds pre-tokenized ids.
    The rows are written to the cache entry, else to `scratch` (a folder the caller removes when
    it has packed them); with neither, they are not kept (lengths and counts only)."""
    t0 = time.perf_counter()
    key = tokenized_key(cfg)
    folder = f"{storage.absolute(cfg.data.cache_path)}/tokenized/{key}" if cfg.data.cache_path else None
    saved = read_manifest(folder) if folder else None
    if saved is not None:
        changes = changed_sources(saved.get("sources", {}), sources.fingerprint)
        if not changes:
            images = bool(saved["stats"].get("images"))
            table = _columns_of(saved["data_dir"], ["example_id", "length", *(["image_grid_thw"] if images else [])],
                                optional=["label_tokens"])
            order = np.argsort(table["example_id"].to_numpy(), kind="stable")
            lengths, ids = ordered(table["length"].to_numpy(), table["example_id"].to_numpy())
            tower = grid_work(table["image_grid_thw"])[order] if images else None
            labels = table["label_tokens"].to_numpy()[order] if "label_tokens" in table.column_names else None
            print(f"[raypack] reusing tokenized data in {saved['data_dir']}", flush=True)
            return Tokenized(saved["key"], saved["data_dir"], lengths, ids, saved["stats"], True, time.perf_counter() - t0,
                             tower, labels)
        print(f"[raypack] the sources changed since {folder} was tokenized ({changes[0]}): tokenizing again", flush=True)

    where = " in this process (data.driver_max_mb)" if on_driver(cfg, source_bytes(sources)) else ""
    print(f"[raypack] reading and tokenizing {len(sources.files)} source file(s){where}", flush=True)
    data_dir = fresh_folder(folder) if folder else scratch
    if scratch and not folder:
        storage.remove_dir(scratch)  # write_parquet appends: a stopped run's files would join
    try:
        if where:
            tok_stats = tokenize_here(cfg, sources, data_dir or "", vocab_size)
        else:
            _, tok_stats = tokenize_dataset(cfg, sources, vocab_size, out_dir=data_dir or "")
        require_supervised(tok_stats, cfg)
    except BaseException:  # Ctrl-C included: rows written for nothing (a cache entry is committed below)
        if data_dir:
            storage.remove_dir(data_dir)
        raise
    arrays = ("lengths", "ids", "tower", "label_counts")  # the planner's, kept beside the counts, not in them
    stats = {k: v for k, v in dataclasses.asdict(tok_stats).items() if k not in arrays}
    lengths, ids = ordered(tok_stats.lengths, tok_stats.ids)
    order = np.argsort(tok_stats.ids, kind="stable")
    tower = None if tok_stats.tower is None else tok_stats.tower[order]
    labels = tok_stats.label_counts[order] if len(tok_stats.label_counts) == len(order) else None
    print(f"[raypack] {tok_stats.examples_in} examples: {tok_stats.examples_out} rows, {tok_stats.tokens} tokens "
          f"({tok_stats.label_tokens} with loss); dropped {tok_stats.dropped} over {tok_stats.max_length} tokens and "
          f"{tok_stats.no_labels} without a label token, truncated {tok_stats.truncated}, split {tok_stats.split}, "
          f"{tok_stats.bad_rows} bad rows skipped; lost {tok_stats.losses()}"
          + (f"; {tok_stats.images} images, {tok_stats.image_tokens} image tokens in the lengths" if tok_stats.images
             else "") + f" ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    if folder:
        commit(folder, {"key": key, "data_dir": data_dir, "stats": stats, "sources": recorded(sources.fingerprint),
                        "seconds": time.perf_counter() - t0})
        print(f"[raypack] tokenized {len(ids)} examples into {data_dir}", flush=True)
    return Tokenized(key, data_dir, lengths, ids, stats, False, time.perf_counter() - t0, tower, labels)


def _columns_of(data_dir: str, columns: list[str], optional: list[str] = ()) -> pa.Table:
    """`columns` of a cached entry's rows, read here by pyarrow's threads: the planner's input,
    which the driver holds anyway, without the seconds a Ray Data read takes to start; and those
    of `optional` that its files have (an entry tokenized before they were kept lacks them)."""
    fs, path = storage.resolve(data_dir)
    files = storage.list_files(data_dir, ".parquet")  # fs paths: the folder's other files left out
    if not files:
        raise InputError(f"data.cache_path: {data_dir} holds no tokenized rows, though the cache's manifest names it; "
                         "delete that cache entry to tokenize again")
    dataset = pads.dataset(files, filesystem=fs, format="parquet")
    return dataset.to_table(columns=[*columns, *(c for c in optional if c in dataset.schema.names)])


def supervised(tok: Tokenized, cfg: Config) -> None:
    """`require_supervised` on a Tokenized record's counts (a reused one included)."""
    require_supervised(TokenizeStats(**tok.stats), cfg)


# --- packed rows ---------------------------------------------------------------------------------


def reusable(cfg: Config, num_ranks: int, root: str, sources: Sources, reprepare: bool = False,
             tower=None) -> Prepared | None:
    """The packed data already in `root` if it was made from this config and these sources;
    None if there is none, or it was made from another config (it is then made again), or
    `reprepare` is set. Same config but changed sources raises SourcesChangedError. Starts no
    Ray work and reads no rows: the manifest, against the command's listing of the sources."""
    saved = read_manifest(storage.absolute(root))
    if saved is None or saved.get("fingerprint") != packed_key(cfg, num_ranks, tower):
        return None
    changes = changed_sources(saved["sources"], sources.fingerprint)
    if not changes:
        return Prepared.from_dict(saved["prepared"])
    if reprepare:
        return None
    more = f" (and {len(changes) - 1} more changes)" if len(changes) > 1 else ""
    raise SourcesChangedError(
        f"{cfg.data.setting} changed since this run's data was prepared in {root}: {changes[0]}{more}. "
        "Start a new run with run.name=NEW_NAME, or re-prepare this one with `raypack train --reprepare`"
    )
