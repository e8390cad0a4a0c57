"""What the benchmark scripts share: where a results file goes, and the lines that say where and
with what it ran. Imports only the standard library and torch (the GPU machine has no Ray until
the wheels are installed).

Results files are named `<theme>_<device>_<yyyymmdd>.md` (`..._smoke_...` for a --smoke run) and
go to `--out` if given, else to `$RAYPACK_BENCH_OUT` if set, else to benchmarks/results/ (a real
run, to commit) or the temp folder (a --smoke run, to throw away).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OUT_ENV = "RAYPACK_BENCH_OUT"


def device_name() -> str:
    """`h100`, `h200`, ... on CUDA (the GPU's model); `cpu` otherwise."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    return "cpu"


def gpu_or_smoke(script: str, smoke: bool, what: str) -> str | None:
    """The device a GPU benchmark runs on: "cuda", or "cpu" for a --smoke run (one torch thread:
    a tiny model gains nothing from more, and a shared CI box oversubscribes). None, after saying
    why on stderr, when there is no GPU and no --smoke (the caller exits 2)."""
    import torch

    if smoke:
        torch.set_num_threads(1)
    if torch.cuda.is_available():
        return "cuda"
    if smoke:
        return "cpu"
    print(f"{Path(script).name} {what}: it needs CUDA; --smoke runs it on the CPU", file=sys.stderr)
    return None


def results_path(theme: str, smoke: bool = False, out: str | None = None) -> Path:
    if out:
        path = Path(out)
    else:
        folder = os.environ.get(OUT_ENV) or (tempfile.gettempdir() if smoke else str(RESULTS))
        date = datetime.date.today().strftime("%Y%m%d")
        path = Path(folder) / f"{theme}_{device_name()}{'_smoke' if smoke else ''}_{date}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_results(theme: str, smoke: bool, out: str | None, lines: list[str]) -> Path:
    """Write a results file (see results_path), echo it, and say where it went. The line after the
    title names the commit measured, so the docs' benchmark index can say what changed since."""
    path = results_path(theme, smoke, out)
    lines = [*lines[:1], "", f"Commit: {commit()}", *lines[1:]] if lines else lines
    path.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")
    return path


def child_env(**extra: str) -> dict[str, str]:
    """A child process's environment: this one's, the repository first on PYTHONPATH and what was on
    it kept (on the GPU machine, the kit's wheels: tools/bench_gpu.py puts them there)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_streaming(cmd: list[str], *, cwd, env: dict[str, str], timeout: float, echo) -> tuple[int, float, list[str]]:
    """Run `cmd` in its own process group, each line of its output (stderr merged) passed to `echo`
    as it comes; at `timeout` seconds the group gets SIGTERM, then SIGKILL 15 s later. Returns (exit
    status, 124 on time-out; seconds; the lines)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            echo(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = 124
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    # Whatever the command left running in its group (a Ray instance's processes) goes with it.
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=5)
    return rc, time.perf_counter() - t0, lines


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def commit() -> str:
    """The checkout's commit, `abc1234` (`abc1234 with uncommitted changes` where the tree differs);
    `not known` where there is no git (a copy of the working tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "not known (no git repository here)"
    return f"`{head}`" + (" with uncommitted changes" if dirty else "")


def command_line(script: str, argv: list[str] | None) -> str:
    args = argv if argv is not None else sys.argv[1:]
    return f"PYTHONPATH=. python benchmarks/{Path(script).name} {shlex.join(args)}".strip()


def machine() -> str:
    import torch

    cpus = f"{os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{torch.cuda.get_device_name()} ({props.total_memory / 2**30:.0f} GiB), {cpus}"
    return f"{platform.processor() or platform.machine()}, {cpus}, no GPU"


def versions(*modules: str) -> str:
    """python, torch (+CUDA), transformers, then each of `modules` that is importable."""
    import torch
    import transformers

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    parts.append(f"transformers {transformers.__version__}")
    return ", ".join(parts + module_versions(modules))


def module_versions(names) -> list[str]:
    out = []
    for name in names:
        try:
            module = __import__(name)
            out.append(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            out.append(f"{name} not installed")
    return out


def host_now() -> tuple[str, float]:
    """When a CPU benchmark starts and the host's 1-minute load average then, for `cpu_header`."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg()[0]


def cpu_header(title: str, script: str, argv: list[str] | None, smoke: bool, started: tuple[str, float],
               modules: tuple[str, ...] = (), notes: str = "") -> list[str]:
    """The first lines of a CPU benchmark's results file: title, smoke banner, command, machine
    (with the load average at the start and now: the host is shared, so times are upper bounds)
    and the versions of python and `modules`. No torch import: the CPU benchmarks need none."""
    at, load = started
    return [
        f"# {title}" + (" -- SMOKE RUN: not results" if smoke else ""),
        "",
        *smoke_banner(smoke),
        f"Command: `{command_line(script, argv)}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; started {at}; load average "
        f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at end (shared machine: times are upper bounds).{' ' + notes if notes else ''}",
        f"Versions: {', '.join([f'python {platform.python_version()}', *module_versions(modules)])}.",
    ]


def smoke_banner(smoke: bool) -> list[str]:
    return ["**--smoke run: a tiny model or a few examples on the CPU, to prove the script works; these numbers "
            "are not results.**", ""] if smoke else []


EXACT_BOUNDS = {
    "bfloat16": (2e-2, 5e-2),
    "float32": (1e-4, 1e-4),
    "tf32": (2.5e-3, 6.25e-3),
}
"""Packed against each example alone on CUDA, relative (tests/exactness.py's measure): (logits and
loss, every gradient). bfloat16 and float32 are tests/gpu/model/test_attention.py's bounds: bf16's
unit roundoff is 2^-8 (3.9e-3), and the packed and the alone runs take other kernels and reduction
orders, so values differ by a few ulps after a few layers and gradients, summed over ~1000
tokens, by more; fp32 differs only in reduction order (torch uses no TF32 in matmuls unless
asked). `tf32`: fp32 where a Triton kernel takes its matmul inputs as TF32 (flash-linear-
attention's, whose tl.dot keeps its default precision): the bf16 bounds scaled by TF32's unit
roundoff over bf16's (2^-11 / 2^-8 = 1/8), since inputs that differ in their last fp32 bits
between the two runs can round to neighbouring TF32 values. The hybrid and vlm benchmarks widen
the bf16 bound to twice bf16's own rounding of the examples alone where they measure it larger."""


def save_checkpoint(model, folder: Path | str) -> Path:
    """`model` saved as published checkpoints are (save_pretrained: bf16, sharded safetensors, two
    shards at least), for the kit to load with from_pretrained as users load theirs (issue 60): a
    model built from its config skips what loading does (the weights' dtype, weights transformers
    keeps in fp32, tied weights, the loading path's hub kernels). Casts `model` to bf16 in place."""
    import torch

    size = sum(p.numel() for p in model.parameters()) * 2
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=size // 2 + 1)
    return Path(folder)


def packed_over_padded(models: dict, host: dict, real: int, warmup: int, device: str) -> dict:
    """Training steps (forward, backward, no optimizer) of each mode's model ("packed", "padded")
    on its batches (`host[mode]`, host tensors with `labels`), side by side: tokens/s of the `real`
    tokens the timed batches hold, peak GiB, the first loss and the share of padding, per mode."""
    from raypack.data.collate import move_batch

    out = {}
    for mode, model in models.items():

        def step(batch, model=model):
            loss = model(**move_batch(batch, device)).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        got = timed_steps(step, host[mode], warmup, device)
        out[mode] = {"tokens_per_s": real / got["seconds"], "peak_gib": got["peak_gib"],
                     "first_loss": got["values"][0].float().item(),
                     "padding": 1 - real / sum(b["input_ids"].numel() for b in host[mode][warmup:])}  # fmt: skip
        print(f"{mode:7s} {out[mode]['tokens_per_s']:10.0f} tok/s  peak {out[mode]['peak_gib']:.2f} GiB  "
              f"first loss {out[mode]['first_loss']:.4f}", flush=True)  # fmt: skip
    return out


def timed_steps(step, batches: list, warmup: int, device: str) -> dict:
    """`step(batch)` on every batch, the first `warmup` untimed (compilation, autotuning, the
    allocator's first growth). Returns the seconds of the rest (CUDA synchronized), the peak GiB
    allocated over them (CUDA; nan elsewhere) and every step's return value."""
    import torch

    cuda = device == "cuda"
    values = [step(b) for b in batches[:warmup]]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    values += [step(b) for b in batches[warmup:]]
    if cuda:
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "values": values,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}
