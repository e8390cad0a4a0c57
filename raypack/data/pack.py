"""Pack stage: build the packed rows a `Plan` describes from the tokenized dataset, with Ray Data.

Input rows: `example_id` (int64, unique, not dense), `input_ids` / `labels` (list<int32>,
labels unshifted with -100 masking) and `length`. Plan index i is the i-th smallest example_id
(`raypack.data.tokenize.lengths_and_ids` builds both arrays in that order).

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
its pieces on the small (step, position) keys and concatenates them into rows with vectorized
Arrow operations. Tokens move once, block -> rank, through the object store; no shuffle.

benchmarks/pack_materialize.py measures this against two baselines built from the same pieces
(benchmarks/pack_baselines.py: a rank-partitioned Parquet write, and a global shuffle by pack)
on the same data and plan; routed is the fastest there (benchmarks/results/pack_materialize_*.md).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypack import storage
from raypack.data.formats import IGNORE_INDEX
from raypack.data.plan import Plan

FINISH_BYTES_PER_TOKEN = 96
"""Peak bytes per token of a rank's finishing task (sorting, assembling and writing its pieces:
token, label and position columns, each copied a few times). prepare_scale.py at 1M examples, 8
ranks of 52M tokens: the largest worker's RSS was 4.7-4.8 GiB, object-store pages it read included."""
FINISH_BASE_BYTES = 256 * 2**20
"""A worker's own memory (Python, pyarrow) before any rows."""
ROWS_PER_FILE = 4096
"""Packed rows per output Parquet file, rounded down to whole row groups (files are named in step order)."""


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for every (s, c), without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)


def _list_array(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, type_))


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
        entry = _ranges(r["first"][idx], r["count"][idx])  # plan entries of this batch's examples
        row = np.repeat(np.arange(len(ids)), r["count"][idx])
        out: dict[str, Any] = {
            "pack": r["pack"][entry],
            "pos": r["pos"][entry].astype(np.int32),
            "step": r["step"][entry].astype(np.int32),
            "rank": r["rank"][entry].astype(np.int32),
            "example_id": ids[row],
        }
        start, end = r["start"][entry], r["end"][entry]
        piece_offsets = np.concatenate(([0], np.cumsum(end - start)))
        for col in ("input_ids", "labels"):
            lists = _as_lists(batch[col])
            base = lists.offsets.to_numpy()[:-1].astype(np.int64) - lists.offsets[0].as_py()
            values = lists.values.to_numpy(zero_copy_only=False)
            gather = _ranges(base[row] + start, end - start)
            out[col] = _list_array(piece_offsets, values[gather].astype(np.int32), pa.int32())
        return pa.table(out)


def plan_routing(plan, example_ids: np.ndarray) -> dict[str, np.ndarray]:
    n = len(example_ids)
    pack_first = np.searchsorted(plan.pack, plan.pack)  # entries are ordered by pack
    by_example = np.argsort(plan.example, kind="stable")
    count = np.bincount(plan.example, minlength=n)
    return {
        "ids": np.asarray(example_ids, dtype=np.int64),
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
    cols = {}
    for col in ("input_ids", "labels"):
        values = pc.list_flatten(pieces[col]).to_numpy(zero_copy_only=False)
        cols[col] = _list_array(row_offsets, values.astype(np.int32), pa.int32())
    return pa.table(
        {
            **cols,
            "position_ids": _list_array(row_offsets, positions.astype(np.int32), pa.int32()),
            "example_ids": _list_array(np.concatenate(([0], np.cumsum(pieces_per_row))),
                                       pieces["example_id"].to_numpy(), pa.int64()),
            "pack": pa.array(pack[heads], pa.int64()),
            "rank": pa.array(pieces["rank"].to_numpy()[heads], pa.int32()),
            "step": pa.array(pieces["step"].to_numpy()[heads], pa.int32()),
            "num_tokens": pa.array(row_tokens, pa.int32()),
        }
    )


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
    row groups of `group_rows` rows."""
    steps = rows["step"].to_numpy()
    have = np.zeros(num_steps, dtype=bool)
    have[steps] = True
    # assemble_rows sorts by pack, which within a rank is step order: sorting again (a copy of
    # every token) is needed only to slot in empty packs, or for rows from elsewhere.
    if not have.all() or (np.diff(steps) < 0).any():
        rows = pa.concat_tables([rows, empty_rows(rank, np.flatnonzero(~have), num_ranks)]).sort_by("step")
    fs, path = storage.resolve(out)  # a local folder or object storage shared by every node
    fs.create_dir(path, recursive=True)
    per_file = max(1, ROWS_PER_FILE // group_rows) * group_rows
    for i in range(0, max(rows.num_rows, 1), per_file):
        name = f"{path}/part-{i // per_file:06d}.parquet"
        pq.write_table(rows.slice(i, per_file), name, filesystem=fs, row_group_size=group_rows)
    return rows.num_rows


def route_block(block: pa.Table, routing: dict[str, np.ndarray], num_ranks: int):
    """One block's pieces, split by rank (a task with num_returns=num_ranks)."""
    pieces = Router(routing)(block)
    rank = pieces["rank"].to_numpy()
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(num_ranks + 1))
    pieces = pieces.take(pa.array(order))
    parts = tuple(pieces.slice(bounds[r], bounds[r + 1] - bounds[r]) for r in range(num_ranks))
    return parts if num_ranks > 1 else parts[0]


