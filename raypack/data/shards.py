"""The packed data as the workers see it: the record the driver hands them, and their rows.

    data = Prepared.from_dict(config["data"])                    # from train_loop_config
    for row in iter_epoch_packs(data, rank, epoch, start_step=state.micro_step):
        ...                                                      # one packed row per micro-step

The driver writes both (raypack/data/prepare.py, raypack/data/pack.py): Parquet under
`<dir>/rank=<r>/`, files named in step order, one row per (rank, step), in row groups of
`group_steps` whole optimizer steps. Each worker reads exactly its own rank's rows, so every rank
runs the same number of steps. This module starts no Ray work and tokenizes nothing, so a worker
imports none of the driver's pipeline.

Epochs. One set of packed rows serves every epoch; epoch e reads it in its own order,
`epoch_order(steps, group_steps, pack.seed, e)`: the plan's order in epoch 0 (already a seeded
shuffle), and for e >= 1 a seeded permutation of the row groups whose steps are then moved by
a random jitter of up to `WINDOW_GROUPS` row groups, so steps of one group spread over a window
of groups and the order differs everywhere between epochs. The unit is the optimizer step: the
`grad_accum` micro-steps of one step (balanced together across ranks) stay together and in order,
and every rank maps epoch positions to the same stored steps. A reader holds at most ~2 x
WINDOW_GROUPS + 1 row groups (Arrow, a few MB each) and converts only the rows it yields.

Why not one Parquet row group per step, read at random: every row group costs ~1 KB of footer, so
a rank with 340k steps (10M examples, 8 ranks) would parse ~300 MB of metadata per epoch; and why
not rows written per epoch: it multiplies the pack stage's time and bytes by the epoch count.
benchmarks/epoch_rows.py measures the three (results in benchmarks/results/epoch_rows_*.md).
Rows per epoch are written only for `pack.repack_each_epoch`, where the packs themselves change;
each such epoch is then read in its own plan's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypack import storage
from raypack.data.vision_pairs import image_owner


@dataclass(frozen=True)
class Prepared:
    """What the workers need to know about the packed data; travels in `train_loop_config`."""

    root: str
    fingerprint: str
    """Hash of everything that shaped the packs; checkpoints record it (see loop.restore)."""
    train_dir: str
    eval_dir: str | None
    steps_per_rank: int
    """Micro-steps (packs) per rank in epoch 0; a multiple of train.grad_accum."""
    padded: bool
    """The plan's `Plan.padded` (its strategy's `padded`): rows are collated into padded batches
    and the model attends with its own SDPA instead of a varlen attention."""
    pad_token_id: int
    vocab_size: int
    length_mean: float
    length_sq_mean: float
    """Mean and mean square of the trained examples' lengths: their attention cost, for MFU."""
    stats: dict[str, Any]
    """Tokenize counts and plan statistics (efficiency, padding, imbalance) for reports and logs."""
    grad_accum: int = 1
    """Micro-steps per optimizer step: rows are read, and reordered, in groups of this many."""
    group_steps: int = 1
    """Optimizer steps per Parquet row group (the unit an epoch's order moves)."""
    order_seed: int = 0
    """pack.seed: epoch e's step order is seeded by (order_seed, e)."""
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per epoch under pack.repack_each_epoch ({"dir", "steps_per_rank", "stats"}), in
    epoch order; empty when every epoch reads `train_dir`."""
    images_dir: str | None = None
    """Vision rows' images and grids by example_id (`prepare.write_images`); None: text only."""
    eval_sources: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """A mixture's eval steps, one source at a time: {"name", "steps": [first, stop]} in step
    order, every eval row of those steps (on every rank) that source's; empty for data.paths."""
    resized: dict[str, Any] | None = None
    """A resume on another worker count (raypack/train/resize.py): the examples epoch "epoch" had
    not trained at optimizer step "step", planned again for these ranks ({"epoch", "step", "dir",
    "steps_per_rank", "stats", "from": the fingerprint the checkpoint's position indexes}); that
    epoch reads these rows from micro-step 0, and later epochs this record's own."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Prepared:
        return cls(**raw)

    def epoch_rows(self, epoch: int) -> tuple[str, int, bool]:
        """(folder, micro-steps per rank, reordered?) that epoch `epoch` trains on."""
        if self.resized is not None and epoch == self.resized["epoch"]:
            return self.resized["dir"], int(self.resized["steps_per_rank"]), False  # the rest, in its plan's order
        if self.epochs:
            e = self.epochs[epoch % len(self.epochs)]
            return e["dir"], int(e["steps_per_rank"]), False  # a new plan: its own seeded order
        return self.train_dir, self.steps_per_rank, epoch > 0

    def total_steps(self, grad_accum: int, epochs: int, max_steps: int | None) -> int:
        """Optimizer steps a run over this data takes: every epoch's (each repacked epoch has its
        own count), or `max_steps` if fewer."""
        first = int(self.resized["epoch"]) if self.resized is not None else 0
        total = (int(self.resized["step"]) if self.resized is not None else 0) + sum(
            self.epoch_rows(e)[1] // grad_accum for e in range(first, epochs))
        return min(total, max_steps) if max_steps else total

    def eval_source(self, step: int) -> str | None:
        """The name of the mixture's source whose examples eval step `step` holds; None for data.paths."""
        for source in self.eval_sources:
            if source["steps"][0] <= step < source["steps"][1]:
                return source["name"]
        return None

    def report_stats(self, epoch: int = 0) -> dict[str, float]:
        """Plan statistics reported with every ray.train.report: efficiency, padding, and the
        wall-time overhead of imbalance (tokens and attention; mean and worst step)."""
        stats = self.epochs[epoch % len(self.epochs)]["stats"] if self.epochs else self.stats
        if self.resized is not None and epoch == self.resized["epoch"]:
            stats = self.resized["stats"]
        keys = ("packing_efficiency", "padding_fraction", "token_imbalance", "attention_imbalance",
                "token_imbalance_worst", "attention_imbalance_worst")
        return {k: float(stats[k]) for k in keys if k in stats}


