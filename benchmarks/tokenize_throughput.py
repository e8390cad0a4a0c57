"""Tokenization throughput: raypack's Ray Data stage against `datasets.Dataset.map(num_proc=cores)`.

    python benchmarks/tokenize_throughput.py -n 20000            # writes benchmarks/results/tokenize_cpu_<date>.md
    python benchmarks/tokenize_throughput.py --smoke             # 200 chats, one run a side: proves the script runs

Both sides run the same per-batch work (raypack.data.encode.Encoder: chat template, assistant
mask, EOS) with the same tokenizer on the same synthetic chat JSONL, one process per core:

- raypack: `tokenize_dataset` end to end (read + validate + ids + tokenize + counts, the rows
  written to Parquet as prepare writes them), `tokenize.num_actors` = cores, fractional CPUs.
  Actor start-up is in every run; its CPU seconds are reported by process.
- datasets: `load_dataset("json")` into a fresh cache, then `map(batched=True, num_proc=cores)`.

The sides alternate, twice each (once with --smoke), so that other jobs on a shared host weigh on both.

Ray start-up (`ray.init`) is excluded; the ratio is per core (both sides use every core).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from raypack.config import ASSETS, Config, DataConfig, TokenizeConfig  # noqa: E402
from raypack.data.synthetic import make_examples  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_datasets(path: str, tokenizer: str, cores: int, batch_size: int, cache: str) -> tuple[float, float, int, int]:
    import datasets

    from raypack.data.encode import Encoder

    datasets.disable_progress_bars()
    enc = Encoder(tokenizer, None, "auto", "truncate", 1 << 30)

    def fn(batch):
        # the rows as raypack's sources hand them over: each chat as JSON, no tools column
        out = enc.encode_chat([json.dumps(m) for m in batch["messages"]], [None] * len(batch["messages"]))
        return {"input_ids": [i for i, _ in out], "labels": [l for _, l in out], "length": [len(i) for i, _ in out]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)
    t1 = time.perf_counter()
    out = ds.map(fn, batched=True, batch_size=batch_size, num_proc=cores, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, len(out), int(sum(out["length"]))


def run_ray(path: str, tokenizer: str, cores: int, batch_size: int, out_dir: str) -> tuple[float, int, int, dict]:
    from raypack.data.listing import Sources
    from raypack.data.tokenize import tokenize_dataset

    cfg = Config(
        data=DataConfig(paths=(path,)),
        tokenize=TokenizeConfig(tokenizer=tokenizer, max_length=1 << 20, batch_size=batch_size, num_actors=cores, num_cpus=0.5),
    )
    watch = CpuByTitle()
    t0 = time.perf_counter()
    with watch:  # the rows go where prepare puts them: Parquet files, as datasets' map writes Arrow files
        _, stats = tokenize_dataset(cfg, Sources.of(cfg.data.paths), out_dir=out_dir)
    dt = time.perf_counter() - t0
    return dt, stats.examples_out, stats.tokens, watch.seconds


KINDS = ("tokenizing (the actors' batches)", "tokenizer actors starting (constructor)",
         "idle workers (process start, imports)", "reading the JSONL", "writing Parquet", "driver", "Ray's own processes")


def kinds(seconds: dict[str, float]) -> dict[str, float]:
    """CpuByTitle's seconds grouped into KINDS."""
    out: dict[str, float] = {}
    for title, sec in seconds.items():
        kind = (KINDS[1] if title.startswith("ray::MapWorker") and title.endswith("__init__")
                else KINDS[0] if title.startswith("ray::MapWorker") else KINDS[2] if title == "ray::IDLE"
                else KINDS[3] if "read" in title.lower() else KINDS[4] if title == "ray::Write"
                else KINDS[5] if title == "driver" else KINDS[6])
        out[kind] = out.get(kind, 0.0) + sec
    return out


