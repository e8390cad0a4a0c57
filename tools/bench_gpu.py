"""`make gpu-check`: all of raypack's GPU evidence from one command on a bare GPU machine, ordered by
what it is worth, in at most 9 minutes, returning what it finished even when it is cut short.

    make gpu-check          # CUDA: the steps below; results in benchmarks/results/, copies in $OUT
    make bench-smoke        # CPU: the same steps with every benchmark's --smoke
    make gpu-rehearsal      # CPU: this command as the GPU machine runs it (tools/gpu_rehearsal.sh)
    python tools/bench_gpu.py [--smoke] [--budget SECONDS] [--results-dir DIR] [--only NAME ...] [--peers]

The GPU machine has torch with CUDA and an older transformers, but no Ray, no DeepSpeed, no TRL
and no network (tools/gpu_image_packages.txt). Step 0 installs the wheels carried next to the
checkout in .whl (tools/gpu_wheels.sh works out and gathers them, with .whl/requirements.json)
into --site, and restarts this script with --site first on PYTHONPATH and its bin/ on PATH, which
every process it starts inherits: the steps, their children, and Ray's workers. It then checks
each requirement in requirements.json against what is installed and prints any that is not met.

    0. install           the wheels in .whl, where there are any (or where Ray or DeepSpeed is missing)
    1. gpu_tests         pytest -m "gpu and not slow": the GPU tests that guard exactness
    2. peers             benchmarks/peers.py: raypack against TRL, a row per configuration as it ends
    3. engines           benchmarks/engines.py: DeepSpeed's ZeRO 1/2/3 against the torch engine's DDP and FSDP2
    4. profile           benchmarks/step_profile.py: where a train step's time goes
    5. profile_compiled  the same with train.compile
    6. hybrid            benchmarks/hybrid_throughput.py: a Qwen3.5-shaped hybrid exact on CUDA, packed over padded
    7. vlm               benchmarks/vlm_throughput.py: a Qwen2.5-VL-shaped model the same, images and text
    -- as time allows --
    8. dpo               benchmarks/dpo.py: packed DPO against TRL's DPOTrainer
    9. syncs             benchmarks/step_syncs.py
   10. train             benchmarks/train_throughput.py (ZeRO-2)
   11. loss              benchmarks/loss_memory.py
   12. attention         benchmarks/attention_throughput.py
   13. lora              benchmarks/lora_throughput.py
   14. moe               benchmarks/router_loss.py
   15. hybrid_kda        benchmarks/hybrid_throughput.py --family kimi_linear: KDA the same as hybrid
   16. long              benchmarks/long_context.py
   17. gpu_tests_more    pytest -m "gpu and slow": the other Liger families and the DeepSeek diagnostic

Each step runs in its own process group under its own time limit: its cap, cut so that the steps
before the line keep at least their min_s; a step after the line starts only with its min_s left.
A step that fails or runs out of time is reported and the next one still runs. Output streams to
the console and one combined log as it comes. With $OUT set (the device tool's output folder), after
every step: the combined log, results.tar.gz (every results file) and the first six results files
(the device tool returns at most 8). Exit status: 0 when every step that ran passed, 1 otherwise,
2 without a GPU (outside --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.common import run_streaming  # noqa: E402  (standard library only)

READY = "RAYPACK_BENCH_SITE"
"""Set once the wheels are installed and this script restarted with them on PYTHONPATH."""
STARTED = "RAYPACK_BENCH_STARTED"
"""Wall-clock start of the first launch: the budget counts the install and the restart too."""
BUDGET = 540.0
"""Seconds for everything on a GPU: 9 minutes, inside the device tool's 10-minute command."""
OUT_FILES = 8
"""The device tool returns at most 8 files from $OUT."""
GPU_TESTS = ["tests/gpu/model/test_attention.py", "tests/gpu/train/test_loss.py", "tests/gpu/model/test_adapters.py",
             "tests/gpu/model/test_kernels.py", "tests/gpu/model/test_mixers.py",
             "tests/gpu/model/test_vision_tower.py"]  # fmt: skip
