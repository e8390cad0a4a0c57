"""Pack stage: build the packed rows a `Plan` describes from the tokenized dataset, with Ray Data.

Input rows: `example_id` (int64, unique, not dense), `input_ids` / `labels` (list<int32>,
labels unshifted with -100 masking) and `length`. Plan index i is the i-th smallest example_id
(`raypack.data.tokenize.lengths_and_ids` builds both arrays in that order), or for a mixture that
repeats examples the i-th of its draw, in which an id may stand more than once (`plan_routing`).

Output: Parquet under `out_dir/rank=<r>/`, one row per (rank, step), in row groups of
`group_rows` rows (whole optimizer steps; see raypack/data/shards.py for why), read back in step
order by `raypack.data.shards.iter_rank_packs` and in each epoch's order by `iter_epoch_packs`. A packed row, for pieces a (3 tokens) and b (2 tokens):

    input_ids     a0 a1 a2 b0 b1
    labels        l0 l1 l2 m0 m1     raw labels; collate puts -100 at each example start
    position_ids  0  1  2  0  1      restart per piece (0 1 2 3 4 for wrapped_noreset)
    example_ids   [id_a, id_b]       real ids of the pieces, in order
    pack, rank, step, num_tokens

A piece of a split example (wrapped) also restarts its positions at 0, as TRL's wrapped does.
An empty pack becomes input_ids [0], labels [-100], position_ids [0], example_ids [].

How rows are built: the plan's `example -> (pack, position)` routing is broadcast once
(`ray.put`). One task per block cuts every example into its pieces, tags them with rank, step and
position, and returns one table per rank (`num_returns=num_ranks`); one task per rank then sorts
its pieces on the small (pack, position) keys and builds its rows a batch of whole row groups
(FINISH_TOKENS tokens) at a time, gathering each batch's tokens from the pieces where they lie in
the object store, so its memory stays flat however large the rank. Tokens move once, block ->
rank, through the object store; no shuffle.

benchmarks/pack_materialize.py measures this against two baselines built from the same pieces
(benchmarks/pack_baselines.py: a rank-partitioned Parquet write, and a global shuffle by pack)
on the same data and plan; routed is the fastest there (benchmarks/results/pack_materialize_*.md).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypack import storage
from raypack.data.formats import IGNORE_INDEX
from raypack.data.plan import Plan, concat_ranges
from raypack.data.progress import Progress, Tally, on_driver_node

FINISH_BYTES_PER_TOKEN = 96
"""Peak bytes per token of the batch of rows a rank's finishing task assembles at once (sorting,
gathering and writing its pieces: token, label and position columns, each copied a few times).
Measured whole-rank at 1M examples (4.7-4.8 GiB for 52M tokens, object-store pages included);
a streamed batch of FINISH_TOKENS measured 160-180 MiB above the task's start, so this is ample."""
FINISH_TOKENS = 2**22
"""Tokens a rank's finishing task assembles at once (whole row groups): what bounds its memory."""
PIECE_BYTES = 120
"""Bytes a routed piece's keys take in its rank's finishing task (pack, position, step, rank, id,
where its tokens are, and the sort order)."""
FINISH_BASE_BYTES = 256 * 2**20
"""A worker's own memory (Python, pyarrow) before any rows."""
ROUTE_BYTES_PER_FILE_BYTE = 8
"""Bytes a routing task may hold per byte of the (uncompressed) Parquet file it reads: the rows as
Arrow, the pieces cut from them and the gathers between. Ample: at 10M examples (files of at least
tokenize.TOKENIZED_FILE_BYTES) no Ray process held more than 591 MiB of its own
(benchmarks/results/prepare_scale_cpu_20261127.md)."""
ROWS_PER_FILE = 4096
"""Packed rows per output Parquet file, rounded down to whole row groups (files are named in step order)."""



def _list_array(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType, null: np.ndarray | None = None) -> pa.Array:
    mask = pa.array(null) if null is not None and null.any() else None
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, type_), mask=mask)


def _valid(lists: pa.Array) -> np.ndarray:
    """Which lists are not null (null labels: the row trains on its ids, formats.TRAINS_ON_IDS)."""
    return np.ones(len(lists), bool) if lists.null_count == 0 else lists.is_valid().to_numpy(zero_copy_only=False)


