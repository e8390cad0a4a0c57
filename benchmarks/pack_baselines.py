"""The pack stage's baselines, for benchmarks/pack_materialize.py and its test; raypack uses neither.

Both build the same pieces as raypack/data/pack.py's routed method (its `Router`) and write each
rank's rows with its writer, so the three methods differ only in how tokens reach their rank:

- `routed_files`: the pieces from a Ray Data `map_batches`, written once partitioned by rank
  (`write_parquet(partition_cols=["rank"])`), then assembled per rank from those files.
- `shuffle`: the pieces grouped by pack through Ray Data's `groupby("pack").map_groups()`, a
  global shuffle of every token.

Ray workers import this module by name (`benchmarks.pack_baselines`) to run `_route_with_ref`,
so the repository root must be on their PYTHONPATH.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raypack import storage
from raypack.data import pack
from raypack.data.pack import Router, assemble_rows, empty_rows, finish_rank_tables, plan_routing, write_rank
from raypack.data.plan import Plan

METHODS = ("routed", "routed_files", "shuffle")


def materialize(ds: ray.data.Dataset, plan: Plan, example_ids: np.ndarray, out_dir: str, method: str) -> dict[str, Any]:
    """`raypack.data.pack.materialize` (routed), or one of the baselines; same arguments, same rows."""
    if method == "routed":
        return pack.materialize(ds, plan, example_ids, out_dir)
    if method not in METHODS:
        raise ValueError(f"unknown materialize method {method!r}; expected one of {', '.join(METHODS)}")
    t0 = time.perf_counter()
    out = out_dir.rstrip("/")
    storage.remove_dir(out)  # write_parquet appends by default; a stale shard would corrupt a rank
    routing = ray.put(plan_routing(plan, example_ids))
    pieces = ds.map_batches(_route_with_ref, fn_kwargs={"routing": routing}, batch_format="pyarrow", num_cpus=0.5)
    if method == "routed_files":
        tmp = f"{out}/_pieces"
        pieces.write_parquet(tmp, partition_cols=["rank"])
        finish = ray.remote(num_cpus=0.5)(_finish_rank)
        args = (plan.num_steps, plan.num_ranks, plan.reset_positions)
        rows = sum(ray.get([finish.remote(f"{tmp}/rank={r}", f"{out}/rank={r}", r, *args) for r in range(plan.num_ranks)]))
        storage.remove_dir(tmp)
    else:
        reset = plan.reset_positions
        packed = pieces.groupby("pack").map_groups(lambda t: assemble_rows(t, reset), batch_format="pyarrow")
        by_rank: dict[int, list[pa.Table]] = {r: [] for r in range(plan.num_ranks)}
        for ref in packed.to_arrow_refs():
            table = ray.get(ref)
            if table.num_rows == 0:  # Ray < 2.60 hands an empty shuffle partition over with no columns
                continue
            ranks = table["rank"].to_numpy()
            for r in np.unique(ranks).tolist():
                by_rank[r].append(table.filter(pa.array(ranks == r)))
        rows = 0
        for r, tables in by_rank.items():
            t = pa.concat_tables(tables) if tables else empty_rows(r, np.zeros(0, np.int64), plan.num_ranks)
            rows += write_rank(t, f"{out}/rank={r}", r, plan.num_steps, plan.num_ranks)
    return {"rows": rows, "method": method, "seconds": time.perf_counter() - t0}


def _finish_rank(pieces_dir: str, out: str, rank: int, num_steps: int, num_ranks: int, reset: bool) -> int:
    fs, _ = storage.resolve(pieces_dir)
    tables = [pq.read_table(f, filesystem=fs) for f in storage.list_files(pieces_dir, ".parquet")]
    tables = [t if "rank" in t.column_names else t.append_column("rank", pa.array(np.full(t.num_rows, rank), pa.int32()))
              for t in tables]
    return finish_rank_tables(out, rank, num_steps, num_ranks, reset, *tables)


_ROUTER_CACHE: tuple[Any, Router] | None = None


def _route_with_ref(batch: pa.Table, routing) -> pa.Table:
    # An ObjectRef inside fn_kwargs arrives as a ref (Ray Data does not dereference it); fetch
    # once per worker process and keep it.
    global _ROUTER_CACHE
    key = routing.hex() if hasattr(routing, "hex") else id(routing)
    if _ROUTER_CACHE is None or _ROUTER_CACHE[0] != key:
        _ROUTER_CACHE = (key, Router(ray.get(routing) if hasattr(routing, "hex") else routing))
    return _ROUTER_CACHE[1](batch)
