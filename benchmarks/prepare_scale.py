"""`prepare` at 1M to 10M examples against a single-process pyarrow floor, each size in one run.

    PYTHONPATH=. python benchmarks/prepare_scale.py --n 1000000 3000000 10000000 --dir /tmp/ps \
        --out benchmarks/results/prepare_scale_cpu_<date>.md
    PYTHONPATH=. python benchmarks/prepare_scale.py --smoke --out /tmp/prepare_scale.md      # seconds

Input: `--n` pre-tokenized examples (the `tokenized` format: `input_ids` only, so they train on
their ids, stored once) with `--lengths short` (single-turn chats, about 100 tokens on average)
or WildChat-like lengths clipped to `--budget`, random ids, written once per size as Parquet in
`--files` files. Then, for each size, each in its own process, one after the other:

- `raypack`: `raypack.data.prepare.prepare` on a local Ray instance: read and validate, the
  tokenize stage (its rows streamed to Parquet), lengths to the driver, the balanced plan over
  `--ranks` ranks, the routed pack stage and the write of each rank's rows (eval_fraction 0, so
  exactly the floor's work, plus validation and counting).
- `floor`: one process, no Ray: read every file with pyarrow, the same plan (make_plan), and the
  same vectorized routing and row assembly functions (`route_block`, `finish_rank_tables`),
  writing the same rows. It is what the work costs without Ray's distribution (and its ability
  to run on more than one machine).

Measured: wall seconds; CPU seconds (the floor's process; for raypack the driver and every
process of its local Ray instance, from after Ray started, via psutil); the driver's peak
resident memory (getrusage ru_maxrss) and the peak RSS of every other process, polled every
0.5 s with the title Ray gives a worker for the task it runs; the object store's peak bytes in
use and bytes spilled, polled from the raylet (`raypack.raycompat.store_stats_poller`,
the numbers `ray memory --stats-only` prints); the packed output's bytes on disk. The two outputs
are then compared rank by rank (rows, tokens, rows with labels, checksums of input_ids and
labels): the floor must have written the same rows. The report checks issue 25's targets: every
process <= 4 GiB, spilled bytes <= the packed output, CPU seconds <= 2x the floor's.
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


SHORT_CHAT = (70.0, 0.8, 8)
"""(median, lognormal sigma, min) of `--lengths short`: single-turn chats of about 100 tokens on
average, so that 10M examples and their packed rows fit this machine's disk."""


def input_lengths(kind: str, n: int, budget: int, seed: int = 0) -> np.ndarray:
    if kind == "wildchat":
        return sample_lengths("wildchat", n, seed=seed, max_length=budget)
    median, sigma, lo = SHORT_CHAT
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, budget).astype(np.int64)


def make_input(folder: Path, n: int, budget: int, files: int, kind: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = input_lengths(kind, n, budget, seed)
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
                       f"tokenize.num_actors={args.actors}",
                       "data.driver_max_mb=0"])  # Ray's distributed stages, what this measures, even at --smoke


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child_raypack(args, data: str, out: str) -> dict:
    import ray

    from raypack.data.listing import Sources
    from raypack.data.prepare import prepare
    from raypack.raycompat import store_stats_poller
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
    store_stats = store_stats_poller()
    peak = {"used": 0, "spilled": 0}
    processes: dict[int, tuple[int, str]] = {}  # pid -> (peak RSS, what it ran then)
    private: dict[int, int] = {}  # pid -> peak RSS less shared pages (the object store's, mapped)
    done = threading.Event()
    cpu_before = cpu_seconds_of_tree()

    def poll():
        while not done.is_set():
            if store_stats is not None:
                stats = store_stats()
                peak["used"] = max(peak["used"], stats.object_store_bytes_used)
                peak["spilled"] = max(peak["spilled"], stats.spilled_bytes_total)
            for pid, rss, shared, name in child_rss():
                if rss > processes.get(pid, (0, ""))[0]:
                    processes[pid] = (rss, name)
                private[pid] = max(private.get(pid, 0), rss - shared)
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
    top = sorted(processes.values(), reverse=True)
    return {"wall": wall, "cpu": cpu_seconds_of_tree() - cpu_before, "rss_before_mib": before,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_peak_rss_mib": top[0][0] / 2**20 if top else 0.0, "store_peak_mib": peak["used"] / 2**20,
            "spilled_mib": peak["spilled"] / 2**20, "steps": prepared.steps_per_rank,
            "processes": len(processes), "largest": [(round(rss / 2**20), name) for rss, name in top[:6]],
            "worker_peak_private_mib": max(private.values(), default=0) / 2**20}


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


