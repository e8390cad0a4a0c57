"""Where a train step's time goes, by the PyTorch profiler: matmuls, attention, elementwise work,
the loss, the optimizer, communication, and the gaps where the GPU waits for the host (issue 24).

    PYTHONPATH=. python benchmarks/step_profile.py             # ~1.2B Llama, 16k tokens, bf16, one GPU
    PYTHONPATH=. python benchmarks/step_profile.py --compile   # the same with train.compile's layers
    PYTHONPATH=. python benchmarks/step_profile.py --smoke     # tiny model on the CPU: proves the script runs

The model and rows are benchmarks/loss_memory.py's (Llama-3.2-1B shape, random init, raypack's
varlen attention, one packed row of FLAN-like examples, the chunked loss), with gradient
checkpointing, torch's fused AdamW and, with --kernels liger, Liger-Kernel's kernels. After warm-up
steps, `--steps` steps run under `torch.profiler`; every device kernel's time is put in one bucket
by its name (BUCKETS, first match wins) and the rest of the steps' wall time, when no kernel ran,
is the host gap. On the CPU (--smoke) the buckets take the profiler's CPU ops instead, which only
proves the script runs. Results: benchmarks/results/step_profile_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, smoke_banner, versions, write_results  # noqa: E402
from benchmarks.loss_memory import build, make_rows, set_checkpointing  # noqa: E402
from raypack.data.collate import move_batch  # noqa: E402
from raypack.model import kernels  # noqa: E402
from raypack.train.objectives.loss import make_loss  # noqa: E402
from raypack.train.prefetch import prepare_step  # noqa: E402

BUCKETS = [  # (bucket, regex over kernel or op names), first match wins
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|c10d"),
    ("attention", r"flash|fmha|varlen|attention|sdpa|_efficient_attention"),
    ("loss (chunked cross-entropy)", r"cross_?entropy|log_?softmax|nll_loss|chunked"),
    ("optimizer", r"adam|foreach|multi_tensor|optimizer"),
    ("matmuls", r"gemm|cutlass|sm90|sm80|cublas|matmul|aten::(mm|addmm|bmm|linear)\b|nvjet|ampere_|hopper_"),
    ("elementwise and norms", r"elementwise|vectorized|reduce|norm|triton|silu|gelu|mul|add|copy|cat|index|rope"),
]
OTHER = "other kernels"


def bucket(name: str) -> str:
    for label, pattern in BUCKETS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return OTHER


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256 tokens, CPU: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens a packed row (default 16384; smoke 256)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (compilation, caches)")
    p.add_argument("--compile", action="store_true", help="train.compile: each decoder layer compiled")
    p.add_argument("--kernels", choices=["none", "liger"], default="none", help="model.kernels")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = gpu_or_smoke(__file__, args.smoke, "profiles a GPU train step")
    if device is None:
        return 2
    tokens = args.tokens or (256 if args.smoke else 16384)
    model = build(args, device)
    if args.kernels == "liger":
        kernels.apply_kernels(model, "liger", device)
    set_checkpointing(model, True)
    if args.compile:
        kernels.compile_layers(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    loss = make_loss(model, "chunked")
    rows = make_rows(args.warmup + args.steps, tokens, model.config.vocab_size, 0)
    batches = [move_batch(prepare_step([r], pin=device == "cuda").batches[0], device) for r in rows]

    def step(batch):
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for batch in batches[: args.warmup]:
        step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for batch in batches[args.warmup:]:
            step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    # On the GPU, device kernels (self time, so nothing counts twice); on the CPU, the top-level ops.
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if device == "cuda":
            seconds = event.self_device_time_total / 1e6 if event.device_type == torch.autograd.DeviceType.CUDA else 0.0
        else:
            seconds = event.self_cpu_time_total / 1e6 if event.key.startswith("aten::") else 0.0
        if seconds:
            times[bucket(event.key)] = times.get(bucket(event.key), 0.0) + seconds
    busy = sum(times.values())
    gap = max(wall - busy, 0.0) if device == "cuda" else float("nan")
    tok_s = tokens * args.steps / wall
    lines = [
        f"# Where a train step's time goes, {device_name()}, {time.strftime('%Y-%m-%d')}", *smoke_banner(args.smoke), "",
        f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {machine()}. Versions: {versions('liger_kernel')}.", "",
        f"Model: {'tiny-llama' if args.smoke else 'Llama-3.2-1B shape'}, one packed row of {tokens:,} tokens, gradient "
        f"checkpointing, chunked loss, {'fused ' if device == 'cuda' else ''}AdamW{', compiled layers' if args.compile else ''}"
        f"{', Liger kernels' if args.kernels == 'liger' else ''}; {args.steps} profiled steps after {args.warmup}: "
        f"{wall:.3f} s, {tok_s:,.0f} tokens/s.", "",
        "| where | seconds | share of the steps' wall time |", "|---|---|---|",
    ]  # fmt: skip
    for label in [b for b, _ in BUCKETS] + [OTHER]:
        if label in times:
            lines.append(f"| {label} | {times[label]:.3f} | {times[label] / wall:.1%} |")
    if device == "cuda":
        lines.append(f"| host gaps (no kernel running) | {gap:.3f} | {gap / wall:.1%} |")
    lines += ["", "Buckets are kernel-name patterns (benchmarks/step_profile.py BUCKETS), first match wins; "
              "the host gap is the wall time less the kernels' time (kernels on several streams could overlap, "
              "which would shrink it).", ""]
    write_results("step_profile", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
