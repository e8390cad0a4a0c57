"""The two engines side by side, same model, same batches: DeepSpeed's ZeRO 1/2/3 against the torch
engine's DDP (the bare model on one rank) and FSDP2 at zero_stage 2 and 3 (issue 51). DeepSpeed
without ZeRO is left out: raypack refuses it under bf16 compute (raypack/config/__init__.py).

    PYTHONPATH=. python benchmarks/engines.py            # Llama-3-shaped ~1.2B, 16k-token rows, bf16, 1 GPU
    PYTHONPATH=. python benchmarks/engines.py --smoke    # tiny Llama on the CPU: both engines run

The model is built once from one seed and saved as published checkpoints are (save_pretrained,
bf16, sharded safetensors). Each engine in turn, in this process (a process group of one), loads
that folder as users load theirs (`load_model`, in the engine's weights dtype: bf16 for DeepSpeed,
which keeps its fp32 master copy in its optimizer; fp32 for the torch engine, which casts for the
forward), raypack's optimizer and schedule, and the chunked loss, then runs warm-up and measured
optimizer steps through the loop's own `take_step` (the host counts, the step read a step late).
Reported per engine: tokens/s over the measured steps, MFU (raypack's FLOP count,
metrics.model_flops_per_token), peak allocated memory, and the losses of the first steps, which
must agree across engines to bf16 noise (the same init and batches). train.precision mixed,
gradient clipping at 1.0, no checkpointing. Needs deepspeed for its side (on the GPU machine from
the wheels `make gpu-wheels` gathers); the torch side needs torch and transformers only.
Results: benchmarks/results/engines_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    command_line, gpu_or_smoke, machine, save_checkpoint, smoke_banner, versions, write_results,
)
from benchmarks.loss_memory import LLAMA3_1B, make_rows  # noqa: E402

ENGINES = (("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("torch", 0), ("torch", 2), ("torch", 3))
"""(train.engine, train.zero_stage), in the order they run."""
BASE = {0: 1}
"""The DeepSpeed stage a torch row is set against: its own, DDP's (replicated weights) ZeRO-1's."""


def save_model(args, device: str, folder: Path) -> Path:
    """The model every engine loads, saved once as published checkpoints are (bf16, sharded)."""
    from transformers import LlamaConfig

    from raypack.model.build import load_model

    torch.manual_seed(0)
    if args.smoke:
        model = load_model("tiny-llama", attention="auto", vocab_size=args.vocab or 768)
    else:
        config = LlamaConfig(**{**LLAMA3_1B, **({"vocab_size": args.vocab} if args.vocab else {})})
        with torch.device(device):  # initialize on the GPU: seconds instead of a minute on the host
            model = load_model(config, attention="auto", dtype="bfloat16")
    save_checkpoint(model, folder)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def engine_config(name: str, stage: int, device: str):
    """raypack's config for one engine row: bf16 compute on a GPU, fp32 on the CPU (--smoke)."""
    from raypack.config import load

    return load(None, [f"train.engine={name}", f"train.zero_stage={stage}", "train.num_workers=1", "train.grad_clip=1.0",
                       "train.warmup_steps=1", "train.lr=1e-4", f"train.use_gpu={device == 'cuda'}",
                       f"model.dtype={'float32' if device == 'cpu' else 'bfloat16'}"])


