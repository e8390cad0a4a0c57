"""How far down raypack's start-up can go on Ray Train: the time from a process's start to its
first step for TRL and raypack, beside what Ray Train and the libraries need before any step at all,
side by side in one run (issue 40's start-up goal: raypack within 1.5x TRL's).

    PYTHONPATH=. python benchmarks/startup_floor.py              # 3 rounds, CPU or GPU
    PYTHONPATH=. python benchmarks/startup_floor.py --smoke      # one round: proves it runs

Each side is a fresh process, its time counted from just before it is launched (in the order below,
reversed every other round):

- `imports`: one Python process that imports torch, transformers, DeepSpeed and peft, and stops:
  what any process that trains with them pays first.
- `trl`: TRL's SFTTrainer to the end of its first step (`benchmarks/peers.py`'s `trl` row, its
  --smoke sizes: the tiny model, the same data, one process).
- `ray-train`: Ray Train alone. A local Ray instance started as raypack starts one, then Ray Train's
  own `TorchTrainer` with one worker, whose function imports what raypack's workers import (torch,
  transformers, DeepSpeed, peft) and returns; counted to the end of those imports. No data, model or
  step: the least any trainer built on Ray Train and these libraries waits before its first step.
- `ray-train-raypack`: the same function on raypack's `RunTrainer` with its process group
  (raypack/train/trainer.py, placement.py): Ray Train less the helper actors raypack leaves out.
- `raypack`: `raypack train` to the end of its first step (`benchmarks/peers.py`'s `raypack` row,
  the same sizes as `trl`).

Reported: each side's median seconds and its ratio over `trl`, per round. Results:
benchmarks/results/startup_floor_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_header, device_name, host_now, write_results  # noqa: E402

SIDES = ("imports", "trl", "ray-train", "ray-train-raypack", "raypack")
WORKER_IMPORTS = "import torch, transformers, deepspeed, peft"
"""What a raypack worker imports before it trains (raypack/train/loop.py and what it pulls in)."""

IMPORTS = f"""
import time
{WORKER_IMPORTS}
print("REACHED", time.time(), flush=True)
"""


def worker_imports(config: dict) -> None:
    """The Ray Train workers' function: the libraries' imports (WORKER_IMPORTS), then the time, in the
    run's folder."""
    import deepspeed, peft, torch, transformers  # noqa: E401, F401

    Path(config["out"]).write_text(str(time.time()))


def child_ray_train(side: str, work: Path, use_gpu: bool) -> float:
    """`ray-train` or `ray-train-raypack`, in this (fresh) process: when the worker's imports ended."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raypack.runtime import init_ray, is_local_instance

    init_ray()
    out = work / f"reached-{os.getpid()}"
    env = {} if use_gpu else {"DS_ACCELERATOR": "cpu"}  # as raypack's workers get it
    if side == "ray-train-raypack":
        from raypack.train.placement import process_group
        from raypack.train.trainer import RunTrainer

        local = is_local_instance()
        torch_config, listen_env = process_group(use_gpu, local)
        env.update(listen_env)
    run_config = ray.train.RunConfig(name=f"floor-{os.getpid()}", storage_path=str(work / "scratch"),
                                     worker_runtime_env={"env_vars": env})  # fmt: skip
    scaling = ray.train.ScalingConfig(num_workers=1, use_gpu=use_gpu, resources_per_worker={"CPU": 1})
    common = {"train_loop_config": {"out": str(out)}, "scaling_config": scaling, "run_config": run_config}
    if side == "ray-train":
        trainer = TorchTrainer(worker_imports, **common)
    else:
        trainer = RunTrainer(worker_imports, local=local, torch_config=torch_config, **common)
    trainer.fit()
    return float(out.read_text())


def launch(cmd: list[str], args) -> tuple[float, str]:
    """Run `cmd` to its end; (the time just before its launch, its output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if not args.gpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's import otherwise warns that it found no GPU
    launched = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return launched, proc.stdout


def reached(stdout: str, key: str) -> str:
    """The rest of the last line of `stdout` that begins with `key`."""
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith(key))
    return line.split(maxsplit=1)[1]


def run_side(side: str, work: Path, args) -> float:
    """Seconds from `side`'s launch to its point: the end of its first step, or of its imports."""
    import json

    from benchmarks.peers import child_args, parse_args

    if side == "imports":
        launched, out = launch([sys.executable, "-c", IMPORTS], args)
        seconds = float(reached(out, "REACHED")) - launched
    elif side in ("trl", "raypack"):
        launched, out = launch([sys.executable, "-u", str(REPO / "benchmarks/peers.py"), "--child", side, "--work",
                                str(work), *child_args(parse_args(["--smoke"]))], args)  # fmt: skip
        seconds = json.loads(reached(out, "RESULT"))["first_step_time"] - launched
    else:
        launched, out = launch([sys.executable, __file__, "--child", side, "--work", str(work),
                                *(["--gpu"] if args.gpu else [])], args)  # fmt: skip
        seconds = float(reached(out, "REACHED")) - launched
    print(f"[startup_floor] {side}: {seconds:.1f} s", flush=True)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one round: proves the script runs")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; smoke 1)")
    p.add_argument("--timeout", type=int, default=600, help="seconds one side may take")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=("ray-train", "ray-train-raypack"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("REACHED", child_ray_train(args.child, Path(args.work), args.gpu), flush=True)
        return 0
    import torch

    args.gpu = torch.cuda.is_available()
    rounds = args.rounds or (1 if args.smoke else 3)
    started = host_now()
    from benchmarks.peers import parse_args, save_model, write_data

    smoke = parse_args(["--smoke"])  # peers.py --smoke's data, model and sizes (its tiny model's vocabulary: 768)
    with tempfile.TemporaryDirectory(prefix="startup_floor_") as tmp:
        work = Path(tmp)
        write_data(work / "data.parquet", smoke.examples, smoke.budget, 768, smoke.seed)
        save_model(work / "model", smoke=True, seed=smoke.seed)
        runs: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_side(side, work, args))
    trl = runs["trl"]
    rows = [f"| `{side}` | {statistics.median(runs[side]):.1f} | **{statistics.median(runs[side]) / statistics.median(trl):.2f}x** | "
            + ", ".join(f"{s / t:.2f}" for s, t in zip(runs[side], trl)) + " |" for side in SIDES]  # fmt: skip
    lines = [
        *cpu_header(f"Start-up's floor on Ray Train, beside TRL and raypack, {device_name()}, {time.strftime('%Y-%m-%d')}",
                    __file__, argv, args.smoke, started, ("ray", "trl", "transformers", "deepspeed", "torch")),
        "",
        f"## Seconds from a fresh process's launch to its point, {rounds} round(s)",
        "",
        "Points: `trl` and `raypack`, the end of the first step (tiny-llama, `peers.py --smoke`'s data and sizes, "
        "one worker); `imports`, the end of `" + WORKER_IMPORTS + "`; `ray-train` and `ray-train-raypack`, the end of "
        "the same imports in Ray Train's one worker, on a local Ray instance started as raypack starts one. See the "
        "script's docstring for each side.",
        "",
        "| side | median s | over `trl` (medians) | over `trl`, per round |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    write_results("startup_floor", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