def _as_lists(column) -> pa.ListArray:
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(lists.type) or pa.types.is_large_list(lists.type)):  # e.g. a tensor column
        lists = pa.array([np.asarray(v) for v in lists.to_numpy(zero_copy_only=False)], pa.list_(pa.int32()))
    return lists


class Router:
    """map_batches callable: cut each example into the pieces the plan places, tag each piece."""

    def __init__(self, routing: dict[str, np.ndarray]):
        self.r = routing

    def __call__(self, batch: pa.Table) -> pa.Table:
        r = self.r
        ids = batch["example_id"].to_numpy().astype(np.int64)
        idx = np.searchsorted(r["ids"], ids)
        if (idx >= len(r["ids"])).any() or (r["ids"][np.minimum(idx, len(r["ids"]) - 1)] != ids).any():
            raise ValueError("the dataset holds example_ids that the plan's id array does not")
        entry = concat_ranges(r["first"][idx], r["count"][idx])  # plan entries of this batch's examples
        row = np.repeat(np.arange(len(ids)), r["count"][idx])
        out: dict[str, Any] = {
            "pack": r["pack"][entry],
            "pos": r["pos"][entry].astype(np.int32),
            "step": r["step"][entry].astype(np.int32),
            "rank": r["rank"][entry].astype(np.int32),
            "example_id": ids[row],
        }
        start, end = r["start"][entry], r["end"][entry]
        for col in ("input_ids", "labels"):
            lists = _as_lists(batch[col])
            # A piece of a row whose labels are null (its ids) gets null labels: nothing copied.
            valid = _valid(lists)[row]
            length = np.where(valid, end - start, 0)
            base = lists.offsets.to_numpy()[:-1].astype(np.int64)  # into .values, a slice's too
            values = lists.values.to_numpy(zero_copy_only=False)
            gather = concat_ranges(base[row] + start, length)
            out[col] = _list_array(np.concatenate(([0], np.cumsum(length))), values[gather].astype(np.int32),
                                   pa.int32(), ~valid)
        return pa.table(out)


