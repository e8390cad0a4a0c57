"""`make bench-gpu`: raypack's GPU evidence in one command, on a bare GPU machine, in under 10 minutes.

    make bench-gpu          # CUDA: the GPU tests and five benchmarks; results in benchmarks/results/
    make bench-smoke        # CPU: the same steps with every benchmark's --smoke (what CI runs)
    make bench-peers        # CUDA, apart: raypack against TRL's SFTTrainer (benchmarks/peers.py) and where
                            # a step's time goes (benchmarks/step_profile.py, plain and compiled): < 10 min
    python tools/bench_gpu.py [--smoke] [--budget SECONDS] [--results-dir DIR] [--only NAME ...]

The GPU machine has torch with CUDA and transformers but no Ray, no DeepSpeed and no network. If
Ray or DeepSpeed is missing, step 0 installs the wheels carried next to the checkout in .whl
(tools/gpu_wheels.sh gathers them) into a private folder and restarts this script with it first
on PYTHONPATH, so that every step, and this script's version lines, see the same packages.

    0. install    ray, deepspeed, peft, trl, liger-kernel (and the carried transformers) from .whl,
                  if one is missing
    1. gpu_tests  pytest -m gpu tests/gpu                      -> gpu_tests_<device>_<date>.md
    2. train      benchmarks/train_throughput.py (ZeRO-2)      -> train_<device>_<date>.md
    3. loss       benchmarks/loss_memory.py                    -> loss_memory_<device>_<date>.md
    4. attention  benchmarks/attention_throughput.py           -> attention_<device>_<date>.md
    5. lora       benchmarks/lora_throughput.py (needs peft)   -> lora_<device>_<date>.md
    6. long       benchmarks/long_context.py                   -> long_context_<device>_<date>.md

Each step runs under its own time limit, cut so that all of them, and the install, fit in --budget
seconds (default 570 on a GPU) with time kept for the steps after it; a step that fails or runs out of time is
reported and the next one still runs. On an H100 steps 1-4 took ~310 s in all; steps 5 (~50 s)
and 6 (its own 120 s budget) have not run yet: with a ~30 s install, ~510 s of the 570. The caps
(1070 s in all) are upper bounds; what bounds a step is the budget less the min_s kept for the
steps after it (415 s in all). Progress goes to the console and to one combined log. With
$OUT set (the device tool's output folder), the results files and the combined log are copied
there after every step, so even a run cut short returns what it finished. Exit status: 0 when
every step passed, 1 when one did not, 2 without a GPU (outside --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = "RAYPACK_BENCH_SITE"
"""Set once the wheels are installed and this script restarted with them on PYTHONPATH."""
STARTED = "RAYPACK_BENCH_STARTED"
"""Wall-clock start of the first launch: the budget counts the install and the restart too."""


@dataclass
class Step:
    name: str
    theme: str
    """Results file theme: <theme>_<device>_<date>.md."""
    args: list[str]
    cap_s: float
    """Longest this step may run (GPU sizes)."""
    min_s: float
    """Time kept for it while earlier steps run; below this it is skipped."""
    smoke_args: list[str] = field(default_factory=list)


STEPS = [
    # 29 s on an H100 before the Liger tests (Triton builds each kernel once, two compiled models):
    # not yet run with them, hence the room
    Step("gpu_tests", "gpu_tests", ["-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider"],
         cap_s=180, min_s=40),
    Step("train", "train", ["benchmarks/train_throughput.py", "--zero-stage", "2"], cap_s=300, min_s=150,
         smoke_args=["--smoke"]),
    Step("loss", "loss_memory", ["benchmarks/loss_memory.py"], cap_s=150, min_s=60, smoke_args=["--smoke"]),
    Step("attention", "attention", ["benchmarks/attention_throughput.py"], cap_s=180, min_s=60,
         smoke_args=["--smoke", "--distributions", "flan"]),
    # Last: the newest, so the one that gives way if the others run long. ~50 s expected on an
    # H100 (two ~1.2B models built on the GPU, 2 settings x 2 rounds x 2 sides x 4 steps of 16k tokens).
    Step("lora", "lora", ["benchmarks/lora_throughput.py"], cap_s=90, min_s=45, smoke_args=["--smoke"]),
    # The longest row one GPU trains, with the long-row options; it doubles lengths for as long as
    # its own --budget allows, so it takes what is left (not yet run on a GPU).
    Step("long", "long_context", ["benchmarks/long_context.py", "--budget", "120"], cap_s=170, min_s=60,
         smoke_args=["--smoke"]),
]  # fmt: skip
PEERS = [
    # `make bench-peers`, a command of its own: TRL's SFTTrainer twice and raypack twice on a ~1.1B
    # model, each configuration a fresh process of ~1-2 min on an H100 (estimated: none has run on one).
    Step("peers", "peers", ["benchmarks/peers.py"], cap_s=450, min_s=300, smoke_args=["--smoke"]),
    # where a step's time goes (issue 24), plain and compiled: ~20 s each expected on an H100
    Step("profile", "step_profile", ["benchmarks/step_profile.py"], cap_s=60, min_s=30, smoke_args=["--smoke"]),
    Step("profile_compiled", "step_profile_compiled", ["benchmarks/step_profile.py", "--compile"], cap_s=60,
         min_s=30, smoke_args=["--smoke"]),
]


class Log:
    """Everything the steps print, on the console and in one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("a", buffering=1)

    def __call__(self, line: str) -> None:
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()
        self.file.write(line if line.endswith("\n") else line + "\n")


