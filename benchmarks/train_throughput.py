"""Full stack (Ray Train + DeepSpeed + raypack's loop) against the same DeepSpeed step run standalone.

    PYTHONPATH=. python benchmarks/train_throughput.py                 # ~1B Llama, bf16, 16k-token packs, 1 GPU
    PYTHONPATH=. python benchmarks/train_throughput.py --zero-stage 1 --steps 60
    PYTHONPATH=. python benchmarks/train_throughput.py --smoke         # tiny model on the CPU: proves the script runs

One run, same data, same model init, same lr schedule, both paths back to back:

1. Data: FLAN-like lengths (raypack.data.synthetic.sample_lengths) with random token ids, written as a
   pre-tokenized Parquet file (`input_ids`). raypack's own `prepare` (tokenize passthrough, balanced
   plan for 1 rank, pack) writes the packed folder once, under the run directory.
2. Full stack: `raypack.train.trainer.start(cfg)` on one worker: the unmodified
   `train_loop_per_worker` (it reuses the packed folder: same fingerprint). Throughput comes from
   the per-step TensorBoard events rank 0 writes (tokens, step time, data wait, wall time), so the
   measured window is exactly steps warmup+1..warmup+steps and includes everything between steps
   (reports, logging); the run saves no checkpoint (train.save_final: false). The last report's
   tokens_per_s and mfu are shown as well: they count only time inside train_step, over its window.
3. Standalone: in this process, a 1-process torch.distributed group, what each worker runs
   (`raypack.train.loop.setup`, `raypack.train.objectives.loss.make_loss`, the prefetcher and
   `raypack.train.step.train_step`) on the very same packed rows (`iter_rank_packs`, read into
   memory first), timed the same way.

The full stack runs first, so its worker has the GPU to itself; the standalone path runs after the
Ray worker group is gone. Per-step losses of the two paths are compared: they should agree up to
bf16/kernel noise, which shows that both consumed the same batches from the same init.
tokens/s counts real tokens. MFU uses raypack.train.metrics.model_flops_per_token, the loop's own
count, for both paths. Data wait is the time the loop waited for its next micro-batches (the
prefetcher's queue), as a share of the step time; both paths use the configured loss (`--loss`,
chunked by default).
Results go to benchmarks/results/train_<device>_<yyyymmdd>.md, or with --smoke to the temp folder
(see benchmarks/common.py). Needs ray and deepspeed (on the GPU machine, from the wheels that
tools/gpu_wheels.sh gathers; `make bench-gpu` installs them).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Before Ray starts (the raylet and its workers inherit the driver's environment):
# ray.train.report blocks ~2 s per call at the default health-check interval (raypack/runtime.py).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
# DeepSpeed's op_builder fails to parse "9.0a"; raypack passes a torch optimizer so nothing
# should build on CUDA, but a stray JIT build must not die on it.
if "a" in os.environ.get("TORCH_CUDA_ARCH_LIST", "a"):
    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").replace("a", "") or "9.0"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import deepspeed  # noqa: E402, F401  (checked here; its version goes in the results file)
    import ray  # noqa: E402
except ImportError as e:  # the GPU machine has neither until the wheels are installed
    sys.exit(f"train_throughput.py needs ray and deepspeed ({e}); on the GPU machine `make bench-gpu` installs "
             "them from the wheels in .whl (tools/gpu_wheels.sh gathers them)")  # fmt: skip

from benchmarks.attention_throughput import LLAMA_1B  # noqa: E402
from benchmarks.common import (  # noqa: E402
    command_line, device_name, gpu_or_smoke, machine, results_path, save_checkpoint, smoke_banner, versions,
)

from raypack.config import Config, DataConfig, ModelConfig, PackConfig, RunConfig, TokenizeConfig, TrainConfig  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402
from raypack.model import attention as attn  # noqa: E402

TARGET_RATIO = 0.9  # full stack tokens/s over standalone
TARGET_MFU = 0.40  # ~1B Llama, bf16, ~16k tokens per micro-batch, on an H100
TARGET_WAIT = 0.02  # time the loop waits for its next micro-batches, over the step time


# --- data ------------------------------------------------------------------------------------------


def write_examples(path: Path, packs: int, budget: int, vocab: int, seed: int) -> dict:
    """Enough FLAN-like examples (random ids in [3, vocab)) for `packs` full packs, as pre-tokenized
    Parquet. Returns counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    max_length = min(4096, budget)
    probe = sample_lengths("flan", 20_000, seed=seed + 1, max_length=max_length)
    # 10% slack for packing losses plus one extra pack; `main` checks the plan's step count.
    n = int(np.ceil((packs + 1) * budget * 1.1 / probe.mean()))
    lengths = sample_lengths("flan", n, seed=seed, max_length=max_length)
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return {"examples": n, "tokens": int(lengths.sum()), "mean_length": float(lengths.mean())}