def label_tokens(rows: pa.Table) -> int:
    """Label tokens of packed rows that the loss sees: not -100, and not where positions restart
    (collate masks every example start; wrapped_noreset restarts only at a row's start)."""
    labels = pc.list_flatten(rows["labels"]).to_numpy(zero_copy_only=False)
    positions = pc.list_flatten(rows["position_ids"]).to_numpy(zero_copy_only=False)
    return int(((labels != IGNORE_INDEX) & (positions != 0)).sum())


def _rank_rows(rank: int, num_ranks: int, reset: bool, parts) -> pa.Table:
    parts = [t for t in parts if t.num_rows]
    return assemble_rows(pa.concat_tables(parts), reset) if parts else empty_rows(rank, np.zeros(0, np.int64), num_ranks)


def finish_rank_tables(out: str, rank: int, num_steps: int, num_ranks: int, reset: bool, *parts,
                        group_rows: int = ROWS_PER_FILE) -> int:
    return write_rank(_rank_rows(rank, num_ranks, reset, parts), out, rank, num_steps, num_ranks, group_rows)


def _finish_and_count(out: str, rank: int, num_steps: int, num_ranks: int, reset: bool, *parts,
                      group_rows: int = ROWS_PER_FILE) -> tuple[int, int]:
    """Rows written and label tokens, for one rank."""
    rows = _rank_rows(rank, num_ranks, reset, parts)
    return write_rank(rows, out, rank, num_steps, num_ranks, group_rows), label_tokens(rows)


def finish_memory(plan: Plan) -> np.ndarray:
    """Bytes of memory to reserve for each rank's finishing task, so that Ray runs only as many at
    once as the nodes' memory holds (at 1M examples on one 24 GiB machine, all 8 at once ran it
    out of memory). A rank's rows are assembled in one process, at up to FINISH_BYTES_PER_TOKEN;
    capped at what the largest node offers, or the task could never be scheduled."""
    tokens = np.bincount(plan.rank, weights=plan.end - plan.start, minlength=plan.num_ranks)
    largest = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)
    want = tokens * FINISH_BYTES_PER_TOKEN + FINISH_BASE_BYTES
    return np.minimum(want, 0.8 * largest) if largest else want


def materialize(ds: ray.data.Dataset, plan: Plan, example_ids: np.ndarray, out_dir: str,
                group_rows: int = ROWS_PER_FILE) -> dict[str, Any]:
    """Write the packed rows of `plan` under `out_dir/rank=<r>/` (replacing what was there), in
    Parquet row groups of `group_rows` rows (prepare passes whole optimizer steps; the default,
    one group per file, suits a reader that only streams). Returns counts (rows; label tokens
    per rank, which the driver checks before training) and seconds."""
    t0 = time.perf_counter()
    out = out_dir.rstrip("/")
    storage.remove_dir(out)  # write_parquet appends by default; a stale shard would corrupt a rank
    routing = ray.put(plan_routing(plan, example_ids))
    args = (plan.num_steps, plan.num_ranks, plan.reset_positions)
    route = ray.remote(num_cpus=0.5, num_returns=plan.num_ranks)(route_block)
    parts = [route.remote(block, routing, plan.num_ranks) for block in ds.to_arrow_refs()]
    if plan.num_ranks == 1:
        parts = [[p] for p in parts]
    finish = ray.remote(num_cpus=0.5)(_finish_and_count)
    memory = finish_memory(plan)
    done = ray.get([finish.options(memory=int(memory[r])).remote(f"{out}/rank={r}", r, *args, *[p[r] for p in parts],
                                                                 group_rows=group_rows)
                    for r in range(plan.num_ranks)])
    return {"rows": sum(n for n, _ in done), "rank_label_tokens": [t for _, t in done], "method": "routed",
            "seconds": time.perf_counter() - t0}
