"""Where `raypack train`'s time before the first step goes, and the two start-up changes of issue
35, each side by side in one run:

    PYTHONPATH=. python benchmarks/startup.py              # 3 rounds of each comparison, CPU or GPU
    PYTHONPATH=. python benchmarks/startup.py --smoke      # one round, warm extensions only: proves it runs

1. DeepSpeed's initialization as a raypack worker runs it (`setup_engine` on tiny-llama, ZeRO-2,
   one gloo rank, DeepSpeed's CPU accelerator), with DeepSpeed's shared-memory all-reduce built (its
   default: a JIT C++ build after probing every op's compiler) or skipped (raypack's
   `engine.skip_shm_build`), each in a fresh process, with a fresh extensions folder (a first run,
   or a new venv) and with a warm one (a later run).
2. `raypack train --config jobs/configs/quickstart.yaml train.max_steps=1` with
   train.overlap_start false and true (the worker group started after the data preparation, or
   beside it), each a fresh process with its own local Ray instance and data prepared from
   scratch; the phases come from its raypack_result.json (raypack/train/startup.py).

3. With --revs A B ...: `raypack train` as in 2 (its defaults), at each of the given commits
   (`.`: this working tree), each a fresh process, a fresh local Ray instance and data prepared
   from scratch; with the commits of successive start-up cuts, each cut's part in the whole
   (issue 40). Each commit's tree is exported (`git archive`) to a temporary folder and run from
   there. Its own phases, and the CPU seconds of every process of the run (the command and the
   local Ray instance's processes, summed: on a few cores, what the start-up waits for).

       PYTHONPATH=. python benchmarks/startup.py --revs 9fe0b3e HEAD~1 . --rounds 3

Each round runs every side once, alternating which goes first (with --revs, reversing the order). Reported: medians, and each
round's ratio. On a shared machine the times are upper bounds; the ratios, measured in the same
rounds, are what to read. Results: benchmarks/results/startup_<device>_<date>.md.
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

from benchmarks.common import cpu_header, device_name, host_now, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("false", "true")
TOTAL = "to the first step"


DS_INIT = """
import os, sys, tempfile, time
os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
from raypack.config import TrainConfig
from raypack.model.build import load_model
from raypack.train.engines import deepspeed_engine as engine
if sys.argv[1] == "built":
    engine.skip_shm_build = lambda: None  # DeepSpeed's own behaviour
model = load_model("tiny-llama")
t0 = time.perf_counter()
engine.setup_engine(model, TrainConfig(num_workers=1, zero_stage=2, deepspeed_preset="zero2"), dtype=torch.float32,
                    world_size=1, total_steps=1)