def run_engine(name: str, stage: int, args, device: str, rows: list[dict], folder: Path) -> dict:
    """Warm-up and measured steps of one engine: tokens/s, peak GiB, MFU and the losses."""
    from benchmarks.step_syncs import loop_worker
    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.loop import log_pending, take_step
    from raypack.train.objectives.loss import make_loss
    from raypack.train.metrics import model_flops_per_token, peak_flops
    from raypack.train.prefetch import prepare_step
    from raypack.train.stepvalues import HostCounts

    cfg = engine_config(name, stage, device)
    compute = engines.compute_dtype(cfg.train, cfg.model.dtype)
    # from the saved folder as users load a checkpoint, in the engine's weights dtype (bf16 for
    # DeepSpeed, fp32 for the torch engine); one rank: no zero.Init
    model = load_model(str(folder), attention="auto", dtype=engines.weights_dtype(cfg.train, cfg.model.dtype))
    engine = engines.build(model, cfg.train, dtype=compute, world_size=1, total_steps=len(rows))
    loss = make_loss(engine, "chunked")
    counts = HostCounts.open(1, engine.device)
    worker = loop_worker(cfg.train, engine, loss, counts, 0, len(rows))
    steps = [prepare_step([r], pin=device == "cuda") for r in rows]
    losses: list[float] = []
    worker.reporter.log_step = lambda number, values: losses.append(values["loss"])  # the values, read a step late
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = 0.0
    for i, step in enumerate(steps):
        if i == args.warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        assert take_step(worker, step, 0, 0.0)
    log_pending(worker)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens = sum(s.tokens for s in steps[args.warmup:])
    lengths = [len(r["position_ids"]) for r in rows]  # a row's examples: position_ids restart at each
    starts = [[i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["position_ids"])] for r in rows]
    examples = [b - a for s in starts for a, b in zip(s, s[1:])]
    mean = sum(examples) / len(examples)
    fpt = model_flops_per_token(engine.module.config, sum(x * x for x in examples) / len(examples), mean)
    peak = peak_flops()
    out = {"tokens_per_s": tokens / elapsed, "losses": losses, "rows": sum(lengths),
           "mfu": tokens / elapsed * fpt / peak if peak else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    engine.destroy()
    del engine, model, worker, loss
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


@contextlib.contextmanager
def one_rank(device: str):
    """A process group of one, with the variables a launcher would set (restored after)."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", **({"DS_ACCELERATOR": "cpu"} if device == "cpu" else {}))
    with tempfile.TemporaryDirectory(prefix="engines_") as tmp:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            from benchmarks.step_syncs import destroy_process_group

            destroy_process_group()
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def render(args, argv, device: str, results: dict) -> list[str]:
    lines = [f"# Engines side by side ({device})" + (" -- SMOKE RUN: not results" if args.smoke else ""), "",
             *smoke_banner(args.smoke), f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {machine()}",
             f"Versions: {versions('deepspeed', 'transformers')}", "",
             f"{'tiny-llama' if args.smoke else 'Llama-3-shaped ~1.2B'}, each engine loading one folder saved in bf16 "
             f"(save_pretrained, sharded safetensors), {args.tokens} tokens a row (FLAN-like examples), "
             f"one row a step, {args.warmup} warm-up and {args.steps} measured steps, train.precision mixed, the "
             "chunked loss, clipping at 1.0, no checkpointing, one rank.", "",
             "| engine | zero_stage | tokens/s | over DeepSpeed at that stage (DDP: ZeRO-1) | MFU | peak GiB | first losses |",
             "|---|---|---|---|---|---|---|"]
    for (name, stage), r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {stage} | failed: {r['error']} | | | | |")
            continue
        base = results.get(("deepspeed", BASE.get(stage, stage)))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and "error" not in base else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3])
        lines.append(f"| {name} | {stage} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {peak} | {losses} |")
    firsts = [r["losses"][0] for r in results.values() if "error" not in r and r["losses"]]
    if firsts:
        spread = (max(firsts) - min(firsts)) / abs(min(firsts))
        lines += ["", f"First-step losses agree across engines to {spread:.1e} relative (same init, same batches)."]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 256 tokens, 2 measured steps")
    p.add_argument("--tokens", type=int, default=None, help="tokens a row (default 16384; smoke 256)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (default 128256; smoke 768)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--engines", nargs="+", default=None, help="engine:stage pairs (default: all six)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = gpu_or_smoke(__file__, args.smoke, "measures both engines on a GPU")
    if device is None:
        return 2
    args.tokens = args.tokens or (256 if args.smoke else 16384)
    args.steps = args.steps or (2 if args.smoke else 10)
    chosen = [(e.split(":")[0], int(e.split(":")[1])) for e in args.engines] if args.engines else list(ENGINES)
    rows = make_rows(args.warmup + args.steps, args.tokens, args.vocab or (768 if args.smoke else LLAMA3_1B["vocab_size"]),
                     seed=0)
    results = {}
    with one_rank(device), tempfile.TemporaryDirectory(prefix="engines_model_") as tmp:
        folder = save_model(args, device, Path(tmp))
        for name, stage in chosen:
            try:
                results[(name, stage)] = run_engine(name, stage, args, device, rows, folder)
            except Exception as e:  # an OOM or a missing package: the row says so, the others still run
                results[(name, stage)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(f"{name} zero_stage {stage}: {results[(name, stage)]}", flush=True)
    path = write_results("engines", args.smoke, args.out, render(args, argv, device, results))
    print(f"results: {path}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
