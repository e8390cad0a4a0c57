"""Pack stage: routed pieces (no shuffle) against a global shuffle by pack, on the same data and plan.

    python benchmarks/pack_materialize.py                        # 20k FLAN-like examples, budget 2048, 8 ranks
    python benchmarks/pack_materialize.py --n 100000 --out benchmarks/results/pack_materialize_cpu_20261122.md
    python benchmarks/pack_materialize.py --smoke                # 400 examples, 2 ranks, one run: proves the script runs

Every method builds the rows of one global `balanced` plan: raypack's routed pack stage
(raypack/data/pack.py) and the two baselines in benchmarks/pack_baselines.py. The script checks
that they wrote identical rows, then reports wall time and tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from benchmarks.pack_baselines import METHODS, materialize  # noqa: E402
from raypack.config import PackConfig  # noqa: E402
from raypack.data.pack import Router, assemble_rows, plan_routing  # noqa: E402
from raypack.data.shards import iter_rank_packs  # noqa: E402
from raypack.data.strategies import make_plan  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402
from raypack.data.tokenize import lengths_and_ids  # noqa: E402


def tokenized(n: int, budget: int, blocks: int) -> list[pa.Table]:
    """A tokenized dataset as tokenize.py emits it: sparse ids, list<int32> ids and labels."""
    rng = np.random.default_rng(0)
    lengths = sample_lengths("flan", n, seed=0, max_length=budget)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    tokens = rng.integers(0, 32000, size=int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(tokens)) < 0.4, -100, tokens).astype(np.int32)
    table = pa.table(
        {
            "example_id": pa.array(rng.permutation(n).astype(np.int64) * 1024, pa.int64()),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
            "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
            "length": pa.array(lengths.astype(np.int32)),
        }
    )
    step = -(-n // blocks)
    return [table.slice(i, step) for i in range(0, n, step)]


def compute_floor(blocks: list[pa.Table], plan, ids: np.ndarray) -> float:
    """The routed method's work in this process with no Ray at all: what the cluster adds is overhead."""
    t0 = time.perf_counter()
    pieces = pa.concat_tables([Router(plan_routing(plan, ids))(b) for b in blocks])
    rank = pieces["rank"].to_numpy()
    for r in range(plan.num_ranks):
        assemble_rows(pieces.filter(pa.array(rank == r)), plan.reset_positions)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="400 examples, 2 ranks, 4 blocks, one timed run: proves the script runs")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeat", type=int, default=2, help="timed runs per method (after one warm-up pass)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.ranks, args.blocks, args.repeat = 400, 2, 4, 1

    # Workers import benchmarks.pack_baselines by name to run the baselines' map_batches function.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    blocks = tokenized(args.n, args.budget, args.blocks)
    ds = ray.data.from_arrow(blocks).materialize()
    lengths, ids = lengths_and_ids(ds)
    plan = make_plan(lengths, PackConfig(strategy="balanced", budget=args.budget), args.ranks)
    tokens = int(lengths.sum())
    results, outputs = [], {}
    started = host_now()
    # Warm-up: start the worker processes and import everything once, so no method pays for it.
    if not args.smoke:  # a smoke run times nothing worth warming up for
        small = ray.data.from_arrow(tokenized(2000, args.budget, 4)).materialize()
        small_lengths, small_ids = lengths_and_ids(small)
        small_plan = make_plan(small_lengths, PackConfig(strategy="balanced", budget=args.budget), args.ranks)
        for method in args.methods:
            materialize(small, small_plan, small_ids, tempfile.mkdtemp(prefix="pack_warm_"), method=method)
    for i in range(args.repeat):  # interleaved, so a change in the machine's load hits every method
        for method in args.methods:
            out = tempfile.mkdtemp(prefix=f"pack_{method}_")
            info = materialize(ds, plan, ids, out, method=method)
            results.append((method, info["seconds"], info["rows"]))
            outputs[method] = out
            print(f"{method}: {info['seconds']:.2f} s, {info['rows']} rows, {tokens / info['seconds']:,.0f} tokens/s", flush=True)
    floor = compute_floor(blocks, plan, ids)
    print(f"compute floor (route + assemble in one process, no Ray, no writes): {floor:.2f} s")
    first, *rest = outputs.values()
    same = all(
        list(iter_rank_packs(first, r)) == list(iter_rank_packs(other, r)) for other in rest for r in range(args.ranks)
    )
    print("identical rows:", same)
    ray.shutdown()
    if args.out or args.smoke:
        lines = [
            *cpu_header("Pack stage: routed pieces vs global shuffle (CPU)", __file__, argv, args.smoke, started,
                        ("numpy", "pyarrow", "ray"), notes="Local Ray (num_cpus=4 logical); one warm-up pass per "
                        "method first; runs interleaved, so compare methods within the table."),
            "",
            f"Data: {args.n:,} FLAN-like examples, {tokens:,} tokens, {args.blocks} blocks; plan `balanced`, "
            f"budget {args.budget}, {args.ranks} ranks, {plan.num_packs:,} packs.",
            "",
            "| method | seconds | rows | tokens/s |",
            "|---|---|---|---|",
            *[f"| {m} | {s:.2f} | {r:,} | {tokens / s:,.0f} |" for m, s, r in results],
            "",
            f"Rows identical between methods: {same}.",
            "",
            f"Compute floor (the routed method's routing + assembly in one process, no Ray, no Parquet "
            f"writes): {floor:.2f} s. The rest of each time above is Ray scheduling and data movement.",
            "",
        ]
        out = results_path("pack_materialize", args.smoke, args.out)
        out.write_text("\n".join(lines))
        print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