"""In this order: a run cut short has the attention and loss checks first; then the hybrids' kernels
(boundaries kept on CUDA, the torch path's host reads, LoRA on out_proj off the fused kernel: issues 52, 54);
then the vision tower from a host plan (its varlen kernel, no device read in it: issue 52)."""
PYTEST = ["-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--durations=15"]


@dataclass
class Step:
    name: str
    theme: str
    """Results file theme: <theme>_<device>_<date>.md."""
    args: list[str]
    cap_s: float
    """Longest this step may run (GPU sizes)."""
    min_s: float
    """Below this much time it is skipped; a required step's min_s is kept for it while earlier steps run."""
    required: bool = True
    """Before the line: its min_s is reserved. After it: it runs only as time allows."""
    smoke_args: list[str] = field(default_factory=list)

    @property
    def pytest(self) -> bool:
        return self.args[:2] == ["-m", "pytest"]


STEPS = [
    # Before the Liger tests were split, all of tests/gpu did not finish in 170 s on an H100 (Triton
    # builds Liger's kernels per family); this is the rest, with Liger on three families.
    Step("gpu_tests", "gpu_tests", [*PYTEST, "-m", "gpu and not slow", *GPU_TESTS], cap_s=150, min_s=60),
    # Six configurations of ~25-80 s each on an H100 (2026-11-27: TRL 24-58 s, raypack 77 s); each
    # gets its own limit inside --deadline-s, so a slow one can't take the others' rows with it.
    Step("peers", "peers", ["benchmarks/peers.py"], cap_s=300, min_s=150, smoke_args=["--smoke"]),
    # Issue 51: DeepSpeed's ZeRO 1/2/3 against the torch engine's DDP and FSDP2, same model and batches
    # (six ~1.2B engines of 13 steps each, each loading one saved bf16 folder; not yet run on a GPU)
    Step("engines", "engines", ["benchmarks/engines.py"], cap_s=150, min_s=60, smoke_args=["--smoke"]),
    Step("profile", "step_profile", ["benchmarks/step_profile.py"], cap_s=60, min_s=30, smoke_args=["--smoke"]),
    Step("profile_compiled", "step_profile_compiled", ["benchmarks/step_profile.py", "--compile"], cap_s=75,
         min_s=30, smoke_args=["--smoke"]),
    # Issues 42 and 44, not yet run on a GPU: exactness on CUDA (fp32, bf16, and a control that must
    # fail) then tokens/s packed over padded, each results file written after the exactness part.
    # Required, so that a 9-minute run reaches them: they reserve 80 s that peers could otherwise
    # use. hybrid: the mixers' path is in its results (fla's kernels travel in .whl, causal-conv1d's
    # and mamba-ssm's can't: tools/gpu_wheels.py); fla's Triton kernels compile in its warm-up.
    Step("hybrid", "hybrid", ["benchmarks/hybrid_throughput.py"], cap_s=150, min_s=40, smoke_args=["--smoke"]),
    Step("vlm", "vlm", ["benchmarks/vlm_throughput.py"], cap_s=90, min_s=40, smoke_args=["--smoke"]),
    # Packed DPO against TRL's DPOTrainer, a goal of issue 50 (not yet run on a GPU): the ~1.1B model, the
    # full stacks one after the other, then the two steps alone alternating in one process; LoRA's
    # reference (its fourth side) is left to a run of its own. The results file is written at the end,
    # so the sizes are cut to fit the cap: 600 pairs (275k tokens: both sides' reference passes, and each
    # of the steps' 2 rounds, go over all of them), 3 warm-up and 8 measured steps of 16 pairs.
    Step("dpo", "dpo", ["benchmarks/dpo.py", "--pairs", "600", "--steps", "8", "--rounds", "2", "--configs", "trl",
                        "raypack", "steps"], cap_s=180, min_s=100, required=False, smoke_args=["--smoke"]),
    # What a step waits for before and after issue 35's lean step, with both sides' tokens/s and
    # torch's sync debug mode: two ~1.2B ZeRO-2 engines, 13 steps of 16k tokens each (not yet run
    # on a GPU; ~1 min expected).
    Step("syncs", "step_syncs", ["benchmarks/step_syncs.py"], cap_s=90, min_s=45, required=False,
         smoke_args=["--smoke"]),
    Step("train", "train", ["benchmarks/train_throughput.py", "--zero-stage", "2"], cap_s=200, min_s=100,
         required=False, smoke_args=["--smoke"]),
    Step("loss", "loss_memory", ["benchmarks/loss_memory.py"], cap_s=90, min_s=40, required=False,
         smoke_args=["--smoke"]),
    Step("attention", "attention", ["benchmarks/attention_throughput.py"], cap_s=120, min_s=50, required=False,
         smoke_args=["--smoke", "--distributions", "flan"]),
    Step("lora", "lora", ["benchmarks/lora_throughput.py"], cap_s=90, min_s=45, required=False,
         smoke_args=["--smoke"]),
    # MoE: a Qwen3-MoE-shaped model's step with the router loss off, per example and per micro-batch
    # (issue 43; not yet run on a GPU)
    Step("moe", "router_loss", ["benchmarks/router_loss.py"], cap_s=90, min_s=40, required=False,
         smoke_args=["--smoke"]),
    # KDA (issue 54, not yet run on a GPU): a Kimi-Linear-shaped hybrid, exact on CUDA, packed over padded
    Step("hybrid_kda", "hybrid_kda", ["benchmarks/hybrid_throughput.py", "--family", "kimi_linear"], cap_s=120,
         min_s=50, required=False, smoke_args=["--smoke"]),
    # It doubles row lengths for as long as its own --budget allows.
    Step("long", "long_context", ["benchmarks/long_context.py", "--budget", "120"], cap_s=150, min_s=60,
         required=False, smoke_args=["--smoke"]),
    Step("gpu_tests_more", "gpu_tests_more", [*PYTEST, "-m", "gpu and slow", *GPU_TESTS], cap_s=150, min_s=40,
         required=False),
]  # fmt: skip
PEERS = ("peers", "profile", "profile_compiled")
"""--peers: raypack against TRL and where its step's time goes, alone."""


