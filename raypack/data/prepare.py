"""Driver-side data preparation: tokenize, hold out eval, plan globally, write per-rank packs.

    tok = tokenized(cfg, sources)            # raypack/data/cache.py: tokenize, or reuse the cache
    lengths, ids = training_examples(tok, cfg, sources)   # eval held out, a mixture drawn: what the plan covers
    prepared = prepare(cfg, num_ranks, root, sources)    # all of it, into root

    tokenized ──> split by example_id hash ──> make_plan (lengths only) ──> materialize
    (Parquet:     (raypack/data/holdout.py)                                 └─ <root>/train/rank=R/
     the cache, or <root>/tokenized/ until packed)                          └─ <root>/eval/rank=R/

The plan is `strategies.make_plan(lengths, cfg.pack, ranks, grad_accum)`, the call `raypack
plan` makes on `training_examples`: built for ranks × accum virtual ranks and folded, so every
optimizer step sees ranks × accum packs balanced together. One set of rows serves every epoch
(each epoch reads it in its own order, see shards.py); under `pack.repack_each_epoch` each epoch
gets its own plan and rows under `<root>/train_epoch=E/` instead. The folder's manifest records
everything that shaped it (raypack/data/cache.py), so a resumed run or a restarted worker group
reuses it instead of re-planning. What the workers get is a `shards.Prepared` record; they read
their rows with `shards.py` alone.

A mixture (`data.sources`, raypack/data/mixture.py) holds its eval split out per source, packs
its draw (some examples repeated, some left out) globally like any data, says what each source
contributes, and packs the eval rows a source at a time, so each eval step is one source's
(`Prepared.eval_sources`).

Before packing it refuses data that trains on nothing: no example with a label token, or a rank
that would get none (more ranks x grad_accum than examples).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from raypack import storage
from raypack.config import Config
from raypack.data.cache import Tokenized, commit, fresh_folder, packed_key, reusable, supervised, tokenized, tokenized_key
from raypack.data.fingerprint import recorded
from raypack.data.holdout import held_out_line
from raypack.data.listing import Sources
from raypack.data.mixture import print_mixture, split
from raypack.data.pack import materialize
from raypack.data.pairs import check_pair_ids
from raypack.data.plan import Plan, stack_steps
from raypack.data.shards import Prepared, group_steps_for
from raypack.data.strategies import make_plan
from raypack.data.tokenize import on_driver
from raypack.data.tower import TowerCost, tower_extra, tower_stats
from raypack.data.vision_pairs import KIND as PAIR_KIND
from raypack.errors import InputError


def training_examples(tok: Tokenized, cfg: Config, sources: Sources) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and example ids (in example_id order) of the examples a run trains on: `tok`'s,
    less those held out for eval, as a mixture draws them. What `raypack plan --config` plans,
    and what prepare packs."""
    take = split(tok, cfg, sources).take
    return tok.lengths[take], tok.ids[take]


def training_tower(tok: Tokenized, cfg: Config, sources: Sources) -> np.ndarray | None:
    """The vision tower's work (patches, Σ patches²) of the examples `training_examples` gives, in
    its order; None for data without images."""
    return None if tok.tower is None else tok.tower[split(tok, cfg, sources).take]