class CpuByTitle:
    """CPU seconds of this process and every process under it (a local Ray instance's), by what
    each was doing: Ray titles a worker after the task or actor it runs (`ray::MapWorker(...)`), so
    polling every 0.5 s attributes each interval's CPU to the title seen at its end."""

    def __init__(self):
        import psutil

        self.psutil, self.seconds, self.last = psutil, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _poll(self) -> None:
        for p in [self.psutil.Process(), *self.psutil.Process().children(recursive=True)]:
            try:
                t = p.cpu_times()
                used = t.user + t.system
                title = (" ".join(p.cmdline()) or p.name()).split(" ")[0][:60] if p.pid != os.getpid() else "driver"
            except self.psutil.Error:
                continue
            delta = used - self.last.get(p.pid, used if p.pid in self.last else 0.0)
            self.last[p.pid] = used
            self.seconds[title] = self.seconds.get(title, 0.0) + max(delta, 0.0)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def __enter__(self):
        self._poll()
        self.seconds.clear()  # from now on
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="200 chats, one core, one run a side: proves the script runs")
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--kind", default="flan", help="length distribution of the synthetic chats")
    ap.add_argument("--tokenizer", default=str(ASSETS / "tokenizer"))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=2, help="runs a side, alternating")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = host_now()
    if args.smoke:
        args.n, args.cores = 200, 1
    runs = 1 if args.smoke else args.rounds
    out_path = results_path("tokenize", args.smoke, args.out)

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chat.jsonl")
        with open(path, "w") as f:
            for rec in make_examples("chat", args.n, seed=0, kind=args.kind):
                f.write(json.dumps(rec) + "\n")

        # Alternate the two sides so that load from other jobs on a shared host drifts onto both.
        ds_runs, ray_runs, cpu_runs = [], [], []
        for i in range(runs):
            ds_total, ds_map, ds_rows, ds_tokens = run_datasets(path, args.tokenizer, args.cores, args.batch_size, os.path.join(tmp, f"hf{i}"))
            ds_runs.append((ds_total, ds_map))
            print(f"datasets: {ds_rows} rows, {ds_tokens} tokens, load+map {ds_total:.2f} s (map {ds_map:.2f} s)")
            # A fresh Ray instance per run (and none while datasets forks its workers).
            ray.init(address="local", num_cpus=max(4, args.cores * 2), include_dashboard=False, log_to_driver=False)
            ray.data.DataContext.get_current().enable_progress_bars = False
            dt, rows, tokens, cpu = run_ray(path, args.tokenizer, args.cores, args.batch_size, os.path.join(tmp, f"rp{i}"))
            ray.shutdown()
            ray_runs.append(dt)
            cpu_runs.append(cpu)
            print(f"raypack:  {rows} rows, {tokens} tokens, {dt:.2f} s; CPU s by process: {cpu}")
    assert rows == ds_rows and tokens == ds_tokens, "the two sides disagree on the output"

    best = min(ray_runs)
    lines = [
        *cpu_header(f"Tokenization throughput, CPU, {datetime.date.today().isoformat()}", __file__, argv, args.smoke,
                    started, ("ray", "datasets", "transformers", "tokenizers"),
                    notes=f"CPU: {cpu_model()}. Compare within this run only."),
        f"Data: {rows} synthetic chats (`{args.kind}` lengths), {tokens} tokens, bundled BPE tokenizer (vocab 768), "
        f"batch size {args.batch_size}, {args.cores} processes each side.",
        "",
        "| run | seconds | rows/s | tokens/s | rows/s per core |",
        "|---|---|---|---|---|",
    ]
    for i, (ds_total, ds_map) in enumerate(ds_runs):
        lines.append(f"| datasets load_dataset + map(num_proc={args.cores}), run {i + 1} | {ds_total:.2f} | {rows / ds_total:,.0f} | {tokens / ds_total:,.0f} | {rows / ds_total / args.cores:,.0f} |")
        lines.append(f"| datasets map only, run {i + 1} | {ds_map:.2f} | {rows / ds_map:,.0f} | {tokens / ds_map:,.0f} | {rows / ds_map / args.cores:,.0f} |")
    for i, dt in enumerate(ray_runs):
        lines.append(f"| raypack tokenize_dataset, run {i + 1} | {dt:.2f} | {rows / dt:,.0f} | {tokens / dt:,.0f} | {rows / dt / args.cores:,.0f} |")
    lines += [
        "",
        f"Per-core throughput ratio, raypack best run / datasets best load+map: **{min(t for t, _ in ds_runs) / best:.2f}x**; "
        f"/ datasets best map only: **{min(m for _, m in ds_runs) / best:.2f}x**.",
        "",
        "raypack's time also covers what the datasets side skips: row validation with file:line errors, "
        "stable example ids, over-length handling and the counting pass over every row. "
        "Ray start-up (`ray.init`) is not counted; tokenizer actor start-up is. Both sides write their "
        "rows to disk: datasets' map its Arrow cache files, raypack the Parquet files prepare packs from.",
        "",
        "Where raypack's CPU seconds went, by what each process was doing (Ray titles a worker after the task "
        "or actor it runs; polled every 0.5 s):",
        "",
        "| what | " + " | ".join(f"run {i + 1}" for i in range(len(cpu_runs))) + " |",
        "|---|" + "---|" * len(cpu_runs),
    ]
    grouped = [kinds(cpu) for cpu in cpu_runs]
    for kind in KINDS:
        lines.append(f"| {kind} | " + " | ".join(f"{g.get(kind, 0.0):.1f}" for g in grouped) + " |")
    lines.append("| all | " + " | ".join(f"{sum(g.values()):.1f}" for g in grouped) + " |")
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