def plan_routing(plan, example_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Where each example's pieces go, by example id. An id may stand at several plan indexes (a
    mixture's draw repeats examples, raypack/data/mixture.py): its row then yields the pieces of
    every one of them."""
    ids = np.asarray(example_ids, dtype=np.int64)
    if (np.diff(ids) > 0).all():  # ids in order, none repeated: the plan's index is the row's
        example = plan.example
    else:
        ids, index = np.unique(ids, return_inverse=True)
        example = index[plan.example]
    pack_first = np.searchsorted(plan.pack, plan.pack)  # entries are ordered by pack
    by_example = np.argsort(example, kind="stable")
    count = np.bincount(example, minlength=len(ids))
    return {
        "ids": ids,
        "first": np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64),
        "count": count.astype(np.int64),
        "start": plan.start[by_example],
        "end": plan.end[by_example],
        "pack": plan.pack[by_example],
        "pos": (np.arange(len(plan.pack)) - pack_first)[by_example],
        "step": plan.step[by_example],
        "rank": plan.rank[by_example],
    }


def assemble_rows(pieces: pa.Table, reset_positions: bool) -> pa.Table:
    """Packed rows from routed pieces (any order): sort on (pack, pos) and concatenate."""
    pieces = pieces.sort_by([("pack", "ascending"), ("pos", "ascending")]).combine_chunks()
    pack = pieces["pack"].to_numpy()
    new_row = np.concatenate(([True], pack[1:] != pack[:-1])) if len(pack) else np.zeros(0, bool)
    heads = np.flatnonzero(new_row)
    piece_len = pc.list_value_length(pieces["input_ids"]).to_numpy().astype(np.int64)
    pieces_per_row = np.diff(np.append(heads, len(pack)))
    row_tokens = np.add.reduceat(piece_len, heads) if len(heads) else np.zeros(0, np.int64)
    row_offsets = np.concatenate(([0], np.cumsum(row_tokens)))
    piece_offsets = np.concatenate(([0], np.cumsum(piece_len)))
    total = int(row_offsets[-1])
    restart = piece_offsets[:-1] if reset_positions else np.repeat(row_offsets[:-1], pieces_per_row)
    positions = np.arange(total) - np.repeat(restart, piece_len)
    ids = pc.list_flatten(pieces["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int32)
    return pa.table(
        {
            "input_ids": _list_array(row_offsets, ids, pa.int32()),
            "labels": _row_labels(pieces["labels"], ids, heads, piece_len, row_tokens),
            "position_ids": _list_array(row_offsets, positions.astype(np.int32), pa.int32()),
            "example_ids": _list_array(np.concatenate(([0], np.cumsum(pieces_per_row))),
                                       pieces["example_id"].to_numpy(), pa.int64()),
            "pack": pa.array(pack[heads], pa.int64()),
            "rank": pa.array(pieces["rank"].to_numpy()[heads], pa.int32()),
            "step": pa.array(pieces["step"].to_numpy()[heads], pa.int32()),
            "num_tokens": pa.array(row_tokens, pa.int32()),
        }
    )


def _row_labels(labels, ids: np.ndarray, heads: np.ndarray, piece_len: np.ndarray, row_tokens: np.ndarray) -> pa.Array:
    """The labels column of rows assembled from pieces: null for a row whose every piece's labels
    are null (its ids), and for a row that mixes the two, the ids written out where a piece has none."""
    piece_valid = _valid(labels)
    values = pc.list_flatten(labels).to_numpy(zero_copy_only=False).astype(np.int32)
    if piece_valid.all():
        return _list_array(np.concatenate(([0], np.cumsum(row_tokens))), values, pa.int32())
    row_valid = np.logical_or.reduceat(piece_valid, heads) if len(heads) else np.zeros(0, bool)
    full = ids.copy()
    full[np.repeat(piece_valid, piece_len)] = values
    kept = np.where(row_valid, row_tokens, 0)
    return _list_array(np.concatenate(([0], np.cumsum(kept))), full[np.repeat(row_valid, row_tokens)], pa.int32(),
                       ~row_valid)


def empty_rows(rank: int, steps: np.ndarray, num_ranks: int) -> pa.Table:
    k = len(steps)
    ones = np.arange(k + 1, dtype=np.int32)
    return pa.table(
        {
            "input_ids": _list_array(ones, np.zeros(k, np.int32), pa.int32()),
            "labels": _list_array(ones, np.full(k, IGNORE_INDEX, np.int32), pa.int32()),
            "position_ids": _list_array(ones, np.zeros(k, np.int32), pa.int32()),
            "example_ids": _list_array(np.zeros(k + 1, np.int32), np.zeros(0, np.int64), pa.int64()),
            "pack": pa.array(steps.astype(np.int64) * num_ranks + rank, pa.int64()),
            "rank": pa.array(np.full(k, rank), pa.int32()),
            "step": pa.array(steps, pa.int32()),
            "num_tokens": pa.array(np.ones(k), pa.int32()),
        }
    )


def write_rank(rows: pa.Table, out: str, rank: int, num_steps: int, num_ranks: int,
                group_rows: int = ROWS_PER_FILE) -> int:
    """Add the rank's empty packs, sort by step, write files whose names sort in step order, in
    row groups of `group_rows` rows: a whole rank at once (`finish_rank` streams one)."""
    # assemble_rows sorts by pack, which within a rank is step order: sorting again (a copy of
    # every token) is needed only for rows from elsewhere, or to slot in empty packs.
    if (np.diff(rows["step"].to_numpy()) < 0).any():
        rows = rows.sort_by("step")
    rows = _with_empty_packs(rows, rank, 0, num_steps, num_ranks)
    fs, path = storage.resolve(out)  # a local folder or object storage shared by every node
    fs.create_dir(path, recursive=True)
    per_file = max(1, ROWS_PER_FILE // group_rows) * group_rows
    for i in range(0, max(rows.num_rows, 1), per_file):
        name = f"{path}/part-{i // per_file:06d}.parquet"
        pq.write_table(rows.slice(i, per_file), name, filesystem=fs, row_group_size=group_rows)
    return rows.num_rows


def route_block(block: pa.Table, routing: dict[str, np.ndarray], num_ranks: int, tally=None):
    """One block's pieces, split by rank (a task with num_returns=num_ranks). `tally`: a
    progress.Tally told the block's examples once routed."""
    pieces = Router(routing)(block)
    rank = pieces["rank"].to_numpy()
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(num_ranks + 1))
    pieces = pieces.take(pa.array(order))
    parts = tuple(pieces.slice(bounds[r], bounds[r + 1] - bounds[r]) for r in range(num_ranks))
    if tally is not None and block.num_rows:
        ray.get(tally.add.remote(("examples routed", block["example_id"][0].as_py()), block.num_rows))
    return parts if num_ranks > 1 else parts[0]