def iter_rank_packs(out_dir: str, rank: int, start_step: int = 0, batch_rows: int = 16) -> Iterator[dict[str, Any]]:
    """The packed rows of `rank` in step order, from `start_step` on (resume skips the rest).

    Streams `batch_rows` rows at a time: a whole file of long packs as Python lists would cost
    gigabytes per rank."""
    folder = f"{out_dir.rstrip('/')}/rank={rank}"
    fs, _ = storage.resolve(folder)
    for f in storage.list_files(folder, ".parquet"):
        with fs.open_input_file(f) as handle:
            parquet = pq.ParquetFile(handle)
            last_step = parquet.metadata.row_group(parquet.metadata.num_row_groups - 1)
            steps_stats = last_step.column(parquet.schema_arrow.get_field_index("step")).statistics
            if steps_stats is not None and steps_stats.has_min_max and steps_stats.max < start_step:
                continue  # the whole file lies before the resume point
            for batch in parquet.iter_batches(batch_size=batch_rows):
                steps = batch.column("step").to_numpy()
                if len(steps) and steps[-1] < start_step:
                    continue
                if "rank" not in batch.schema.names:
                    batch = batch.append_column("rank", pa.array(np.full(batch.num_rows, rank), pa.int32()))
                yield from batch.filter(pa.array(steps >= start_step)).to_pylist()


def rank_images(data: Prepared, rank: int) -> dict[int, tuple[list[bytes], list[int]]]:
    """{example_id: (encoded images, flat grids)} of the vision examples `rank` trains or
    evaluates on (every epoch's rows), read from `data.images_dir`: only its own, not the dataset's."""
    if not data.images_dir:
        return {}
    folders = {data.epoch_rows(e)[0] for e in range(max(len(data.epochs), 1))} | ({data.eval_dir} - {None})
    mine = []
    for folder in folders:
        for f in storage.list_files(f"{folder.rstrip('/')}/rank={rank}", ".parquet"):
            fs, p = storage.resolve(f)
            mine.append(pq.read_table(p, filesystem=fs, columns=["example_ids"])["example_ids"].combine_chunks().flatten())
    # stored under their owner's id: a pair's rejected row reads its chosen row's (image_owner)
    wanted = np.unique(image_owner(np.concatenate([m.to_numpy() for m in mine]))) if mine else np.zeros(0, np.int64)
    out = {}
    for f in storage.list_files(data.images_dir, ".parquet"):
        fs, p = storage.resolve(f)
        table = pq.read_table(p, filesystem=fs)
        table = table.filter(pa.array(np.isin(table["example_id"].to_numpy(), wanted)))
        for eid, images, grid in zip(*(table[c].to_pylist() for c in ("example_id", "images", "image_grid_thw"))):
            out[eid] = (images, grid)
    return out