def make_config(args, workdir: Path, data_path: Path, model_name: str, use_gpu: bool, total_steps: int) -> Config:
    return Config(
        data=DataConfig(paths=(str(data_path),), format="tokenized", eval_fraction=0.0),
        tokenize=TokenizeConfig(num_cpus=0.5),
        pack=PackConfig(strategy="balanced", budget=args.budget, seed=args.seed),
        model=ModelConfig(
            name=model_name, attention="auto", dtype="float32" if args.smoke else "bfloat16",
            gradient_checkpointing=args.gradient_checkpointing,
        ),
        train=TrainConfig(
            num_workers=1, use_gpu=use_gpu, cpus_per_worker=1.0, zero_stage=args.zero_stage, optimizer="torch",
            grad_accum=1, epochs=1, max_steps=total_steps, seed=args.seed, warmup_steps=2, lr=1e-4, loss=args.loss,
            report_every_steps=args.report_every, checkpoint_every_steps=0, eval_every_steps=0,
            max_failures=0, tensorboard=True, mlflow=False, save_final=False,  # no checkpoint to measure
        ),
        run=RunConfig(name=f"train_bench_{os.getpid()}_{int(time.time())}", storage_path=str(workdir / "runs")),
    )  # fmt: skip


# --- measurement -------------------------------------------------------------------------------------


