"""`prepare` at a million examples against a single-process pyarrow floor, in one run.

    PYTHONPATH=. python benchmarks/prepare_scale.py --out benchmarks/results/prepare_scale_cpu_<date>.md
    PYTHONPATH=. python benchmarks/prepare_scale.py --smoke --out /tmp/prepare_scale.md      # seconds

Input: `--n` pre-tokenized examples (the `tokenized` format: `input_ids` only, so labels are the
ids) with WildChat-like lengths (raypack.data.synthetic, clipped to `--budget`), random ids,
written once as Parquet in `--files` files. Then, each in its own process, one after the other:

- `raypack`: `raypack.data.prepare.prepare` on a local Ray instance: read and validate, the
  tokenize stage, lengths to the driver, the balanced plan over `--ranks` ranks, the routed pack
  stage and the write of each rank's rows (eval_fraction 0, so exactly the floor's work, plus
  validation and counting).
- `floor`: one process, no Ray: read every file with pyarrow, the same plan (make_plan), and the
  same vectorized routing and row assembly functions (`route_block`, `finish_rank_tables`),
  writing the same rows. It is what the work costs without Ray's distribution (and its ability
  to run on more than one machine).

Measured: wall seconds; CPU seconds (the floor's process; for raypack the driver and every
process of its local Ray instance, from after Ray started, via psutil); the driver's peak resident memory (getrusage ru_maxrss of that process:
Ray's workers are other processes, the floor has only the one) and its resident memory before the
work (imports, Ray start); the largest RSS of any Ray worker (polled); the object store's peak bytes in use and bytes spilled, polled every
0.5 s from the raylet (`ray._private.internal_api.get_memory_info_reply`, the numbers `ray memory
--stats-only` prints). The two outputs are then compared rank by rank (row count, tokens, a
checksum of input_ids and labels): the floor must have written the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from raypack.config import load  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402


def make_input(folder: Path, n: int, budget: int, files: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = sample_lengths("wildchat", n, seed=seed, max_length=budget)
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(lengths, files)):
        offsets = np.concatenate(([0], np.cumsum(part))).astype(np.int32)
        values = rng.integers(0, 4000, int(offsets[-1]), dtype=np.int32)
        table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
        pq.write_table(table, folder / f"part-{i:04d}.parquet", row_group_size=max(1, len(part) // 4))
    return {"examples": int(n), "tokens": int(lengths.sum()),
            "input_mib": sum(f.stat().st_size for f in folder.glob("*.parquet")) / 2**20}


def config(args, data: str):
    return load(None, [f"data.paths=[{data}]", "data.format=tokenized", "data.eval_fraction=0",
                       f"pack.budget={args.budget}", "pack.strategy=balanced", f"train.num_workers={args.ranks}",
                       f"tokenize.num_actors={args.actors}"])


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child_raypack(args, data: str, out: str) -> dict:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    from raypack.data.listing import Sources
    from raypack.data.prepare import prepare
    from raypack.runtime import init_ray

    for attempt in range(3):  # Ray gives its raylet 30 s to register, which a loaded host can miss
        try:
            init_ray()
            break
        except Exception:
            if attempt == 2:
                raise
            ray.shutdown()
            time.sleep(10)
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    peak = {"used": 0, "spilled": 0, "worker_rss": 0}
    done = threading.Event()
    cpu_before = cpu_seconds_of_tree()

    def poll():
        while not done.is_set():
            stats = get_memory_info_reply(state).store_stats
            peak["used"] = max(peak["used"], stats.object_store_bytes_used)
            peak["spilled"] = max(peak["spilled"], stats.spilled_bytes_total)
            peak["worker_rss"] = max([peak["worker_rss"], *largest_child_rss()])
            done.wait(0.5)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    before = rss_mib()
    t0 = time.perf_counter()
    cfg = config(args, data)
    prepared = prepare(cfg, args.ranks, out, Sources.of(cfg.data.paths))
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    return {"wall": wall, "cpu": cpu_seconds_of_tree() - cpu_before, "rss_before_mib": before,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_peak_rss_mib": peak["worker_rss"] / 2**20, "store_peak_mib": peak["used"] / 2**20,
            "spilled_mib": peak["spilled"] / 2**20, "steps": prepared.steps_per_rank}


def cpu_seconds_of_tree() -> float:
    """User + system CPU seconds of this process and every process under it (the local Ray
    instance's daemons and workers), including their reaped children."""
    import psutil

    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass  # exited between listing and asking
    return total


def largest_child_rss() -> list[int]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append(p.memory_info().rss)
        except psutil.Error:
            pass
    return out


def child_floor(args, data: str, out: str) -> dict:
    from raypack.data.pack import finish_rank_tables, plan_routing, route_block
    from raypack.data.shards import group_steps_for
    from raypack.data.sources import example_id
    from raypack.data.strategies import make_plan

    cfg = config(args, data)
    before = rss_mib()
    t0, cpu0 = time.perf_counter(), time.process_time()
    files = sorted(Path(data).glob("*.parquet"))
    tables, ids, lengths = [], [], []
    for i, f in enumerate(files):
        t = pq.read_table(f)
        rows = np.arange(t.num_rows, dtype=np.int64)
        eid = (i << 42) | (rows << 10)  # raypack.data.sources.example_id, vectorized
        assert int(eid[-1]) == example_id(i, t.num_rows - 1)
        n = pc.list_value_length(t["input_ids"]).to_numpy().astype(np.int64)
        tables.append(t.append_column("example_id", pa.array(eid)).append_column("labels", t["input_ids"]))
        ids.append(eid)
        lengths.append(n)
    ids, lengths = np.concatenate(ids), np.concatenate(lengths)
    plan = make_plan(lengths, cfg.pack, args.ranks, cfg.train.grad_accum)
    routing = plan_routing(plan, ids)
    parts = []
    while tables:  # route file by file, dropping each file's tokens once routed
        routed = route_block(tables.pop(0), routing, args.ranks)
        parts.append(list(routed) if args.ranks > 1 else [routed])
    group_rows = group_steps_for(cfg.pack.budget, cfg.train.grad_accum) * cfg.train.grad_accum
    for r in range(args.ranks):
        finish_rank_tables(f"{out}/train/rank={r}", r, plan.num_steps, args.ranks, plan.reset_positions,
                            *[p[r] for p in parts], group_rows=group_rows)
        for p in parts:
            p[r] = None  # this rank's pieces are written
    wall = time.perf_counter() - t0
    return {"wall": wall, "cpu": time.process_time() - cpu0, "rss_before_mib": before,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "worker_peak_rss_mib": 0.0,
            "store_peak_mib": 0.0, "spilled_mib": 0.0, "steps": int(plan.num_steps)}


def digest(folder: str, ranks: int) -> list[tuple]:
    """Per rank: rows, tokens, and checksums of input_ids and labels weighted by position."""
    out = []
    for r in range(ranks):
        t = pq.read_table(f"{folder}/rank={r}", columns=["step", "input_ids", "labels", "num_tokens"])
        t = t.sort_by("step")
        ids = pc.list_flatten(t["input_ids"]).to_numpy().astype(np.int64)
        labels = pc.list_flatten(t["labels"]).to_numpy().astype(np.int64)
        w = np.arange(len(ids), dtype=np.int64) % 1_000_003
        out.append((t.num_rows, int(t["num_tokens"].to_numpy().sum()), int((ids * w).sum()), int((labels * w).sum())))
    return out


def run_guarded(cmd: list[str], min_free_gib: float) -> tuple[int, str, str]:
    """Run one measured child; stop it and every process under it (its Ray instance) if the host's
    available memory falls under `min_free_gib`: the host is shared, and a benchmark must not
    push other jobs into the OOM killer."""
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
        while proc.poll() is None:
            if psutil.virtual_memory().available < min_free_gib * 2**30:
                tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
                for p in tree:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                proc.wait()
                raise SystemExit(f"stopped: the host had less than {min_free_gib} GiB available")
            time.sleep(2)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--actors", type=int, default=2, help="tokenize.num_actors")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir, removed after)")
    p.add_argument("--min-free-gib", type=float, default=1.5, help="stop a run when the host has less available")
    p.add_argument("--smoke", action="store_true", help="2,000 examples: seconds, not results")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["raypack", "floor"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.files, args.ranks = 2000, 2, 2
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="prepare_scale_"))
    if args.child:  # one measured run in this fresh process; the result goes to stdout's last line
        fn = child_raypack if args.child == "raypack" else child_floor
        print(json.dumps(fn(args, str(scratch / "input"), str(scratch / args.child))))
        return 0
    started = host_now()
    t0 = time.perf_counter()
    marker = scratch / f"input-{args.n}-{args.budget}-{args.files}.json"  # beside, not in, the data
    if marker.exists():  # a --dir kept from an earlier run with the same input
        data = json.loads(marker.read_text())
    else:
        shutil.rmtree(scratch / "input", ignore_errors=True)
        data = make_input(scratch / "input", args.n, args.budget, args.files)
        marker.write_text(json.dumps(data))
    print(f"input: {data} in {time.perf_counter() - t0:.0f} s", flush=True)
    given = argv if argv is not None else sys.argv[1:]
    forwarded = [a for i, a in enumerate(given) if a != "--out" and not a.startswith("--out=")
                 and (i == 0 or given[i - 1] != "--out")]
    results = {}
    for which in ("raypack", "floor"):
        shutil.rmtree(scratch / which, ignore_errors=True)
        cmd = [sys.executable, __file__, *forwarded, "--dir", str(scratch), "--child", which]
        code, stdout, stderr = run_guarded(cmd, args.min_free_gib)
        if code:
            print(stdout[-3000:], stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"{which} failed")
        results[which] = json.loads(stdout.strip().splitlines()[-1])
        print(which, results[which], flush=True)
    same = digest(str(scratch / "raypack" / "train"), args.ranks) == digest(str(scratch / "floor" / "train"), args.ranks)
    ratio = results["raypack"]["wall"] / results["floor"]["wall"]
    cpu_ratio = results["raypack"]["cpu"] / results["floor"]["cpu"]
    print(f"raypack / floor wall: {ratio:.2f}x, cpu {cpu_ratio:.2f}x; same rows: {same}")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out or args.smoke:
        rows = [f"| {k} | {v['wall']:.1f} | {v['cpu']:.0f} | {v['rss_before_mib']:.0f} | {v['peak_rss_mib']:.0f} | "
                f"{v['worker_peak_rss_mib']:.0f} | {v['store_peak_mib']:.0f} | {v['spilled_mib']:.0f} | {v['steps']} |"
                for k, v in results.items()]
        lines = [
            *cpu_header("prepare at scale vs a single-process pyarrow floor (CPU)", __file__, argv, args.smoke, started,
                        ("numpy", "pyarrow", "ray")),
            "",
            f"Input: {data['examples']:,} pre-tokenized examples, {data['tokens']:,} tokens (WildChat-like lengths clipped "
            f"to {args.budget}), {data['input_mib']:.0f} MiB of Parquet in {args.files} files; plan: balanced, budget "
            f"{args.budget}, {args.ranks} ranks.",
            "",
            "| run | wall s | CPU s (all processes) | driver RSS before MiB | driver peak RSS MiB | largest worker RSS MiB "
            "| object store peak MiB | spilled MiB | steps per rank |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"raypack / floor: wall **{ratio:.2f}x**, CPU seconds **{cpu_ratio:.2f}x**. Same rows written (per rank: "
            f"rows, tokens, checksums of input_ids and labels): **{same}**. CPU s for raypack sums the driver and "
            "every process of its local Ray instance (daemons included) from after Ray started; on a loaded host "
            "the wall ratio favours the many-process run, so the CPU ratio is the fairer one.",
            "",
        ]
        out = results_path("prepare_scale", args.smoke, args.out)
        out.write_text("\n".join(lines))
        print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