def have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def install_wheels(wheel_dir: Path, site: Path) -> None:
    """Install wheel_dir/*.whl into `site` and restart this script with `site` first on PYTHONPATH."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        sys.exit(f"[bench-gpu] ray/deepspeed are not installed and {wheel_dir} holds no wheels: gather them with "
                 "tools/gpu_wheels.sh and carry .whl with the checkout")  # fmt: skip
    print(f"[bench-gpu] installing {len(wheels)} wheels from {wheel_dir} into {site}", flush=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True)
    print(f"[bench-gpu] installed in {time.perf_counter() - t0:.0f} s; restarting with them on PYTHONPATH", flush=True)
    env = dict(os.environ, **{READY: str(site), STARTED: os.environ.get(STARTED, "")})
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    argv = [a for a in sys.argv if a != "--install"]  # installed once; the restart must not loop
    os.execve(sys.executable, [sys.executable, *argv], env)


def step_env(smoke: bool, cuda: bool, results_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [*env.get("PYTHONPATH", "").split(os.pathsep), str(REPO)]  # the wheels' folder stays first
    env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys(paths) if p)
    env["RAYPACK_BENCH_OUT"] = str(results_dir)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    if cuda:
        import torch

        # DeepSpeed's op builder fails to parse "9.0a"; the allocator setting is what the measured runs used.
        major, minor = torch.cuda.get_device_capability()
        if "a" in env.get("TORCH_CUDA_ARCH_LIST", "a"):
            env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def run_step(step: Step, cmd: list[str], env: dict[str, str], limit: float, log: Log) -> tuple[int, float, list[str]]:
    """Run `cmd` in its own process group, streaming its output; stop the group at `limit` seconds.
    Returns (exit status, 124 on timeout; seconds; output lines)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            log(f"[{step.name}] {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        log(f"[bench-gpu] {step.name}: time limit of {limit:.0f} s reached, stopping it")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        rc = 124
    reader.join(timeout=5)
    return rc, time.perf_counter() - t0, lines


def gpu_tests_report(path: Path, cmd: list[str], output: list[str], rc: int, seconds: float) -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.common import device_name, machine, versions

    summary = next((line for line in reversed(output) if " passed" in line or " failed" in line or " skipped" in line), "")
    path.write_text("\n".join([
        f"# GPU tests (pytest -m gpu), {device_name()}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `PYTHONPATH=. python {' '.join(cmd[1:])}` (exit status {rc}, {seconds:.0f} s)",
        "",
        f"- machine: {machine()}",
        f"- versions: {versions('deepspeed', 'ray', 'flash_attn')}",
        f"- summary: {summary.strip() or 'no summary line (see the log)'}",
        "",
        "```",
        *[line.rstrip("\n") for line in output[-200:]],
        "```",
        "",
    ]))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="run every step on the CPU with the benchmarks' --smoke modes")
    p.add_argument("--budget", type=float, default=None, help="seconds for all steps (default 570; smoke 1500)")
    p.add_argument("--results-dir", default=None,
                   help="where results files go (default benchmarks/results/; smoke: a temp folder)")  # fmt: skip
    p.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run only these steps")
    p.add_argument("--peers", action="store_true", help="`make bench-peers`: raypack against TRL, instead of the steps")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="wheels to install where ray/deepspeed are missing")
    p.add_argument("--site", default=str(Path(tempfile.gettempdir()) / "raypack-site"), help="where they are installed")
    p.add_argument("--install", action="store_true", help="install the wheels even where ray and deepspeed import")
    args = p.parse_args(argv)
    os.environ.setdefault(STARTED, str(time.time()))
    started = float(os.environ[STARTED])

    try:
        import torch
    except ImportError:
        print("[bench-gpu] needs torch (with CUDA, outside --smoke)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("[bench-gpu] no CUDA GPU here: make bench-gpu measures raypack on a GPU. "
              "`make bench-smoke` runs the same steps on the CPU with every benchmark's --smoke.", file=sys.stderr)  # fmt: skip
        return 2
    needs = ("ray", "deepspeed", "trl") if args.peers else ("ray", "deepspeed", "peft")
    if (args.install or not have(*needs)) and not os.environ.get(READY):
        install_wheels(Path(args.wheels), Path(args.site))  # does not return: restarts this script
    if not have("ray", "deepspeed"):
        print("[bench-gpu] ray/deepspeed still not importable after installing the wheels", file=sys.stderr)
        return 1

    sys.path.insert(0, str(REPO))
    from benchmarks.common import device_name

    device = device_name()
    date = datetime.date.today().strftime("%Y%m%d")
    suffix = "_smoke" if args.smoke else ""
    results_dir = Path(args.results_dir or os.environ.get("RAYPACK_BENCH_OUT") or
                       (tempfile.mkdtemp(prefix="raypack-bench-smoke-") if args.smoke else REPO / "benchmarks" / "results"))  # fmt: skip
    results_dir.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log = Log(Path(tempfile.mkdtemp(prefix="raypack-bench-")) / f"bench_gpu_{device}{suffix}_{date}.log")
    budget = args.budget or (1500.0 if args.smoke else 540.0 if args.peers else 570.0)
    steps = PEERS if args.peers else [s for s in STEPS if not args.only or s.name in args.only]
    env = step_env(args.smoke, cuda, results_dir)
    log(f"[bench-gpu] {device}{' (smoke)' if args.smoke else ''}: {', '.join(s.name for s in steps)}; budget {budget:.0f} s; "
        f"results in {results_dir}; log {log.path}" + (f"; copies to {out}" if out else ""))  # fmt: skip
    log(f"[bench-gpu] steps run with PYTHONPATH={env['PYTHONPATH']}")

    outcomes = []
    for i, step in enumerate(steps):
        left = budget - (time.time() - started)
        keep = sum(s.min_s for s in steps[i + 1 :])
        limit = min(step.cap_s * (3 if args.smoke else 1), left - keep)
        results = results_dir / f"{step.theme}_{device}{suffix}_{date}.md"
        if limit < step.min_s / 2:
            log(f"[bench-gpu] step {i + 1}/{len(steps)} {step.name}: skipped, {left:.0f} s left for it and later steps")
            outcomes.append((step.name, "skipped", 0.0, None))
            continue
        if step.name == "gpu_tests":
            cmd = [sys.executable, *step.args]
        else:
            cmd = [sys.executable, *step.args, *(step.smoke_args if args.smoke else []), "--out", str(results)]
        log(f"[bench-gpu] step {i + 1}/{len(steps)} {step.name} (limit {limit:.0f} s): {' '.join(cmd[1:])}")
        began = time.time()
        rc, seconds, output = run_step(step, cmd, env, limit, log)
        if step.name == "gpu_tests":
            gpu_tests_report(results, cmd, output, rc, seconds)
        wrote = results.exists() and results.stat().st_mtime >= began - 1  # not a file left by an earlier run
        status = "ok" if rc == 0 and wrote else ("timed out" if rc == 124 else f"failed (exit {rc})")
        if rc == 0 and not wrote:
            status = "failed (no results file)"
        log(f"[bench-gpu] step {i + 1}/{len(steps)} {step.name}: {status} in {seconds:.0f} s" +
            (f"; wrote {results}" if wrote else ""))  # fmt: skip
        outcomes.append((step.name, status, seconds, results if wrote else None))
        if out:
            copy_out(out, [r for *_, r in outcomes if r], log)

    total = time.time() - started
    log(f"[bench-gpu] done in {total:.0f} s: " + ", ".join(f"{n} {s}" for n, s, *_ in outcomes))
    for _, _, _, r in outcomes:
        if r:
            log(f"[bench-gpu] results: {r}")
    if out:
        copy_out(out, [r for *_, r in outcomes if r], log)
    return 0 if all(s == "ok" for _, s, *_ in outcomes) else 1


def copy_out(out: Path, files: list[Path], log: Log) -> None:
    """Results files and the combined log into $OUT (the device tool returns at most 8 files)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in files[:7]:
        shutil.copy2(f, out / f.name)
    log.file.flush()
    shutil.copy2(log.path, out / log.path.name)


if __name__ == "__main__":
    sys.exit(main())