# --- epochs ----------------------------------------------------------------------------------------

WINDOW_GROUPS = 4
"""How far (in row groups) an epoch's jitter moves a step from its group's permuted place."""
GROUP_TOKENS = 2**18
"""Tokens per row group the writer aims for (~3 MB of input_ids, labels and position_ids)."""
MAX_GROUP_STEPS = 64


def group_steps_for(budget: int, grad_accum: int) -> int:
    """Optimizer steps per row group for packs of `budget` tokens: ~GROUP_TOKENS, at least one."""
    return max(1, min(MAX_GROUP_STEPS, GROUP_TOKENS // (budget * grad_accum)))


def epoch_order(num_steps: int, group_steps: int, seed: int, epoch: int) -> np.ndarray:
    """The stored optimizer step trained at every position of epoch `epoch` (see the module
    docstring): the identity for epoch 0, a seeded windowed shuffle of row groups after."""
    if epoch == 0:
        return np.arange(num_steps, dtype=np.int64)
    rng = np.random.default_rng([seed, 3, epoch])
    groups = -(-num_steps // group_steps)
    seq = (rng.permutation(groups)[:, None] * group_steps + np.arange(group_steps)).ravel()
    seq = seq[seq < num_steps]
    jitter = np.arange(len(seq)) + rng.uniform(0, WINDOW_GROUPS * group_steps, len(seq))
    return seq[np.argsort(jitter, kind="stable")]


def iter_epoch_packs(data: Prepared, rank: int, epoch: int, start_step: int = 0) -> Iterator[dict[str, Any]]:
    """The packed rows `rank` trains in epoch `epoch`, in that epoch's order, from micro-step
    `start_step` (a multiple of grad_accum: a resumed run's position) on."""
    folder, steps, reordered = data.epoch_rows(epoch)
    if steps == 0:  # a resumed epoch with nothing left to train (resized at its last step)
        return
    accum = data.grad_accum
    order = epoch_order(steps // accum, data.group_steps, data.order_seed, epoch if reordered else 0)
    yield from _iter_steps(f"{folder.rstrip('/')}/rank={rank}", order, accum, data.group_steps, start_step // accum)


def _iter_steps(folder: str, order: np.ndarray, accum: int, group_steps: int, start: int) -> Iterator[dict[str, Any]]:
    """Rows of the stored optimizer steps `order[start:]`, `accum` rows each, loading each row
    group once and dropping it when its last step in `order` has been read."""
    fs, _ = storage.resolve(folder)
    files = storage.list_files(folder, ".parquet")
    groups: list[tuple[str, int]] = []  # (file, row group) of every stored row group, in order
    sizes = []
    for f in files:
        meta = pq.read_metadata(f, filesystem=fs)
        for g in range(meta.num_row_groups):
            groups.append((f, g))
            sizes.append(meta.row_group(g).num_rows)
    rows_per_group = group_steps * accum
    if any(n != rows_per_group for n in sizes[:-1]) or (sizes and sizes[-1] > rows_per_group):
        raise RuntimeError(f"{folder}: row groups of {sorted(set(sizes))} rows, expected {rows_per_group} "
                           "(packed by another raypack version? delete the packed folder to re-pack)")
    need = -(-len(order) // group_steps)
    if len(groups) < need:
        raise RuntimeError(f"{folder} holds {len(groups)} row groups of {group_steps * accum} rows, the plan needs "
                           f"{need}; is a shard missing (is run.storage_path shared by every node)?")
    todo = order[start:]
    left = np.bincount(todo // group_steps, minlength=len(groups))  # steps still to read per group
    cache: dict[int, pa.Table] = {}
    for s in todo.tolist():
        g = s // group_steps
        if g not in cache:
            f, i = groups[g]
            with fs.open_input_file(f) as handle:
                cache[g] = pq.ParquetFile(handle).read_row_group(i)
        rows = cache[g].slice((s - g * group_steps) * accum, accum).to_pylist()
        if [r["step"] for r in rows] != list(range(s * accum, s * accum + accum)):
            raise RuntimeError(f"{folder}: row group {g} does not hold steps {s * accum}..{s * accum + accum - 1}")
        left[g] -= 1
        if left[g] == 0:
            del cache[g]
        yield from rows