def child_rss() -> list[tuple[int, int, int, str]]:
    """(pid, RSS, shared, title) of every process under this one: Ray names a worker's process
    after the task it runs (`ray::route_file`), so a peak says which stage it belongs to; `shared`
    counts the mapped pages other processes share (the object store's, where Ray's tasks read
    their arguments in place)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())[:48].strip() or p.name()
            mem = p.memory_info()
            out.append((p.pid, mem.rss, mem.shared, title))
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
        # no labels: the row trains on its ids, which tokenize stores once (null labels), as here
        tables.append(t.append_column("example_id", pa.array(eid)).append_column(
            "labels", pa.nulls(t.num_rows, pa.list_(pa.int32()))))
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
            "worker_peak_private_mib": 0.0, "store_peak_mib": 0.0, "spilled_mib": 0.0, "steps": int(plan.num_steps)}


def digest(folder: str, ranks: int) -> list[tuple]:
    """Per rank: rows, tokens, rows with labels of their own, and checksums of input_ids and
    labels weighted by position."""
    out = []
    for r in range(ranks):
        t = pq.read_table(f"{folder}/rank={r}", columns=["step", "input_ids", "labels", "num_tokens"])
        t = t.sort_by("step")
        ids = pc.list_flatten(t["input_ids"]).to_numpy().astype(np.int64)
        labels = pc.list_flatten(t["labels"]).to_numpy().astype(np.int64)
        w = np.arange(max(len(ids), len(labels)), dtype=np.int64) % 1_000_003
        out.append((t.num_rows, int(t["num_tokens"].to_numpy().sum()), t.num_rows - t["labels"].null_count,
                    int((ids * w[:len(ids)]).sum()), int((labels * w[:len(labels)]).sum())))
    return out


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


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


def measure(args, n: int, scratch: Path) -> dict:
    """Both runs at `n` examples, each in its own process: their figures and whether they wrote the same rows."""
    t0 = time.perf_counter()
    marker = scratch / f"input-{n}-{args.budget}-{args.files}-{args.lengths}.json"  # beside, not in, the data
    if marker.exists():  # a --dir kept from an earlier run with the same input
        data = json.loads(marker.read_text())
    else:
        for old in scratch.glob("input-*.json"):
            old.unlink()
        shutil.rmtree(scratch / "input", ignore_errors=True)
        data = make_input(scratch / "input", n, args.budget, args.files, args.lengths)
        marker.write_text(json.dumps(data))
    print(f"input: {data} in {time.perf_counter() - t0:.0f} s", flush=True)
    settings = ["--budget", str(args.budget), "--ranks", str(args.ranks), "--files", str(args.files),
                "--actors", str(args.actors), "--lengths", args.lengths, "--n", str(n), "--dir", str(scratch)]
    results = {}
    for which in ("raypack", "floor"):
        shutil.rmtree(scratch / which, ignore_errors=True)
        cmd = [sys.executable, __file__, *settings, "--child", which]
        code, stdout, stderr = run_guarded(cmd, args.min_free_gib)
        if code:
            print(stdout[-3000:], stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"{which} failed at n={n}")
        results[which] = json.loads(stdout.strip().splitlines()[-1])
        results[which]["packed_mib"] = folder_mib(scratch / which / "train")
        print(which, results[which], flush=True)
    same = digest(str(scratch / "raypack" / "train"), args.ranks) == digest(str(scratch / "floor" / "train"), args.ranks)
    return {"data": data, "results": results, "same": same}


GIB4 = 4 * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1_000_000], help="examples; several: one run each, in order")
    p.add_argument("--lengths", choices=["short", "wildchat"], default="short",
                   help="short: single-turn chats, ~100 tokens on average; wildchat: WildChat-like, clipped to --budget")
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
        args.n, args.files, args.ranks = [2000], 2, 2
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="prepare_scale_"))
    if args.child:  # one measured run in this fresh process; the result goes to stdout's last line
        args.n = args.n[0]
        fn = child_raypack if args.child == "raypack" else child_floor
        print(json.dumps(fn(args, str(scratch / "input"), str(scratch / args.child))))
        return 0
    started = host_now()
    runs = {n: measure(args, n, scratch) for n in args.n}
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    for n, run in runs.items():
        r, f = run["results"]["raypack"], run["results"]["floor"]
        print(f"n={n}: raypack / floor wall {r['wall'] / f['wall']:.2f}x, cpu {r['cpu'] / f['cpu']:.2f}x; "
              f"same rows: {run['same']}")
    if args.out or args.smoke:
        out = results_path("prepare_scale", args.smoke, args.out)
        out.write_text("\n".join(report(args, argv, started, runs)))
        print(f"wrote {out}")
    return 0 if all(run["same"] for run in runs.values()) else 1


def report(args, argv, started, runs: dict[int, dict]) -> list[str]:
    lines = [
        *cpu_header("prepare at scale vs a single-process pyarrow floor (CPU)", __file__, argv, args.smoke, started,
                    ("numpy", "pyarrow", "ray")),
        "",
        f"Plan: balanced, budget {args.budget}, {args.ranks} ranks; input lengths `{args.lengths}` "
        + ("(lognormal, median {:.0f}, sigma {}, at least {} tokens)".format(*SHORT_CHAT) if args.lengths == "short"
           else "(WildChat-like, clipped to the budget)") + f", pre-tokenized, no labels, in {args.files} Parquet files.",
        "",
        "| examples | tokens | run | wall s | CPU s (all processes) | driver peak RSS MiB | largest other process "
        "RSS MiB (largest private) | object store peak MiB | spilled MiB | packed output MiB | steps per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, run in runs.items():
        d = run["data"]
        for k, v in run["results"].items():
            lines.append(f"| {n:,} | {d['tokens']:,} | {k} | {v['wall']:.1f} | {v['cpu']:.0f} | {v['peak_rss_mib']:.0f} | "
                         f"{v['worker_peak_rss_mib']:.0f} ({v['worker_peak_private_mib']:.0f}) | {v['store_peak_mib']:.0f} | "
                         f"{v['spilled_mib']:.0f} | "
                         f"{v['packed_mib']:.0f} | {v['steps']} |")
    lines += ["", "Targets (issue 25), raypack at each size:", "",
              "| examples | every process <= 4 GiB | spilled <= packed output | CPU s <= 2x the floor's | same rows |",
              "|---|---|---|---|---|"]
    for n, run in runs.items():
        r, f = run["results"]["raypack"], run["results"]["floor"]
        biggest = max(r["peak_rss_mib"], r["worker_peak_rss_mib"])
        ok = lambda good: "met" if good else "**missed**"  # noqa: E731
        lines.append(f"| {n:,} | {ok(biggest <= GIB4)} ({biggest:,.0f} MiB) | "
                     f"{ok(r['spilled_mib'] <= r['packed_mib'])} ({r['spilled_mib']:,.0f} of {r['packed_mib']:,.0f} MiB) | "
                     f"{ok(r['cpu'] <= 2 * f['cpu'])} ({r['cpu'] / f['cpu']:.2f}x) | {run['same']} |")
    lines += ["", "The largest processes of each raypack run (peak RSS MiB, and the process title at that peak: Ray "
              "names a worker after the task it runs):", ""]
    for n, run in runs.items():
        r = run["results"]["raypack"]
        lines.append(f"- {n:,} ({r['processes']} processes): " + "; ".join(f"{m:,} `{t}`" for m, t in r["largest"]))
    lines += ["", "CPU s for raypack sums the driver and every process of its local Ray instance (daemons included) "
              "from after Ray started; the floor is one process reading, planning, routing and writing the same "
              "rows with the same functions. Same rows: per rank, rows, tokens, rows with labels of their own, and "
              "checksums of input_ids and labels.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
