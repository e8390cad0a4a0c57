"""What each recompute mode and each elementwise-kernel choice costs on one GPU: the numbers
`model.gradient_checkpointing: auto` and `model.kernels: auto` under `train.compile` are to be
decided by (issue 35 parts 2 and 4).

    PYTHONPATH=. python benchmarks/recompute.py            # one GPU
    PYTHONPATH=. python benchmarks/recompute.py --smoke    # tiny model on the CPU: proves the script runs

A Llama-3.2-1B-shaped model (benchmarks/loss_memory.py's), bf16, raypack's varlen attention and
chunked loss, full fine-tuning with torch AdamW, one packed row of `--tokens` tokens (FLAN-like
examples) a step. Settings, each in its own process (an out-of-memory error leaves nothing
behind): `model.gradient_checkpointing` none / selective / full, each eager and compiled
(`train.compile`, the elementwise work fused by Inductor), and, where liger-kernel is installed,
Liger's kernels uncompiled (not with selective, which raypack refuses there) and compiled (opaque
ops in the graphs). Per setting, after `--warmup` steps: tokens/s over `--steps` steps,
the peak memory of a step, the memory resident after the optimizer step (weights, gradients,
AdamW state), and their difference, the step's transient memory, beside raypack's estimate of
what depends on the mode (activations and the loss's working set, raypack/train/memory/estimate.py):
where the measured transient passes the estimate, `auto`'s margin is too thin.

What decides `auto`: the fastest mode whose peak fits (the estimate should order them the same
way), and for `model.kernels: auto` with `train.compile` (raypack/model/kernels.py, KERNELS_COMPILED):
compiled without Liger against compiled with Liger, at the same mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, smoke_banner, versions, write_results  # noqa: E402

MODES = ("none", "selective", "full")
KINDS = ("eager", "compiled", "liger", "compiled-liger")
"""eager: the model's own code; compiled: train.compile with model.kernels none (Inductor fuses
the elementwise work); liger: Liger-Kernel's RMSNorm, RoPE and SwiGLU, not compiled;
compiled-liger: both, Liger's calls opaque ops in the compiled graphs (raypack/model/liger_graph.py)."""


def child(args) -> None:
    """One setting: warm-up steps, timed steps, one JSON line."""
    import torch
    from transformers import LlamaConfig

    from benchmarks.loss_memory import LLAMA3_1B, make_rows
    from raypack.config import load
    from raypack.data.collate import collate_packed, move_batch
    from raypack.model.build import load_model
    from raypack.model.kernels import apply_kernels, check_compiled, compile_layers, compiled_graphs
    from raypack.train.objectives.loss import label_targets, make_loss, probe_batch
    from raypack.train.memory.estimate import Arch, estimate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA3_1B) if not args.smoke else None
    with torch.device(device):
        model = load_model(config or "tiny-llama", attention="auto", dtype="bfloat16" if device == "cuda" else "float32",
                           vocab_size=768, gradient_checkpointing=args.mode)  # fmt: skip
    if "liger" in args.kind:
        apply_kernels(model, "liger", device, compiled=args.kind == "compiled-liger")
    model.train()
    loss = make_loss(model, "chunked")
    if args.kind.startswith("compiled"):
        compile_layers(model)
        check_compiled(model, move_batch(probe_batch(loss.vocab, False), device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    batch = collate_packed(make_rows(1, args.tokens, loss.vocab, seed=0))
    batch.update(label_targets(batch["labels"]))
    batch = move_batch(batch, device)

    def step() -> None:
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(args.warmup):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.steps
    except torch.OutOfMemoryError:
        print("ROW " + json.dumps({"oom": True}), flush=True)
        return
    cfg = load(None, [f"pack.budget={args.tokens}", "train.num_workers=1", "train.use_gpu=true"])
    mem = estimate(cfg, Arch.from_config(model.config), checkpointing=args.mode)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    print("ROW " + json.dumps({
        "tokens_s": args.tokens / seconds, "peak": peak, "resident": resident if device == "cuda" else float("nan"),
        "estimate": mem.activations + mem.loss, "graphs": compiled_graphs() if args.kind.startswith("compiled") else None,
    }), flush=True)  # fmt: skip


def run_setting(args, mode: str, kind: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--kind", kind, "--tokens", str(args.tokens),
           "--warmup", str(args.warmup), "--steps", str(args.steps), *(["--smoke"] if args.smoke else [])]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        result = rows[-1] if rows else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    except subprocess.TimeoutExpired:
        result = {"error": f"over {args.timeout} s"}
    print(mode, kind, result, flush=True)
    return result


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}" if x == x else "n/a"  # nan on the CPU


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, short row, CPU: proves the script runs")
    p.add_argument("--tokens", type=int, default=16_384, help="tokens of the packed row")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for one setting, compile included")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.smoke:
        args.tokens, args.warmup, args.steps, args.kinds = 96, 1, 1, ["eager", "compiled"]
    if gpu_or_smoke(__file__, args.smoke, "measures the recompute modes") is None:
        return 2
    from raypack.model.kernels import liger_installed

    kinds = [k for k in args.kinds if "liger" not in k or liger_installed()]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    # a smoke run compiles one mode only: Inductor on 2 CPU cores takes most of a minute a setting
    settings = [(m, k) for k in kinds for m in args.modes if not (args.smoke and k == "compiled" and m != "selective")
                and not (k == "liger" and m == "selective")]
    results = {(m, k): run_setting(args, m, k) for m, k in settings}
    lines = [f"# Recompute modes and elementwise kernels, {device_name()}, {time.strftime('%Y-%m-%d')}",
             *smoke_banner(args.smoke), "", f"Command: `{command_line(__file__, argv)}`", "",
             f"Machine: {machine()}; started {started}. Versions: {versions('triton', 'liger_kernel')}.", "",
             f"One packed row of {args.tokens:,} tokens a step, {args.warmup} warm-up and {args.steps} timed steps; "
             "transient = peak - resident (after the optimizer step); estimate = raypack's activations + loss for "
             "the mode.", "",
             "| mode | kernels | tokens/s | peak GiB | resident GiB | transient GiB | estimate GiB | transient / estimate |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (mode, kind), r in results.items():
        if "tokens_s" not in r:
            lines.append(f"| {mode} | {kind} | {'out of memory' if r.get('oom') else r.get('error')} | | | | | |")
            continue
        transient = r["peak"] - r["resident"]
        lines.append(f"| {mode} | {kind} | {r['tokens_s']:,.0f} | {_gib(r['peak'])} | {_gib(r['resident'])} | "
                     f"{_gib(transient)} | {_gib(r['estimate'])} | "
                     f"{transient / r['estimate']:.2f} |" if transient == transient else
                     f"| {mode} | {kind} | {r['tokens_s']:,.0f} | n/a | n/a | n/a | {_gib(r['estimate'])} | n/a |")
    lines += ["", "Read it: the fastest mode per kernels column is what `auto` should take when it fits; compiled "
              "against compiled-liger at one mode is `model.kernels: auto`'s choice under `train.compile` "
              "(KERNELS_COMPILED in raypack/model/kernels.py).", ""]
    write_results("recompute", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