def read_tensorboard(tb_dir: str) -> dict[int, dict[str, float]]:
    """{step: {tag: value, "wall_time": t}} from tensorboardX event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    steps: dict[int, dict[str, float]] = {}
    for f in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                entry = steps.setdefault(event.step, {})
                entry[value.tag] = value.simple_value
                if value.tag == "train/tokens":
                    entry["wall_time"] = event.wall_time
    return steps


def window(step_tokens: list[float], step_times: list[float], waits: list[float], start: float, end: float) -> dict:
    tokens = sum(step_tokens)
    return {
        "tokens": tokens,
        "steps": len(step_tokens),
        "wall_s": end - start,
        "tokens_per_s": tokens / (end - start),
        "in_step_tokens_per_s": tokens / sum(step_times),
        "data_wait_s": sum(waits) / len(waits),
        "data_wait_share": sum(waits) / sum(step_times),
    }


def run_full_stack(cfg: Config, warmup: int, steps: int) -> dict:
    from raypack.runs import run_dir
    from raypack.train.trainer import start

    t0 = time.perf_counter()
    result = start(cfg).result
    fit_s = time.perf_counter() - t0
    if result.error is not None:
        raise RuntimeError(f"full-stack run failed: {result.error}")
    tb = read_tensorboard(f"{run_dir(cfg)}/tensorboard")
    missing = [s for s in range(warmup, warmup + steps + 1) if s and s not in tb]
    if missing:
        raise RuntimeError(f"TensorBoard events lack steps {missing[:5]}...; cannot time the full stack")
    measured = range(warmup + 1, warmup + steps + 1)
    start = tb[warmup]["wall_time"] if warmup else None
    if start is None:
        raise ValueError("--warmup must be >= 1: the window starts at the end of the last warmup step")
    out = window([tb[s]["train/tokens"] for s in measured], [tb[s]["train/step_time_s"] for s in measured],
                 [tb[s]["train/data_wait_s"] for s in measured], start, tb[warmup + steps]["wall_time"])  # fmt: skip
    last = tb[warmup + steps]  # the last step reports: its summary scalars are in the events too
    out.update(
        losses=[tb[s]["train/loss"] for s in range(1, warmup + steps + 1)],
        reported_tokens_per_s=last.get("train/tokens_per_s"),
        reported_mfu=last.get("train/mfu"),
        peak_gib=last.get("train/peak_memory_gb"),
        fit_s=fit_s,
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_standalone(cfg: Config, prepared, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from raypack.data.shards import iter_rank_packs
    from raypack.train.loop import setup
    from raypack.train.step import train_step
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import Prefetcher, prepare_step
    from raypack.train.stepvalues import HostCounts

    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        # exactly what each Ray Train worker does (raypack.train.loop.train_loop_per_worker)
        engine, total = setup(cfg, prepared, 1)
        loss = make_loss(engine, cfg.train.loss, cfg.train.loss_chunk_tokens, padded=prepared.padded)
        rows = list(iter_rank_packs(prepared.train_dir, 0))[: warmup + steps]
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        losses, tokens, times, waits = [], [], [], []
        start = None

        def prepare(group):
            return prepare_step(group, padded=prepared.padded, pad_token_id=prepared.pad_token_id, pin=cuda)

        def read(pending, i):
            values = pending.resolve()
            losses.append(values["loss"])
            if i >= warmup:
                tokens.append(values["tokens"])
                times.append(values["step_time_s"])
                waits.append(values["data_wait_s"])

        counts, pending = HostCounts(world=1), None
        with Prefetcher(rows, 1, prepare) as batches:
            for i in range(len(rows)):
                if i == warmup:
                    if pending is not None:  # the warm-up's last step, read before the clock starts
                        read(pending, i - 1)
                        pending = None
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                t0 = time.perf_counter()
                step = next(batches)
                # as the loop does: enqueue this step, then read the last one's values
                current = train_step(engine, step, loss, counts, i + 1, wait_s=time.perf_counter() - t0)
                if pending is not None:
                    read(pending, i - 1)
                pending = current
        if pending is not None:
            read(pending, len(rows) - 1)
        if cuda:
            torch.cuda.synchronize()
        out = window(tokens, times, waits, start, time.perf_counter())
        out.update(
            losses=losses, num_params=num_params, model_config=engine.module.config,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        )  # fmt: skip
        del engine
        return out
    finally:
        dist.destroy_process_group()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


# --- main ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256-token packs, few steps, CPU: proves the script runs")
    p.add_argument("--steps", type=int, default=None, help="measured optimizer steps per path (default 40; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps before them, >= 1 (default 10; smoke 1)")
    p.add_argument("--budget", type=int, default=None, help="tokens per packed micro-batch (default 16384; smoke 256)")
    p.add_argument("--model-size", choices=["1b"], default="1b", help="Llama-style model, random init (ignored with --smoke)")
    p.add_argument("--loss", choices=["chunked", "full"], default="chunked", help="train.loss of both paths")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--report-every", type=int, default=20, help="train.report_every_steps of the full stack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="data, model and run folder (default: a fresh /tmp dir, removed after)")
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.budget = args.budget or (256 if args.smoke else 16384)
    if args.warmup < 1:
        p.error("--warmup must be >= 1")

    device = gpu_or_smoke(__file__, args.smoke, "is a GPU benchmark")
    if device is None:
        return 2
    cuda = device == "cuda"
    total_steps = args.warmup + args.steps
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="raypack_train_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        from raypack.data.listing import Sources
        from raypack.data.prepare import prepare
        from raypack.runs import absolute_paths, run_dir
        from raypack.runtime import init_ray

        # Model: tiny-llama (vocab sized to the bundled tokenizer), or a random-init ~1B Llama saved
        # once so that the Ray worker and this process load identical weights by path.
        if args.smoke:
            model_name, vocab = "tiny-llama", 768
        else:
            model_name, vocab = str(workdir / "model"), LLAMA_1B["vocab_size"]
            save_random_model(model_name, args.seed)
        data = write_examples(workdir / "data" / "examples.parquet", total_steps, args.budget, vocab, args.seed)
        cfg = make_config(args, workdir, workdir / "data" / "examples.parquet", model_name, cuda, total_steps)
        cfg = absolute_paths(cfg)

        init_ray()
        # The same call start makes; start then reuses this folder (same fingerprint).
        prepared = prepare(cfg, cfg.train.num_workers, f"{run_dir(cfg)}/packed", Sources.of(cfg.data.paths))
        if prepared.steps_per_rank < total_steps:
            raise RuntimeError(f"the plan has {prepared.steps_per_rank} packs, fewer than {total_steps} steps")
        print(f"data: {data['examples']} examples, {data['tokens']} tokens, {prepared.steps_per_rank} packs of "
              f"<= {args.budget} tokens, packing efficiency {prepared.stats.get('packing_efficiency', float('nan')):.3f}",
              flush=True)  # fmt: skip

        full = run_full_stack(cfg, args.warmup, args.steps)
        print(f"full stack  {full['tokens_per_s']:10.0f} tok/s wall ({full['in_step_tokens_per_s']:.0f} in-step; "
              f"reported {full['reported_tokens_per_s'] or 0:.0f}); data wait {full['data_wait_share']:.2%} of step time",
              flush=True)  # fmt: skip
        ray.shutdown()  # the worker group is gone already; this frees the driver's Ray state too
        alone = run_standalone(cfg, prepared, args.warmup, args.steps)
        print(f"standalone  {alone['tokens_per_s']:10.0f} tok/s wall ({alone['in_step_tokens_per_s']:.0f} in-step); "
              f"data wait {alone['data_wait_share']:.2%} of step time", flush=True)  # fmt: skip

        from raypack.train.metrics import model_flops_per_token, peak_flops

        # The count the loop reports, from the model config and the trained examples' lengths.
        fpt = model_flops_per_token(alone["model_config"], prepared.length_sq_mean, prepared.length_mean)
        peak = peak_flops()
        for r in (full, alone):
            r["mfu"] = r["tokens_per_s"] * fpt / peak if peak else None
        n = min(len(full["losses"]), len(alone["losses"]))
        loss_diff = max(abs(a - b) for a, b in zip(full["losses"][:n], alone["losses"][:n]))
        ratio = full["tokens_per_s"] / alone["tokens_per_s"]
        print(f"ratio full/standalone {ratio:.3f}  max |loss diff| {loss_diff:.2e}  "
              f"losses full {fmt_losses(full['losses'])} standalone {fmt_losses(alone['losses'])}", flush=True)  # fmt: skip
        if full["mfu"] is not None:
            print(f"MFU full {full['mfu']:.3f} standalone {alone['mfu']:.3f}")

        report = render(args, argv, device, data, prepared, alone["num_params"], fpt, full, alone, ratio, loss_diff)
        out = results_path("train", args.smoke, args.out)
        out.write_text(report)
        print(f"wrote {out}")
        return 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def save_random_model(path: str, seed: int) -> None:
    from transformers import LlamaConfig

    from raypack.model.build import load_model

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_1B, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # seconds on the GPU, a minute on the host
        model = load_model(config, attention="sdpa", dtype="bfloat16")
    save_checkpoint(model, path)  # bf16, sharded, as published checkpoints are
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the Ray worker, another process, gets the whole GPU


def fmt_losses(losses: list[float]) -> str:
    shown = [f"{x:.4f}" for x in losses[:4]]
    return "[" + ", ".join(shown) + (", ...]" if len(losses) > 4 else "]")


def render(args, argv, device, data, prepared, params, fpt, full, alone, ratio, loss_diff) -> str:
    context = prepared.length_sq_mean / (2 * prepared.length_mean)  # mean causal context of a token
    backend = "flash_attn" if attn.flash_attn_available() and device == "cuda" else ("torch_varlen" if device == "cuda" else "sdpa_varlen")

    def num(x, spec=".0f"):
        return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    def verdict(ok: bool) -> str:  # targets are for a ~1B model on a GPU; a smoke run proves nothing
        return "(not judged: smoke run)" if args.smoke else "(met)" if ok else "(missed)"

    lines = [
        f"# Train throughput: Ray Train + DeepSpeed vs standalone DeepSpeed, {device_name()}, "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        *smoke_banner(args.smoke),
        f"- machine: {machine()}",
        f"- versions: {versions('deepspeed', 'ray')}, flash-attn {'yes' if attn.flash_attn_available() else 'no'}; "
        f"varlen backend: {backend}",
        f"- model: {'tiny-llama' if args.smoke else 'Llama-style ' + args.model_size}, {params / 1e6:.1f}M parameters, "
        f"{'fp32' if args.smoke else 'bf16'}, random init; gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}",
        f"- DeepSpeed ZeRO-{args.zero_stage}, torch AdamW{' (fused)' if device == 'cuda' else ''}, 1 rank, grad_accum 1, "
        f"one packed row of <= {args.budget} tokens per step; train.loss {args.loss}",
        f"- data: {data['examples']} FLAN-like examples (random ids, mean length {data['mean_length']:.0f}), "
        f"balanced plan, packing efficiency {prepared.stats.get('packing_efficiency', float('nan')):.3f}; "
        f"{args.warmup} warmup + {args.steps} measured steps per path, seed {args.seed}",
        f"- full stack: report_every_steps {args.report_every}, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="
        f"{os.environ.get('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S')}, TensorBoard on; fit took {full['fit_s']:.0f} s in all",
        f"- MFU over dense bf16 peak: {fpt / 1e9:.2f} GFLOP/token, the count the loop reports "
        "(raypack.train.metrics.model_flops_per_token: matmul weights and LM head, plus attention over "
        f"a mean causal context of {context:.0f} tokens)",
        "",
        "| path | tokens/s (wall) | tokens/s (in train_step) | MFU (wall) | peak GiB | data wait / step | share of step time |",
        "|---|---|---|---|---|---|---|",
        f"| full stack (Ray Train + DeepSpeed) | {full['tokens_per_s']:.0f} | {full['in_step_tokens_per_s']:.0f} | "
        f"{pct(full['mfu'])} | {num(full['peak_gib'], '.2f')} | {full['data_wait_s'] * 1e3:.2f} ms | {full['data_wait_share']:.2%} |",
        f"| standalone (DeepSpeed, same process) | {alone['tokens_per_s']:.0f} | {alone['in_step_tokens_per_s']:.0f} | "
        f"{pct(alone['mfu'])} | {num(alone['peak_gib'], '.2f')} | {alone['data_wait_s'] * 1e3:.2f} ms | "
        f"{alone['data_wait_share']:.2%} |",
        "",
        f"Full stack's own final report (its TensorBoard summary, last {args.report_every}-step window or less, time inside "
        f"train_step only): tokens_per_s {num(full['reported_tokens_per_s'])}, mfu {pct(full['reported_mfu'])}.",
        "",
        "| target | value | |",
        "|---|---|---|",
        f"| tokens/s full stack / standalone (wall) | {ratio:.3f}x | >= {TARGET_RATIO}x {verdict(ratio >= TARGET_RATIO)} |",
        f"| data wait / step time, full stack | {full['data_wait_share']:.2%} | <= {TARGET_WAIT:.0%} "
        f"{verdict(full['data_wait_share'] <= TARGET_WAIT)} |",
    ]
    if full["mfu"] is not None:
        lines.append(f"| MFU, full stack (wall) | {full['mfu']:.1%} | >= {TARGET_MFU:.0%} "
                     f"{verdict(full['mfu'] >= TARGET_MFU)} |")  # fmt: skip
    else:
        lines.append(f"| MFU, full stack | n/a (no known peak for this device) | >= {TARGET_MFU:.0%} |")
    lines += [
        "",
        f"Per-step losses, steps 1-{len(full['losses'])}: the paths agree to {loss_diff:.2e} at most (same batches, "
        "same init; bf16 and kernel nondeterminism allow small differences).",
        "",
        "Wall tokens/s: real tokens of the measured steps over the time from the end of the last warmup step to "
        "the end of the last measured step (full stack: rank 0's per-step TensorBoard wall times; standalone: "
        "perf_counter after a host sync), so it includes data reads, reports and logging between steps. "
        "Data wait: how long the loop waited for the prefetcher to hand it the step's micro-batches (reading, "
        "collating and pinning run in a background thread), over the step time (that wait plus train_step).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