print("RESULT", time.perf_counter() - t0)
"""


def deepspeed_init(side: str, extensions: str, cache: str, args) -> float:
    """Seconds of `setup_engine` in a fresh process, DeepSpeed's shm all-reduce `built` or `skipped`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": extensions}
    proc = subprocess.run([sys.executable, "-c", DS_INIT, side], cwd=REPO, capture_output=True, text=True,
                          timeout=args.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"DeepSpeed init ({side}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seconds = float(lines[-1].split()[1])
    print(f"DeepSpeed init, shm all-reduce {side}, {cache} extensions folder: {seconds:.1f} s", flush=True)
    return seconds


def quickstart_once(launcher: list[str], tree: Path, work: Path, label: str, args, *overrides: str):
    """One `raypack train` of `tree`'s quickstart, one step, in a fresh process (`launcher`: the
    Python arguments that run the CLI): its start-up phases, and the process's stdout."""
    name = f"startup-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, *launcher, "train", "--config", str(tree / "jobs/configs/quickstart.yaml"),
           f"run.storage_path={work}", f"run.name={name}", "train.max_steps=1", "data.eval_fraction=0", *overrides]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode:
        raise SystemExit(f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((work / name / "raypack_result.json").read_text())["startup_s"], proc.stdout


def raypack_train(overlap: str, work: Path, args) -> dict[str, float]:
    """One `raypack train` in a fresh process; its start-up phases."""
    label = f"overlap_start={overlap}"
    phases, _ = quickstart_once(["-m", "raypack.cli"], REPO, work, label, args, f"train.overlap_start={overlap}")
    print(f"{label}: {phases}", flush=True)
    return phases


CPU_PROBE = """
import os, runpy, sys, threading, time, psutil
me, seen = psutil.Process(), {}
def sample():  # every process of the run: the command's and its local Ray instance's
    while True:
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                seen[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        time.sleep(0.25)
threading.Thread(target=sample, daemon=True).start()
sys.argv = ["raypack", *sys.argv[1:]]
try:
    runpy.run_module("raypack.cli", run_name="__main__")
finally:
    print("CPU_S", sum(seen.values()), flush=True)
"""


def export_tree(rev: str, work: Path) -> Path:
    """`rev`'s files in a folder of their own (`.`: this working tree as it is)."""
    if rev == ".":
        return REPO
    folder = work / f"tree-{rev.replace('/', '_').replace('~', '-')}"
    if not folder.exists():
        folder.mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def raypack_train_at(rev: str, tree: Path, work: Path, args) -> dict[str, float]:
    """One `raypack train` (the quickstart, one step) run from `tree`: its start-up phases, and the
    CPU seconds of all its processes until it exited (sampled every 0.25 s: a lower bound)."""
    phases, stdout = quickstart_once(["-c", CPU_PROBE], tree, work, rev, args)
    phases["CPU seconds, all processes"] = float(stdout.rsplit("CPU_S", 1)[1].split()[0])
    print(f"{rev}: {phases}", flush=True)
    return phases


def revisions_section(revs: list[str], runs: dict[str, list], rounds: int) -> list[str]:
    """The --revs table: median phases per commit, then each commit's total over the first's and
    over the one before it, per round."""
    cpu = "CPU seconds, all processes"
    keys = [k for k in runs[revs[0]][0] if k not in (TOTAL, cpu)] + [TOTAL, cpu]
    med = {r: {k: statistics.median(run.get(k, 0.0) for run in runs[r]) for k in keys} for r in revs}
    names = {r: (subprocess.run(["git", "log", "-1", "--format=%h %s", r], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()[:90] if r != "." else "this working tree") for r in revs}
    out = [f"## Start-up at each commit, {rounds} round(s)", "",
           "`raypack train --config jobs/configs/quickstart.yaml train.max_steps=1 data.eval_fraction=0` at each "
           "commit, each run a fresh process with its own local Ray instance and data prepared from scratch. Median "
           "seconds per phase (raypack/train/startup.py), and the CPU seconds of the command's and its Ray "
           "instance's processes (sampled every 0.25 s).", "",
           *[f"- `{r}`: {names[r]}" for r in revs], "",
           "| phase | " + " | ".join(f"`{r}`" for r in revs) + " |", "|---|" + "---|" * len(revs),
           *[f"| {k} | " + " | ".join(f"{med[r][k]:.1f}" for r in revs) + " |" for k in keys], ""]
    for i, r in enumerate(revs[1:], 1):
        bases = [(revs[0], "the first")] + ([(revs[i - 1], "the one before")] if i > 1 else [])
        for base, what in bases:
            for k in (TOTAL, cpu):
                per = ", ".join(f"{a[k] / b[k]:.2f}" for a, b in zip(runs[r], runs[base]))
                out.append(f"- `{r}` over {what} (`{base}`), {k}: **{med[r][k] / med[base][k]:.2f}x** (rounds: {per})")
    return out + [""]


def alternate(sides: tuple[str, ...], rounds: int, fn) -> dict[str, list]:
    out: dict[str, list] = {side: [] for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            out[side].append(fn(side))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one round of each: proves the script runs")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each comparison (default 3; smoke 1)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    p.add_argument("--revs", nargs="+", default=None, metavar="REV",
                   help="compare the start-up at these commits (`.`: this working tree) instead of 1 and 2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.smoke else 3)
    started = host_now()
    if args.revs:
        return compare_revisions(args, argv, rounds, started)
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        work = Path(tmp)
        ds = {}
        # --smoke: the warm case alone, in the extensions folder the tests share (no 60 s build)
        shared = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
        for cache in ("warm",) if args.smoke else ("fresh", "warm"):
            folders = {side: work / f"ext-{side}-{cache}" for side in ("built", "skipped")}
            if args.smoke:
                folders = {side: Path(shared) for side in folders}
            elif cache == "warm":  # one run of each side fills its own folder first
                for side, folder in folders.items():
                    deepspeed_init(side, str(folder), "filling the warm", args)
            ds[cache] = alternate(("built", "skipped"), rounds, lambda side, c=cache, f=folders: deepspeed_init(
                side, str(f[side] if c == "warm" else work / f"ext-{side}-{uuid.uuid4().hex[:6]}"), c, args))
        runs = alternate(SETTINGS, rounds, lambda overlap: raypack_train(overlap, work, args))
    phases = [k for k in runs["false"][0] if k != TOTAL] + [TOTAL]
    median = {s: {k: statistics.median(run.get(k, 0.0) for run in runs[s]) for k in phases} for s in SETTINGS}
    lines = [
        *cpu_header(f"raypack train's start-up: DeepSpeed's shm all-reduce, and the worker group beside the data "
                    f"preparation, {device_name()}, {time.strftime('%Y-%m-%d')}", __file__, argv, args.smoke, started,
                    ("ray", "deepspeed", "torch")),
        "",
        f"## DeepSpeed init in a raypack worker (`setup_engine`, tiny-llama, ZeRO-2, one rank), {rounds} round(s)",
        "",
        "| extensions folder | shm all-reduce built (DeepSpeed's default) | skipped (raypack) | skipped / built |",
        "|---|---|---|---|",
        *[f"| {cache} | {statistics.median(ds[cache]['built']):.1f} s | {statistics.median(ds[cache]['skipped']):.1f} s | "
          f"**{statistics.median(ds[cache]['skipped']) / statistics.median(ds[cache]['built']):.2f}x** (rounds: "
          + ", ".join(f"{s / b:.2f}" for b, s in zip(ds[cache]["built"], ds[cache]["skipped"])) + ") |"
          for cache in ds],
        "",
        f"## train.overlap_start, {rounds} round(s)",
        "",
        "`raypack train --config jobs/configs/quickstart.yaml train.max_steps=1 data.eval_fraction=0`, each setting in "
        "a fresh process. Median seconds per phase (raypack/train/startup.py; with overlap the data preparation runs "
        "beside the worker group, worker imports and waiting for data, so the phases add up to more than the total).",
        "",
        "| phase | overlap_start: false | overlap_start: true |",
        "|---|---|---|",
        *[f"| {k} | {median['false'][k]:.1f} | {median['true'][k]:.1f} |" for k in phases],
        "",
        f"- total to the first step, overlap / sequential: **{median['true'][TOTAL] / median['false'][TOTAL]:.2f}x** "
        f"(rounds: {', '.join(f'{t[TOTAL] / f[TOTAL]:.2f}' for f, t in zip(runs['false'], runs['true']))})",
        "",
    ]
    write_results("startup", args.smoke, args.out, lines)
    return 0


def compare_revisions(args, argv, rounds: int, started) -> int:
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        work = Path(tmp)
        trees = {rev: export_tree(rev, work) for rev in args.revs}
        runs = {rev: [] for rev in args.revs}
        for r in range(rounds):
            for rev in (args.revs if r % 2 == 0 else args.revs[::-1]):
                runs[rev].append(raypack_train_at(rev, trees[rev], work, args))
    title = f"raypack train's start-up at {len(args.revs)} commits, {device_name()}, {time.strftime('%Y-%m-%d')}"
    lines = [*cpu_header(title, __file__, argv, args.smoke, started, ("ray", "deepspeed", "torch")),
             "", *revisions_section(args.revs, runs, rounds)]
    write_results("startup_revs", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