class Log:
    """Everything the steps print, on the console and in one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("a", buffering=1)

    def __call__(self, line: str) -> None:
        line = line if line.endswith("\n") else line + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        self.file.write(line)


def have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def install_wheels(wheel_dir: Path, site: Path) -> None:
    """Install wheel_dir/*.whl into `site`, then restart this script with `site` first on
    PYTHONPATH and site/bin first on PATH, for it and every process it starts."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        sys.exit(f"[gpu-check] ray, deepspeed or trl is not installed and {wheel_dir} holds no wheels: gather them "
                 "with tools/gpu_wheels.sh and carry .whl with the checkout")  # fmt: skip
    print(f"[gpu-check] installing {len(wheels)} wheels from {wheel_dir} into {site}", flush=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True)
    print(f"[gpu-check] installed in {time.perf_counter() - t0:.0f} s; restarting with them on PYTHONPATH", flush=True)
    env = dict(os.environ, **{READY: str(site), STARTED: os.environ.get(STARTED, "")})
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])
    argv = [a for a in sys.argv if a != "--install"]  # installed once; the restart must not loop
    os.execve(sys.executable, [sys.executable, *argv], env)


def unmet_requirements(path: Path) -> list[str]:
    """What requirements.json (tools/gpu_wheels.py) asks of the image's packages that the installed
    versions don't give: the image list may name a package without its version."""
    if not path.exists():
        return []
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    unmet = []
    for name, entry in json.loads(path.read_text()).items():
        try:
            have_version = version(name)
        except PackageNotFoundError:
            unmet.append(f"{name}: not installed (the image list names it)")
            continue
        for who, spec in entry["wanted"].items():
            if spec and not SpecifierSet(spec).contains(have_version, prereleases=True):
                unmet.append(f"{name} {have_version}: {who} needs {spec}")
    return unmet


def step_env(cuda: bool, results_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [*env.get("PYTHONPATH", "").split(os.pathsep), str(REPO)]  # the wheels' folder stays first
    env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys(paths) if p)
    env["RAYPACK_BENCH_OUT"] = str(results_dir)
    env["PYTHONUNBUFFERED"] = "1"  # children's lines reach the log as they are printed
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    if cuda:
        import torch

        # DeepSpeed's op builder fails to parse "9.0a"; the allocator setting is what the measured runs used.
        major, minor = torch.cuda.get_device_capability()
        if "a" in env.get("TORCH_CUDA_ARCH_LIST", "a"):
            env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def tests_report(path: Path, title: str, cmd: list[str], output: list[str], rc: int, seconds: float) -> None:
    from benchmarks.common import device_name, machine, versions

    summary = next((line for line in reversed(output) if " passed" in line or " failed" in line or " skipped" in line), "")
    path.write_text("\n".join([
        f"# {title}, {device_name()}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `PYTHONPATH=. python {' '.join(cmd[1:])}` (exit status {rc}, {seconds:.0f} s)",
        "",
        f"- machine: {machine()}",
        f"- versions: {versions('deepspeed', 'ray', 'flash_attn', 'liger_kernel', 'triton')}",
        f"- summary: {summary.strip() or 'no summary line (see the log)'}",
        "",
        "```",
        *[line.rstrip("\n") for line in output[-200:]],
        "```",
        "",
    ]))  # fmt: skip


def copy_out(out: Path, files: list[Path], log: Log) -> None:
    """Into $OUT: the log, every results file in one tarball, and the first of them as they are."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "results.tar.gz.tmp", "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    os.replace(out / "results.tar.gz.tmp", out / "results.tar.gz")
    for f in files[: OUT_FILES - 2]:
        shutil.copy2(f, out / f.name)
    log.file.flush()
    shutil.copy2(log.path, out / log.path.name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="run every step on the CPU with the benchmarks' --smoke modes")
    p.add_argument("--budget", type=float, default=None, help=f"seconds for all steps (default {BUDGET:.0f}; smoke 1800)")
    p.add_argument("--results-dir", default=None,
                   help="where results files go (default benchmarks/results/; smoke: a temp folder)")  # fmt: skip
    p.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run only these steps")
    p.add_argument("--peers", action="store_true", help=f"only {', '.join(PEERS)}")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="the carried wheels (tools/gpu_wheels.sh)")
    p.add_argument("--site", default=str(Path(tempfile.gettempdir()) / "raypack-site"), help="where they are installed")
    p.add_argument("--install", action="store_true", help="install the wheels even where ray and deepspeed import")
    args = p.parse_args(argv)
    os.environ.setdefault(STARTED, str(time.time()))
    started = float(os.environ[STARTED])

    try:
        import torch
    except ImportError:
        print("[gpu-check] needs torch (with CUDA, outside --smoke)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("[gpu-check] no CUDA GPU here: make gpu-check measures raypack on a GPU. `make bench-smoke` runs the "
              "same steps on the CPU with every benchmark's --smoke; `make gpu-rehearsal` runs them as the GPU "
              "machine does.", file=sys.stderr)  # fmt: skip
        return 2
    wheels = Path(args.wheels)
    carried = (wheels / "requirements.json").exists()
    if (args.install or carried or not have("ray", "deepspeed", "trl")) and not os.environ.get(READY):
        install_wheels(wheels, Path(args.site))  # does not return: restarts this script
    if not have("ray", "deepspeed"):
        print("[gpu-check] ray/deepspeed still not importable after installing the wheels", file=sys.stderr)
        return 1

    from benchmarks.common import device_name

    device = device_name()
    date = datetime.date.today().strftime("%Y%m%d")
    suffix = "_smoke" if args.smoke else ""
    results_dir = Path(args.results_dir or os.environ.get("RAYPACK_BENCH_OUT") or
                       (tempfile.mkdtemp(prefix="raypack-bench-smoke-") if args.smoke else REPO / "benchmarks" / "results"))  # fmt: skip
    results_dir.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log = Log(Path(tempfile.mkdtemp(prefix="raypack-bench-")) / f"gpu_check_{device}{suffix}_{date}.log")
    budget = args.budget or (1800.0 if args.smoke else BUDGET)
    names = set(args.only or (PEERS if args.peers else [s.name for s in STEPS]))
    steps = [s for s in STEPS if s.name in names]
    env = step_env(cuda, results_dir)
    log(f"[gpu-check] {device}{' (smoke)' if args.smoke else ''}: {', '.join(s.name for s in steps)}; budget "
        f"{budget:.0f} s, {time.time() - started:.0f} s spent installing; results in {results_dir}; log {log.path}"
        + (f"; copies to {out}" if out else ""))  # fmt: skip
    log(f"[gpu-check] steps run with PYTHONPATH={env['PYTHONPATH']}")
    for line in unmet_requirements(wheels / "requirements.json"):
        log(f"[gpu-check] WARNING: requirement not met here: {line}")

    outcomes: list[tuple[str, str, float, Path | None]] = []
    for i, step in enumerate(steps):
        left = budget - (time.time() - started)
        keep = sum(s.min_s for s in steps[i + 1 :] if s.required)
        limit = min(step.cap_s * (3 if args.smoke else 1), left - keep)
        results = results_dir / f"{step.theme}_{device}{suffix}_{date}.md"
        if limit < step.min_s * (0.5 if step.required else 1):
            log(f"[gpu-check] step {i + 1}/{len(steps)} {step.name}: skipped, {left:.0f} s left for it and later steps")
            outcomes.append((step.name, "skipped", 0.0, None))
            continue
        if step.pytest:
            cmd = [sys.executable, *step.args]
        else:
            extra = ["--deadline-s", f"{limit - 10:.0f}"] if step.name == "peers" else []
            cmd = [sys.executable, *step.args, *(step.smoke_args if args.smoke else []), *extra, "--out", str(results)]
        log(f"[gpu-check] step {i + 1}/{len(steps)} {step.name} (limit {limit:.0f} s): {' '.join(cmd[1:])}")
        began = time.time()
        rc, seconds, output = run_streaming(cmd, cwd=REPO, env=env, timeout=limit,
                                            echo=lambda line, name=step.name: log(f"[{name}] {line}"))  # fmt: skip
        if rc == 124:
            log(f"[gpu-check] {step.name}: time limit of {limit:.0f} s reached, stopped it")
        if step.pytest:
            tests_report(results, f"GPU tests ({step.name})", cmd, output, rc, seconds)
        wrote = results.exists() and results.stat().st_mtime >= began - 1  # not a file left by an earlier run
        status = "ok" if rc == 0 and wrote else ("timed out" if rc == 124 else f"failed (exit {rc})")
        if rc == 0 and not wrote:
            status = "failed (no results file)"
        log(f"[gpu-check] step {i + 1}/{len(steps)} {step.name}: {status} in {seconds:.0f} s" +
            (f"; wrote {results}" if wrote else ""))  # fmt: skip
        outcomes.append((step.name, status, seconds, results if wrote else None))
        if out:
            copy_out(out, [r for *_, r in outcomes if r], log)

    total = time.time() - started
    log(f"[gpu-check] done in {total:.0f} s: " + ", ".join(f"{n} {s}" for n, s, *_ in outcomes))
    for *_, r in outcomes:
        if r:
            log(f"[gpu-check] results: {r}")
    if out:
        copy_out(out, [r for *_, r in outcomes if r], log)
    return 0 if all(s in ("ok", "skipped") for _, s, *_ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