def route_file(path: str, select, routing: dict[str, np.ndarray], num_ranks: int, tally=None):
    """`route_block` for one Parquet file of tokenized rows, read by the task itself, so that the
    tokenized rows never sit in the object store beside their pieces. `select`: (sorted example
    ids, True to keep those / False to keep the others), or None for every row."""
    fs, p = storage.resolve(path)
    block = pq.read_table(p, filesystem=fs, columns=["example_id", "input_ids", "labels"])
    if select is not None:
        ids, keep = select
        block = block.filter(pa.array(np.isin(block["example_id"].to_numpy(), ids, assume_unique=True) == keep))
    return route_block(block, routing, num_ranks, tally)


def route_memory(file_bytes: int) -> int:
    """Bytes to reserve for a `route_file` task reading a file of `file_bytes`."""
    return FINISH_BASE_BYTES + ROUTE_BYTES_PER_FILE_BYTE * file_bytes


def label_tokens(rows: pa.Table) -> int:
    """Label tokens of packed rows that the loss sees: not -100, and not where positions restart
    (collate masks every example start; wrapped_noreset restarts only at a row's start)."""
    labels = pc.list_flatten(rows["labels"]).to_numpy(zero_copy_only=False)
    positions = pc.list_flatten(rows["position_ids"]).to_numpy(zero_copy_only=False)
    # A row with null labels trains on its ids, which are never -100.
    valid = np.repeat(_valid(rows["labels"].combine_chunks()), rows["num_tokens"].to_numpy())
    return int(((labels != IGNORE_INDEX) & (positions[valid] != 0)).sum() + (positions[~valid] != 0).sum())


def _column(table: pa.Table, name: str) -> np.ndarray:
    col = table[name]
    return (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()).to_numpy()


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column, read in place: offsets index `values` (a slice's too)."""
    col = table[name]
    lists = _as_lists(col.chunk(0) if col.num_chunks == 1 else col)
    return lists.offsets.to_numpy().astype(np.int64), lists.values.to_numpy(zero_copy_only=False)


class _RankPieces:
    """One rank's routed pieces, from every block, ordered by (pack, position), without copying
    their tokens: each part's lists are read in place (in the object store's buffers) and
    `take` gathers a run of pieces' tokens at a time."""

    KEYS = ("pack", "pos", "step", "rank", "example_id")

    def __init__(self, parts):
        parts = [t for t in parts if t.num_rows]
        self.lists = [{c: _lists(t, c) for c in ("input_ids", "labels")} for t in parts]
        cat = lambda arrays, dtype: np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)  # noqa: E731
        keys = {k: cat([_column(t, k) for t in parts], np.int64) for k in self.KEYS}
        self.part = cat([np.full(t.num_rows, i) for i, t in enumerate(parts)], np.int64)
        self.start = {c: cat([l[c][0][:-1] for l in self.lists], np.int64) for c in ("input_ids", "labels")}
        self.length = cat([np.diff(l["input_ids"][0]) for l in self.lists], np.int64)
        self.labeled = cat([_valid(_as_lists(t["labels"])) for t in parts], bool)  # null labels: its ids
        self.order = np.lexsort((keys["pos"], keys["pack"]))
        self.keys = {k: v[self.order] for k, v in keys.items()}

    def take(self, lo: int, hi: int) -> pa.Table:
        """Pieces lo..hi in (pack, position) order, as the Router made them."""
        sel = self.order[lo:hi]
        part, labeled = self.part[sel], self.labeled[sel]
        by_part = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[by_part], np.arange(len(self.lists) + 1))
        out = {}
        for col in ("input_ids", "labels"):
            length = self.length[sel] if col == "input_ids" else np.where(labeled, self.length[sel], 0)
            offsets = np.concatenate(([0], np.cumsum(length)))
            values = np.empty(int(offsets[-1]), np.int32)
            for p in np.flatnonzero(np.diff(bounds)):
                idx = by_part[bounds[p]:bounds[p + 1]]
                src = concat_ranges(self.start[col][sel[idx]], length[idx])
                values[concat_ranges(offsets[idx], length[idx])] = self.lists[p][col][1][src]
            out[col] = _list_array(offsets, values, pa.int32(), None if col == "input_ids" else ~labeled)
        cols = {k: pa.array(self.keys[k][lo:hi], pa.int64() if k in ("pack", "example_id") else pa.int32())
                for k in self.KEYS}
        return pa.table({**cols, **out})


