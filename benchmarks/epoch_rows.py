"""What a new step order per epoch costs, for the ways of storing a rank's packed rows.

    PYTHONPATH=. python benchmarks/epoch_rows.py --out benchmarks/results/epoch_rows_cpu_<date>.md
    PYTHONPATH=. python benchmarks/epoch_rows.py --smoke --out /tmp/epoch_rows.md     # seconds

One rank's packed rows (bfd packs of WildChat-like lengths at `--budget`, random token ids, 30%
of labels masked), written by raypack's own writer (`raypack.data.pack.write_rank`) in four
layouts and read back, on the local disk, in one run:

- `file_groups`: one row group per file of 4096 rows (raypack before epochs had orders). Epoch 1
  streams it; a step in any other order needs its whole 4096-row group (timed on a few steps).
- `step_groups`: one row group per optimizer step, read in a uniformly random order (a reader
  that opens each step's file and reads its row group; footers parsed once per file and kept).
- `window` (raypack's choice): row groups of `group_steps_for(budget, accum)` steps, read with
  `iter_epoch_packs` in epoch 1's plan order and in epoch 2's windowed shuffle.
- `per_epoch`: a new set of rows written every epoch (what `pack.repack_each_epoch` does); its
  cost per epoch is one more write of `window` rows (plus the pack stage, not timed here).

For each: seconds to write, bytes on disk (and the Parquet footers' share), read seconds per step
(Python rows, as the training loop consumes them) and the most Arrow memory the reader held.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from raypack.config import PackConfig  # noqa: E402
from raypack.data.pack import ROWS_PER_FILE, write_rank, assemble_rows  # noqa: E402
from raypack.data.shards import Prepared, group_steps_for, iter_epoch_packs  # noqa: E402
from raypack.data.strategies import make_plan  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402


def rank_rows(steps: int, budget: int, seed: int = 0) -> pa.Table:
    """`steps` packed rows of one rank, as the pack stage assembles them."""
    rng = np.random.default_rng(seed)
    mean = sample_lengths("wildchat", 10_000, seed=seed, max_length=budget).mean()
    lengths = sample_lengths("wildchat", int(1.05 * steps * budget / mean) + 16, seed=seed, max_length=budget)
    plan = make_plan(lengths, PackConfig(strategy="bfd", budget=budget), 1)
    keep = plan.step < steps
    n = int((plan.end - plan.start)[keep].sum())
    offsets = np.concatenate(([0], np.cumsum((plan.end - plan.start)[keep]))).astype(np.int32)
    tokens = rng.integers(0, 50_000, n, dtype=np.int32)
    labels = np.where(rng.random(n) < 0.3, -100, tokens).astype(np.int32)
    pieces = pa.table({
        "pack": plan.pack[keep], "pos": np.arange(int(keep.sum()), dtype=np.int32),
        "step": plan.step[keep].astype(np.int32), "rank": np.zeros(int(keep.sum()), np.int32),
        "example_id": plan.example[keep],
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
    })
    return assemble_rows(pieces, reset_positions=True)


def write(rows: pa.Table, folder: str, steps: int, group_rows: int) -> tuple[float, int, int]:
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    write_rank(rows, f"{folder}/rank=0", 0, steps, 1, group_rows)
    seconds = time.perf_counter() - t0
    files = sorted(Path(f"{folder}/rank=0").glob("*.parquet"))
    footer = sum(pq.read_metadata(f).serialized_size for f in files)
    return seconds, sum(f.stat().st_size for f in files), footer


def read_steps(rows_iter, limit: int | None = None) -> tuple[float, int, int]:
    """(seconds, steps, peak Arrow bytes) to turn rows into Python lists, as the loop does."""
    base, peak, count = pa.total_allocated_bytes(), 0, 0
    t0 = time.perf_counter()
    for row in rows_iter:
        count += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
        if limit and count >= limit:
            break
    return time.perf_counter() - t0, count, peak


def random_step_reader(folder: str, order: np.ndarray):
    """One row group per step, in `order`: open each file once, keep its footer, read one group."""
    files = sorted(Path(f"{folder}/rank=0").glob("*.parquet"))
    opened = [pq.ParquetFile(f) for f in files]
    where = [(i, g) for i, f in enumerate(opened) for g in range(f.metadata.num_row_groups)]
    for s in order.tolist():
        i, g = where[s]
        yield from opened[i].read_row_group(g).to_pylist()


def whole_group_reader(folder: str, order: np.ndarray):
    """file_groups read out of order: each step costs its file's whole row group."""
    files = sorted(Path(f"{folder}/rank=0").glob("*.parquet"))
    for s in order.tolist():
        table = pq.read_table(files[s // ROWS_PER_FILE])
        yield from table.slice(s % ROWS_PER_FILE, 1).to_pylist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8192, help="packed rows of the rank (accum 1)")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="256 steps of 512 tokens: seconds, not results")
    p.add_argument("--out", default=None, help="markdown results file")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.budget = 256, 512
    scratch = args.dir or tempfile.mkdtemp(prefix="epoch_rows_")
    started = host_now()
    rows = rank_rows(args.steps, args.budget)
    assert rows.num_rows == args.steps, rows.num_rows
    steps, group = rows.num_rows, group_steps_for(args.budget, 1)
    shuffled = np.random.default_rng(1).permutation(steps)
    results = []

    def add(layout, write_stats, read_order, secs, count, peak, note=""):
        w, size, footer = write_stats
        results.append(dict(layout=layout, write=w, mb=size / 2**20, footer=footer / max(size, 1),
                            order=read_order, per_step_ms=1e3 * secs / max(count, 1), peak_mb=peak / 2**20, note=note))
        print(results[-1], flush=True)

    stats = write(rows, f"{scratch}/file_groups", steps, ROWS_PER_FILE)
    data = Prepared(root=scratch, fingerprint="", train_dir=f"{scratch}/file_groups", eval_dir=None,
                    steps_per_rank=steps, padded=False, pad_token_id=0, vocab_size=50_000, length_mean=0.0,
                    length_sq_mean=0.0, stats={}, grad_accum=1, group_steps=ROWS_PER_FILE)
    add("file_groups", stats, "plan order", *read_steps(iter_epoch_packs(data, 0, 0)))
    limit = 20 if not args.smoke else 5
    add("file_groups", stats, "random", *read_steps(whole_group_reader(f"{scratch}/file_groups", shuffled), limit),
        note=f"{limit} steps timed")
    stats = write(rows, f"{scratch}/step_groups", steps, 1)
    add("step_groups", stats, "random", *read_steps(random_step_reader(f"{scratch}/step_groups", shuffled)))
    stats = write(rows, f"{scratch}/window", steps, group)
    data = Prepared(**{**data.to_dict(), "train_dir": f"{scratch}/window", "group_steps": group})
    add("window", stats, "plan order (epoch 1)", *read_steps(iter_epoch_packs(data, 0, 0)), note=f"{group} steps a group")
    add("window", stats, "windowed shuffle (epoch 2)", *read_steps(iter_epoch_packs(data, 0, 1)))
    add("per_epoch", stats, "plan order", results[-2]["per_step_ms"] * steps / 1e3, steps, 0,
        note="write and bytes are per epoch: x epochs in all")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out or args.smoke:
        lines = [
            *cpu_header("Epoch orders: storage layouts (CPU, local disk)", __file__, argv, args.smoke, started,
                        ("numpy", "pyarrow")),
            "",
            f"One rank: {steps} packed rows of up to {args.budget} tokens ({int(rows['num_tokens'].to_numpy().sum()):,} "
            "tokens), accum 1.",
            "",
            "| layout | read order | write s | MiB on disk | footer share | read ms / step | reader peak Arrow MiB | note |",
            "|---|---|---|---|---|---|---|---|",
            *[f"| {r['layout']} | {r['order']} | {r['write']:.2f} | {r['mb']:.1f} | {r['footer']:.2%} | "
              f"{r['per_step_ms']:.2f} | {r['peak_mb']:.1f} | {r['note']} |" for r in results],
            "",
        ]
        out = results_path("epoch_rows", args.smoke, args.out)
        out.write_text("\n".join(lines))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
