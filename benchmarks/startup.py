"""Where `raypack train`'s time before the first step goes, with the worker group started beside
the data preparation (train.overlap_start, the default) and after it, side by side in one run.

    PYTHONPATH=. python benchmarks/startup.py                 # quickstart.yaml, 3 rounds of each, CPU or GPU
    PYTHONPATH=. python benchmarks/startup.py --smoke         # one round of each, 1 step: proves the script runs

Each round runs `raypack train --config jobs/configs/quickstart.yaml train.max_steps=1` twice, as
a user would (a fresh process, a local Ray instance of its own, the data prepared from scratch
under a new run name), once with train.overlap_start=false and once with true, alternating which
goes first; each run's phases come from its raypack_result.json (raypack/train/startup.py).
Reported: the median of each phase and of the total, from the process's start to the first
step's end, per setting, and their ratio. On a shared machine the times are upper bounds; the
ratio, measured in the same rounds, is what to read.
Results: benchmarks/results/startup_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_line, cpu_header, device_name, host_now, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("false", "true")
TOTAL = "to the first step"


def run_once(overlap: str, work: Path, args) -> dict[str, float]:
    """One `raypack train` in a fresh process; its start-up phases."""
    name = f"startup-{overlap}-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "raypack.cli", "train", "--config", str(REPO / "jobs/configs/quickstart.yaml"),
           f"run.storage_path={work}", f"run.name={name}", "train.max_steps=1", f"train.overlap_start={overlap}",
           "data.eval_fraction=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode:
        raise SystemExit(f"overlap_start={overlap} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    phases = json.loads((work / name / "raypack_result.json").read_text())["startup_s"]
    print(f"overlap_start={overlap}: {phases}", flush=True)
    return phases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one round of each: proves the script runs")
    p.add_argument("--rounds", type=int, default=None, help="runs of each setting (default 3; smoke 1)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.smoke else 3)
    started = host_now()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        for r in range(rounds):
            for overlap in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
                runs[overlap].append(run_once(overlap, Path(tmp), args))
    phases = [k for k in runs["false"][0] if k != TOTAL] + [TOTAL]
    median = {s: {k: statistics.median(run.get(k, 0.0) for run in runs[s]) for k in phases} for s in SETTINGS}
    lines = [
        *cpu_header(f"raypack train's start-up, the worker group started beside the data preparation or after it, "
                    f"{device_name()}, {time.strftime('%Y-%m-%d')}", __file__, argv, args.smoke, started,
                    ("ray", "deepspeed", "torch")),
        "",
        f"`raypack train --config jobs/configs/quickstart.yaml train.max_steps=1 data.eval_fraction=0`, {rounds} "
        "round(s), each running both settings in a fresh process (alternating which goes first). Median seconds "
        "per phase (raypack/train/startup.py; with overlap the data preparation runs beside the worker group, "
        "worker imports and waiting for data, so the phases add up to more than the total).",
        "",
        "| phase | overlap_start: false | overlap_start: true |",
        "|---|---|---|",
        *[f"| {k} | {median['false'][k]:.1f} | {median['true'][k]:.1f} |" for k in phases],
        "",
        f"- total to the first step, overlap / sequential: **{median['true'][TOTAL] / median['false'][TOTAL]:.2f}x** "
        f"(each round's: {', '.join(f'{t[TOTAL] / f[TOTAL]:.2f}' for f, t in zip(runs['false'], runs['true']))})",
        "",
    ]
    write_results("startup", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