def finish_rank(out: str, rank: int, num_steps: int, num_ranks: int, reset: bool, parts,
                group_rows: int = ROWS_PER_FILE, tally=None) -> tuple[int, int]:
    """Write one rank's rows from its pieces (`parts`: one table from each block), a batch of
    whole row groups (about FINISH_TOKENS tokens) at a time, in files of whole row groups whose
    names sort in step order: (rows written, label tokens). Holds the pieces' keys and one batch's
    rows, never the rank's. `tally`: a progress.Tally told each batch's rows once written."""
    pieces = _RankPieces(parts)
    fs, path = storage.resolve(out)  # a local folder or object storage shared by every node
    fs.create_dir(path, recursive=True)
    per_file = max(1, ROWS_PER_FILE // group_rows) * group_rows
    # Batches of whole row groups: group g's pieces are cuts[g]..cuts[g + 1] (pieces are in step order).
    groups = max(-(-num_steps // group_rows), 1)
    cuts = np.searchsorted(pieces.keys["step"], np.arange(groups + 1) * group_rows)
    cuts[-1] = len(pieces.order)
    tokens = np.concatenate(([0], np.cumsum(pieces.length[pieces.order])))
    written, labels, writer, g0 = 0, 0, None, 0
    try:
        while g0 < groups:
            g1 = g0 + 1
            while g1 < groups and tokens[cuts[g1 + 1]] - tokens[cuts[g0]] <= FINISH_TOKENS:
                g1 += 1
            s0, s1, lo, hi = g0 * group_rows, min(g1 * group_rows, num_steps), cuts[g0], cuts[g1]
            rows = _with_empty_packs(assemble_rows(pieces.take(lo, hi), reset) if hi > lo else None, rank, s0, s1,
                                     num_ranks)
            labels += label_tokens(rows)
            for i in range(0, max(rows.num_rows, 1), group_rows):
                if (s0 + i) % per_file == 0:  # a new file every per_file rows
                    if writer is not None:
                        writer.close()
                    name = f"{path}/part-{(s0 + i) // per_file:06d}.parquet"
                    writer = pq.ParquetWriter(name, rows.schema, filesystem=fs)
                writer.write_table(rows.slice(i, group_rows), row_group_size=group_rows)
            written += rows.num_rows
            if tally is not None:
                ray.get(tally.add.remote(("rows written", rank, s0), rows.num_rows))
            g0 = g1
    finally:
        if writer is not None:
            writer.close()
    return written, labels


def _with_empty_packs(rows: pa.Table | None, rank: int, s0: int, s1: int, num_ranks: int) -> pa.Table:
    """`rows` (of steps s0..s1, in step order) with an empty pack at each step they lack."""
    have = np.zeros(max(s1 - s0, 0), dtype=bool)
    if rows is not None:
        have[rows["step"].to_numpy() - s0] = True
    missing = s0 + np.flatnonzero(~have)
    if rows is None:
        return empty_rows(rank, missing, num_ranks)
    return pa.concat_tables([rows, empty_rows(rank, missing, num_ranks)]).sort_by("step") if len(missing) else rows


def finish_rank_tables(out: str, rank: int, num_steps: int, num_ranks: int, reset: bool, *parts,
                        group_rows: int = ROWS_PER_FILE) -> int:
    return finish_rank(out, rank, num_steps, num_ranks, reset, parts, group_rows)[0]


def _finish_and_count(out: str, rank: int, num_steps: int, num_ranks: int, reset: bool, *parts,
                      group_rows: int = ROWS_PER_FILE, tally=None) -> tuple[int, int]:
    """Rows written and label tokens, for one rank."""
    return finish_rank(out, rank, num_steps, num_ranks, reset, parts, group_rows, tally)


def finish_memory(plan: Plan, group_rows: int = ROWS_PER_FILE) -> np.ndarray:
    """Bytes of memory to reserve for each rank's finishing task, so that Ray runs only as many at
    once as the nodes' memory holds: its pieces' keys (PIECE_BYTES a piece) and one batch of rows
    (FINISH_TOKENS tokens and at most one more row group's, at FINISH_BYTES_PER_TOKEN); capped at
    what the largest node offers, or the task could never be scheduled."""
    tokens = plan.end - plan.start
    pieces = np.bincount(plan.rank, minlength=plan.num_ranks)
    group = plan.rank.astype(np.int64) * (plan.num_steps // group_rows + 1) + plan.step // group_rows
    per_group = np.bincount(group, weights=tokens)
    largest_group = np.zeros(plan.num_ranks)
    np.maximum.at(largest_group, np.arange(len(per_group)) // (plan.num_steps // group_rows + 1), per_group)
    rank_tokens = np.bincount(plan.rank, weights=tokens, minlength=plan.num_ranks)
    batch = np.minimum(rank_tokens, FINISH_TOKENS + largest_group)
    largest = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)
    want = pieces * PIECE_BYTES + batch * FINISH_BYTES_PER_TOKEN + FINISH_BASE_BYTES
    return np.minimum(want, 0.8 * largest) if largest else want


def materialize(source: ray.data.Dataset | list[tuple[str, int]], plan: Plan, example_ids: np.ndarray, out_dir: str,
                group_rows: int = ROWS_PER_FILE, stage: str = "pack", select=None, here: bool = False) -> dict[str, Any]:
    """Write the packed rows of `plan` under `out_dir/rank=<r>/` (replacing what was there), in
    Parquet row groups of `group_rows` rows (prepare passes whole optimizer steps; the default,
    one group per file, suits a reader that only streams). `source`: the tokenized rows, as a
    Ray Dataset or as (path, bytes) of Parquet files (`storage.file_sizes`), which the routing
    tasks read themselves, filtered by `select` (see `route_file`). Returns counts (rows; label
    tokens per rank, which the driver checks before training) and seconds. Prints `stage`'s
    progress (raypack/data/progress.py): examples routed, then rows written. `here`: files small
    enough to route and finish in this process, one after the other, rather than in Ray tasks,
    whose start costs more than such data's work (`tokenize.on_driver`)."""
    t0 = time.perf_counter()
    out = out_dir.rstrip("/")
    storage.remove_dir(out)  # write_parquet appends by default; a stale shard would corrupt a rank
    if here and isinstance(source, list):
        routing = plan_routing(plan, example_ids)
        parts = [route_file(path, select, routing, plan.num_ranks) for path, _ in source]
        parts = [[p] for p in parts] if plan.num_ranks == 1 else parts
        done = [finish_rank(f"{out}/rank={r}", r, plan.num_steps, plan.num_ranks, plan.reset_positions,
                            [p[r] for p in parts], group_rows) for r in range(plan.num_ranks)]
        return {"rows": sum(n for n, _ in done), "rank_label_tokens": [t for _, t in done], "method": "here",
                "seconds": time.perf_counter() - t0}
    routing = ray.put(plan_routing(plan, example_ids))
    args = (plan.num_steps, plan.num_ranks, plan.reset_positions)
    tally = on_driver_node(Tally).remote()
    poll = functools.partial(_pack_progress, tally, len(example_ids), plan.num_steps * plan.num_ranks)
    try:
        with Progress(stage, poll):
            # One CPU a task: fractions start more workers at once than a small node's CPUs start well.
            if isinstance(source, list):
                route = ray.remote(num_cpus=1, num_returns=plan.num_ranks)(route_file)
                chosen = ray.put(select) if select is not None else None
                parts = [route.options(memory=route_memory(size)).remote(path, chosen, routing, plan.num_ranks, tally)
                         for path, size in source]
            else:
                route = ray.remote(num_cpus=1, num_returns=plan.num_ranks)(route_block)
                parts = [route.remote(block, routing, plan.num_ranks, tally) for block in source.to_arrow_refs()]
            if plan.num_ranks == 1:
                parts = [[p] for p in parts]
            finish = ray.remote(num_cpus=1)(_finish_and_count)
            memory = finish_memory(plan, group_rows)
            done = ray.get([finish.options(memory=int(memory[r])).remote(
                f"{out}/rank={r}", r, *args, *[p[r] for p in parts], group_rows=group_rows, tally=tally)
                for r in range(plan.num_ranks)])
    finally:
        ray.kill(tally)
    return {"rows": sum(n for n, _ in done), "rank_label_tokens": [t for _, t in done], "method": "routed",
            "seconds": time.perf_counter() - t0}


def _pack_progress(tally, examples: int, rows: int) -> tuple[str, int, int]:
    """What a pack has done: examples routed, then (once a rank writes) rows written."""
    done = ray.get(tally.totals.remote(), timeout=30)
    if "rows written" in done:
        return "rows written", done["rows written"], rows
    return "examples routed", done.get("examples routed", 0), examples