def prepare(cfg: Config, num_ranks: int, root: str, sources: Sources, *, vocab_size: int | None = None,
            reprepare: bool = False, tok: Tokenized | None = None, vision_model: bool = False,
            tower: TowerCost | None = None) -> Prepared:
    """Tokenize, split, plan and pack `cfg`'s data (`sources`: its listing) into `root` (a folder
    or URI every node can read; `cache.packed_root` says which), or reuse what is already there
    (see `cache.reusable`). `vocab_size`: the model's, which bounds the ids of pre-tokenized rows.
    `tok`: `cfg`'s tokenized examples, when the caller already has them (a sweep packs several
    configs from one). `vision_model`: the caller found `cfg.model` a vision-language model;
    image rows are refused otherwise (they would train without their pictures). `tower`: its vision
    tower's cost (train/memory/vision.py: Tower.cost), which the plan's balance weighs patches by."""
    root = storage.absolute(root)
    found = reusable(cfg, num_ranks, root, sources, reprepare, tower)
    if found is not None:
        print(f"[raypack] reusing packed data in {root}", flush=True)
        print_mixture(found.stats.get("sources"), cfg.data)
        return found

    t0 = time.perf_counter()
    # In the shared cache, a fresh folder committed by the manifest (raypack/data/cache.py); a
    # run's own packed/ folder is rewritten in place, as only that run uses it.
    out = fresh_folder(root) if cfg.data.cache_path else root
    scratch = f"{out}/tokenized"  # the tokenized rows, when no cache keeps them: removed once packed
    new = not storage.exists(out)
    try:
        if tok is None:
            tok = tokenized(cfg, sources, vocab_size, scratch=scratch)
        elif tok.key != tokenized_key(cfg):
            raise ValueError("prepare: the tokenized examples passed in were made with another data or tokenize config")
        else:
            supervised(tok, cfg)
        parts = split(tok, cfg, sources)
        held_out = parts.held_out
        print(held_out_line(tok.ids, held_out, cfg, parts.owner), flush=True)
        figures = parts.figures(tok)
        print_mixture(figures, cfg.data)
        files = storage.file_sizes(tok.data_dir, ".parquet")
        held_ids = np.sort(tok.ids[held_out])
        train_lengths, train_ids = tok.lengths[parts.take], tok.ids[parts.take]
        drawn = parts.mixture is not None and parts.mixture.weights is not None
        # the rows to route: those drawn (a weighted mixture leaves some out), else all but eval's
        train = (files, (np.unique(train_ids), True) if drawn else (held_ids, False) if len(held_ids) else None)
        evals = (files, (held_ids, True)) if len(held_ids) else None
        train_tower = None if tok.tower is None else tok.tower[parts.take]
        extra = tower_extra(train_tower, tower)

        images_dir = None
        if tok.stats.get("images"):
            check_images_trainable(cfg, tok.stats, vision_model)
            images_dir = write_images(files, f"{out}/images")
        plan, stats, rank_labels = _pack(train, train_lengths, train_ids, cfg, num_ranks, f"{out}/train", extra=extra)
        if train_tower is not None and tower is not None:
            stats.update(tower_stats(plan, tower, train_tower, train_lengths))
        _check_every_rank_trains(plan, rank_labels, cfg, num_ranks, len(train_ids))
        with_images = _image_ids(images_dir) if images_dir and gathers_per_module(cfg) else None
        if with_images is not None:
            check_every_pack_sees_images(plan, train_ids, with_images, "train")
        eval_dir, eval_sources = None, []
        if evals is not None:
            owner = None if parts.owner is None else parts.owner[held_out]
            eval_plan, eval_sources = _pack_eval(evals, tok.lengths[held_out], tok.ids[held_out], cfg, num_ranks,
                                                 f"{out}/eval", plan.padded, owner,
                                                 parts.mixture.names if parts.mixture else ())
            if with_images is not None:
                check_every_pack_sees_images(eval_plan, tok.ids[held_out], with_images, "eval")
            eval_dir = f"{out}/eval"
        epochs = (_repacked_epochs(train, train_lengths, train_ids, cfg, num_ranks, out, plan, stats, extra)
                  if cfg.pack.repack_each_epoch else [])
    except BaseException:
        if new:  # a folder this call made and could not fill: nothing half-made stays behind
            storage.remove_dir(out)
        raise
    finally:
        storage.remove_dir(scratch)

    trained = train_lengths.astype(np.float64)
    prepared = Prepared(
        root=root,
        fingerprint=packed_key(cfg, num_ranks, tower),
        train_dir=f"{out}/train",
        eval_dir=eval_dir,
        steps_per_rank=int(plan.num_steps),
        padded=bool(plan.padded),
        pad_token_id=int(tok.stats["pad_token_id"]),
        vocab_size=int(tok.stats["tokenizer_size"]),
        length_mean=float(trained.mean()) if len(trained) else 0.0,
        length_sq_mean=float((trained**2).mean()) if len(trained) else 0.0,
        grad_accum=cfg.train.grad_accum,
        group_steps=group_steps_for(cfg.pack.budget, cfg.train.grad_accum),
        order_seed=cfg.pack.seed,
        epochs=epochs,
        images_dir=images_dir,
        eval_sources=eval_sources,
        stats={**tok.stats, **stats, "tokenize_reused": tok.reused, "tokenize_s": tok.seconds,
               "prepare_s": time.perf_counter() - t0, "train_examples": len(train_ids),
               "eval_examples": int(held_out.sum()), **({"sources": figures} if figures else {})},
    )
    # with large files' content hashes, so that touching one later doesn't refuse this data
    commit(root, {"fingerprint": prepared.fingerprint, "sources": recorded(sources.fingerprint),
                  "prepared": prepared.to_dict()})
    print(f"[raypack] packed {prepared.steps_per_rank} steps x {num_ranks} ranks with {cfg.pack.strategy} "
          f"(efficiency {stats['packing_efficiency']:.3f}"
          + (f", vision tower imbalance {stats['tower_imbalance']:.3f}" if "tower_imbalance" in stats else "")
          + f") in {root} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return prepared


def check_images_trainable(cfg: Config, stats: dict[str, Any], vision_model: bool) -> None:
    """Refuse, before packing, image rows a run would train without their pictures or inexactly:
    a model without a vision tower, a strategy that splits examples (a piece's positions count
    images it wouldn't carry), sequence parallelism (its shards carry no images)."""
    from raypack.data.strategies import STRATEGIES

    formats = stats.get("formats", {})
    rows = formats.get("vision", 0) + formats.get(PAIR_KIND, 0)
    where = f"{cfg.data.setting}: {stats['images']} images in {rows} {'vision' if formats.get('vision') else 'preference'} rows"
    if not vision_model:
        raise InputError(f"{where}, but model.name {cfg.model.name!r} trains as a text-only model (no vision tower, "
                         "or a checkpoint transformers loads as its causal LM, as Qwen3.5's and Gemma 3's): it would "
                         "train without the pictures; use a vision-language model raypack trains on images (e.g. "
                         "tiny-qwen2_5_vl, docs/guides/vision.md)")
    if STRATEGIES[cfg.pack.strategy].splits_examples:
        raise InputError(f"{where}: pack.strategy={cfg.pack.strategy} splits examples across rows, which would cut "
                         "images from the tokens their positions count; use a strategy that keeps examples whole")
    if cfg.train.sequence_parallel > 1:
        raise InputError(f"{where}: train.sequence_parallel={cfg.train.sequence_parallel} doesn't carry images "
                         "to the shards of a row yet; set it to 1")
    if gathers_per_module(cfg) and cfg.pack.repack_each_epoch:  # check_every_pack_sees_images covers epoch 1's
        raise InputError(f"{where}: train.zero_stage=3 with pack.repack_each_epoch: each epoch's plan would need "
                         "an image in every micro-batch, which raypack checks for one plan only; repack once")


def gathers_per_module(cfg: Config) -> bool:
    """Whether every rank's forward must run the same modules: DeepSpeed's ZeRO-3 gathers each
    module's weights with the other ranks as it runs. The torch engine's FSDP2 keeps a VLM's
    vision tower in the root unit, gathered on every rank whatever runs (raypack/train/engines/fsdp.py)."""
    return cfg.train.zero_stage == 3 and cfg.train.engine == "deepspeed"


def _image_ids(images_dir: str) -> np.ndarray:
    import pyarrow.parquet as pq

    parts = []
    for f in storage.list_files(images_dir, ".parquet"):
        fs, p = storage.resolve(f)
        parts.append(pq.read_table(p, filesystem=fs, columns=["example_id"])["example_id"].to_numpy())
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_every_pack_sees_images(plan: Plan, ids: np.ndarray, with_images: np.ndarray, what: str) -> None:
    """Under ZeRO-3 every rank's forward must run the same modules, since each gathers its
    partitioned weights with the others: a micro-batch without an image skips the vision tower
    and its rank would wait forever in the gathers of the ranks that run it. Refused before
    training, naming the first such micro-batch."""
    has = np.isin(ids[plan.example], with_images)
    seen = np.zeros(plan.num_ranks * plan.num_steps, bool)
    seen[plan.pack[has]] = True
    if not seen.all():
        pack = int(np.flatnonzero(~seen)[0])
        raise InputError(
            f"train.zero_stage=3: the {what} micro-batch of rank {pack % plan.num_ranks} at step "
            f"{pack // plan.num_ranks} holds no image, so its forward would skip the vision tower whose weights "
            "ZeRO-3 gathers from every rank together (a hang); use train.zero_stage 2, or data with an image in "
            "every micro-batch (docs/guides/vision.md)")


def write_images(files: list[tuple[str, int]], out_dir: str) -> str:
    """The vision rows' images (encoded bytes) and grids by example_id, beside the packed rows,
    which name their examples (`example_ids`): the workers look their rows' images up here
    (raypack/train/vision_rows.py). One file per tokenized file, vision rows only."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs, path = storage.resolve(out_dir)
    fs.create_dir(path, recursive=True)
    for k, (name, _) in enumerate(files):
        f, p = storage.resolve(name)
        table = pq.read_table(p, filesystem=f, columns=["example_id", "images", "image_grid_thw"])
        table = table.filter(pc.is_valid(table["images"]))
        if table.num_rows:
            pq.write_table(table, f"{path}/part-{k:06d}.parquet", filesystem=fs)
    return out_dir


def _pack(rows, lengths, ids, cfg: Config, num_ranks: int, out_dir: str,
          epoch: int = 0, extra=None, plan: Plan | None = None) -> tuple[Plan, dict[str, Any], list[int]]:
    """Plan `lengths` (or take `plan`, made for them) and write the rows under `out_dir`: (plan,
    its stats, label tokens per rank). `rows`: (the tokenized Parquet files, which of their
    examples: see `pack.route_file`); `extra`: make_plan's (the vision tower's work)."""
    accum = cfg.train.grad_accum
    pairs = cfg.train.objective == "dpo"
    if pairs:
        check_pair_ids(ids)
    if plan is None:
        plan = make_plan(lengths, cfg.pack, num_ranks, accum, epoch=epoch, pairs=pairs, extra=extra)
    stats = plan.stats()
    stats["packing_efficiency"] = stats.pop("efficiency")
    files, select = rows
    info = materialize(files, plan, ids, out_dir, group_rows=group_steps_for(cfg.pack.budget, accum) * accum,
                       stage=f"pack {out_dir.rsplit('/', 1)[-1]}", select=select,
                       here=on_driver(cfg, sum(size for _, size in files)))
    return plan, stats, info["rank_label_tokens"]


def _check_every_rank_trains(plan: Plan, rank_labels: list[int], cfg: Config, num_ranks: int, examples: int) -> None:
    if plan.num_steps < cfg.train.grad_accum:
        raise InputError(f"{cfg.data.setting}: {examples} examples make no full optimizer step for {num_ranks} ranks")
    idle = [r for r, n in enumerate(rank_labels) if n == 0]
    if idle:
        # Its gradients would be zeros averaged into every step: not wrong, but not what was asked.
        raise InputError(
            f"{cfg.data.setting}: rank {idle[0]} of {num_ranks} gets no label token to train on "
            f"({examples} training examples for {num_ranks} ranks x {cfg.train.grad_accum} "
            "micro-batches); add data or lower train.num_workers or train.grad_accum"
        )


def _pack_eval(rows, lengths, ids, cfg: Config, num_ranks: int, out_dir: str, padded: bool,
               owner: np.ndarray | None = None, names: tuple[str, ...] = ()) -> tuple[Plan, list[dict[str, Any]]]:
    """Eval packs with one exact strategy whatever trains: whole examples, positions reset (pad
    for padded runs, whose model attends with a padding mask), so eval loss compares across the
    strategies of a sweep. A mixture's (`owner`: each example's source) are planned a source at
    a time, its steps after the previous source's, so that every eval step is one source's:
    returns the plan and each source's steps (`shards.Prepared.eval_sources`)."""
    pack = dataclasses.replace(cfg.pack, strategy="pad" if padded else "bfd", repack_each_epoch=False)
    eval_cfg = dataclasses.replace(cfg, pack=pack, train=dataclasses.replace(cfg.train, grad_accum=1))
    if owner is None:
        return _pack(rows, lengths, ids, eval_cfg, num_ranks, out_dir)[0], []
    order = np.argsort(owner, kind="stable")  # a source's examples together, each in example_id order
    parts = [k for k in range(len(names)) if (owner == k).any()]
    pairs = cfg.train.objective == "dpo"  # a pair's two rows, one item of each source's plan
    plans = [make_plan(lengths[owner == k], eval_cfg.pack, num_ranks, pairs=pairs) for k in parts]
    stacked = stack_steps(plans, [int((owner == k).sum()) for k in parts])
    plan = dataclasses.replace(stacked, example=order[stacked.example])  # indexes into `ids` as given
    _pack(rows, lengths, ids, eval_cfg, num_ranks, out_dir, plan=plan)
    first = np.cumsum([0, *[p.num_steps for p in plans]])
    return plan, [{"name": names[k], "steps": [int(first[i]), int(first[i + 1])]} for i, k in enumerate(parts)]


def _repacked_epochs(rows, lengths, ids, cfg: Config, num_ranks: int, root: str, first: Plan,
                     first_stats: dict[str, Any], extra=None) -> list[dict[str, Any]]:
    """pack.repack_each_epoch: a plan and rows per epoch (epoch 0's are `first`), as many as the
    run's epochs or max_steps can use."""
    accum, t = cfg.train.grad_accum, cfg.train
    epochs = [{"dir": f"{root}/train", "steps_per_rank": int(first.num_steps), "stats": first_stats}]
    steps = first.num_steps // accum
    for e in range(1, t.epochs):
        if t.max_steps and steps >= t.max_steps:
            break
        print(f"[raypack] packing epoch {e + 1}/{t.epochs} (pack.repack_each_epoch)", flush=True)
        plan, stats, _ = _pack(rows, lengths, ids, cfg, num_ranks, f"{root}/train_epoch={e}", epoch=e, extra=extra)
        epochs.append({"dir": f"{root}/train_epoch={e}", "steps_per_rank": int(plan.num_steps), "stats": stats})
        steps += plan.num_steps // accum
    return epochs
