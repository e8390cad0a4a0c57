"""Run-to-run spread of a sweep's throughput, and what the old single-window figure measured.

    python benchmarks/sweep_spread.py                     # bfd vs balanced, 3 repeats, CPU sweep config
    python benchmarks/sweep_spread.py --config jobs/configs/sweeps/packing.yaml --strategies bfd balanced

Runs `raypack sweep` with `tune.num_samples` repeats of each strategy (same seeds, so the repeats
train the same steps on the same rows and differ only by timing), then compares per trial:

- `run tokens/s`: what the sweep table reports now, real tokens over the run's training wall
  time (steps, data reads, reports, checkpoints; no start-up, no evaluation);
- `steady tokens/s`: the same without the first report window (one-time warm-up: allocator,
  lazy initialisation, first data reads);
- `old tokens/s`: what the table reported before, the last report window's tokens over the
  wall time since the previous report *including* the final evaluation (reconstructed from the
  reported cumulative tokens, training time and evaluation time).

Writes benchmarks/results/sweep_spread_<device>_<date>.md with the command, machine, versions,
per-trial numbers and, per strategy, median [min, max] and the max/min ratio.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from benchmarks.tokenize_throughput import cpu_model  # noqa: E402


def per_trial(row: dict) -> dict:
    h = row["history"]
    last, prev = h[-1], (h[-2] if len(h) > 1 else {"tokens_seen": 0.0, "train_time_s": 0.0, "eval_time_s": 0.0})
    first = h[0]
    window_tokens = last["tokens_seen"] - prev["tokens_seen"]
    window_s = (last["train_time_s"] - prev["train_time_s"]) + (last["eval_time_s"] - prev["eval_time_s"])
    steady_s = last["train_time_s"] - first["train_time_s"]
    return {
        "strategy": row["strategy"],
        "trial": row["trial"],
        "steps": row["steps"],
        "run": row["tokens_per_s"],
        "steady": (last["tokens_seen"] - first["tokens_seen"]) / steady_s if steady_s > 0 else None,
        "old": window_tokens / window_s if window_s > 0 else None,
        "last_window_steps": last["step"] - (prev.get("step") or 0),
        "final_eval_s": last["eval_time_s"] - prev["eval_time_s"],
        "first_window_s": first["train_time_s"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "jobs" / "configs" / "sweeps" / "packing_cpu.yaml"))
    ap.add_argument("--strategies", nargs="+", default=["bfd", "balanced"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--storage", default="/tmp/raypack-bench-sweeps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a --smoke run: 1 repeat of 4 steps at budget 256, to check the script works")
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides")
    args = ap.parse_args(argv)
    started = host_now()
    if args.smoke:
        args.repeats = 1
        args.overrides = ["pack.budget=256", "train.max_steps=4", "train.report_every_steps=2",
                          "train.eval_every_steps=2", *args.overrides]

    from raypack.config import load
    from raypack.tune.sweep import sweep

    name = f"spread-{uuid.uuid4().hex[:6]}"
    overrides = [f"tune.strategies=[{', '.join(args.strategies)}]", f"tune.num_samples={args.repeats}",
                 f"run.storage_path={args.storage}", f"run.name={name}", *args.overrides]
    cfg = load(args.config, overrides)
    t0 = time.perf_counter()
    outcome = sweep(cfg)
    wall = time.perf_counter() - t0
    trials = [per_trial(r) for r in outcome.rows if r["status"] == "OK" and r["history"]]

    device = "gpu" if cfg.train.use_gpu else "cpu"
    out_path = results_path("sweep_spread", args.smoke, args.out)
    lines = [
        *cpu_header(f"Sweep throughput spread, {device.upper()}, {datetime.date.today().isoformat()}", __file__, argv,
                    args.smoke, started, ("ray",), notes=f"CPU: {cpu_model()}. Sweep {name}, {wall:.0f} s."),
        f"Sweep: {cfg.train.num_workers} {'GPU' if cfg.train.use_gpu else 'CPU'} worker(s), budget {cfg.pack.budget}, "
        f"{cfg.train.epochs} epoch(s), a report every {cfg.train.report_every_steps} steps, an eval every "
        f"{cfg.train.eval_every_steps or 'end'}; {args.repeats} repeats per strategy with the same seeds.",
        "",
        "| strategy | trial | steps | run tokens/s | steady tokens/s | old tokens/s (last window + final eval) "
        "| last window steps | final eval s | first window s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def num(v, spec=",.0f"):
        return "-" if v is None else format(v, spec)

    for t in trials:
        lines.append(f"| {t['strategy']} | {t['trial']} | {t['steps']} | {num(t['run'])} | {num(t['steady'])} | "
                     f"{num(t['old'])} | {t['last_window_steps']:.0f} | {t['final_eval_s']:.2f} | {t['first_window_s']:.2f} |")
    lines += ["", "Per strategy, median [min, max] (max/min):", "",
              "| strategy | run tokens/s | steady tokens/s | old tokens/s |", "|---|---|---|---|"]
    medians = {}
    for s in args.strategies:
        cells = []
        for key in ("run", "steady", "old"):
            v = [t[key] for t in trials if t["strategy"] == s and t[key]]
            if not v:
                cells.append("-")
                continue
            medians[(s, key)] = statistics.median(v)
            cells.append(f"{statistics.median(v):,.0f} [{min(v):,.0f}, {max(v):,.0f}] ({max(v) / min(v):.2f}x)")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if len(args.strategies) == 2:
        a, b = args.strategies
        ratios = ", ".join(f"{key} {medians[(a, key)] / medians[(b, key)]:.2f}" for key in ("run", "steady", "old")
                           if (a, key) in medians and (b, key) in medians)
        lines += ["", f"Median ratio {a} / {b}: {ratios}."]
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
