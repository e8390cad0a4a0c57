"""raypack against TRL's SFTTrainer on the same GPU, in one run (`make bench-peers`).

    PYTHONPATH=. python benchmarks/peers.py                # ~1B Llama, bf16, 16k-token packs, 1 GPU
    PYTHONPATH=. python benchmarks/peers.py --smoke        # tiny model on the CPU: proves the script runs

The same model (a random-init Llama saved once; no download), the same data, the same budget,
tokens per optimizer step and number of optimizer steps, for each configuration, one after the
other, each in a fresh process so that its wall time includes its own start-up:

- `trl-sdpa`: TRL's `SFTTrainer` at its best on a bare machine: `packing=True` with its `bfd`
  strategy and padding-free batches (its collator passes cu_seq_lens), its default loss, bf16,
  gradient checkpointing as raypack's run uses it, Liger (`use_liger_kernel`) where installed,
  and transformers' `sdpa` attention (what TRL gets without the flash-attn package).
- `trl-varlen`: the same with raypack's varlen attention registered with transformers
  (`raypack_varlen`: torch's varlen_attn on CUDA), so the kernels are equal and the trainers are
  compared.
- `raypack`: `raypack train`'s own stack on one GPU (Ray Train, DeepSpeed ZeRO-2, its loop, the
  chunked loss), with its defaults.
- `raypack-fast`: the same with `train.compile` and `model.kernels: auto` (Liger where installed).

Data: pre-tokenized random ids, half FLAN-like and half WildChat-like lengths (clipped to the
budget), `--examples` of them; both sides train on every token. Measured per configuration: real
tokens/s over optimizer steps warmup+1..warmup+steps, peak GPU memory, MFU (raypack's FLOP count,
raypack.train.metrics.model_flops_per_token, for both), wall time from the process's start to its
last step (start-up and data preparation included), the loss at the last step (after the same
number of steps of the same token budget), and for compiled runs the graphs Dynamo compiled.
Results: benchmarks/results/peers_<device>_<yyyymmdd>.md (with --smoke, the temp folder).
Needs trl (the `bench` and `dev` extras), ray and deepspeed (on the GPU machine, the wheels
tools/gpu_wheels.sh gathers; `make bench-peers` installs them as `make bench-gpu` does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # ray.train.report blocks ~2 s a call otherwise

import numpy as np  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, smoke_banner, versions, write_results  # noqa: E402

CONFIGS = ("trl-sdpa", "trl-varlen", "raypack", "raypack-fast")
GOALS = {  # issue 24, on an H100
    "raypack / trl-varlen tokens/s": 1.3,
    "raypack / trl-sdpa tokens/s": 4.0,
}


# --- the shared inputs ---------------------------------------------------------------------------


def write_data(path: Path, n: int, budget: int, vocab: int, seed: int) -> dict:
    """`n` pre-tokenized examples, half FLAN-like and half WildChat-like lengths, as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raypack.data.synthetic import sample_lengths

    half = n // 2
    lengths = np.concatenate([sample_lengths("flan", half, seed=seed, max_length=budget),
                              sample_lengths("wildchat", n - half, seed=seed + 1, max_length=budget)])
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(3, vocab, size=int(offsets[-1]), dtype=np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}), path)
    return {"examples": n, "tokens": int(lengths.sum()), "mean_length": float(lengths.mean()),
            "length_sq_mean": float((lengths.astype(np.float64) ** 2).mean())}


def save_model(path: Path, smoke: bool, seed: int) -> None:
    import torch
    from transformers import LlamaConfig

    from benchmarks.attention_throughput import LLAMA_1B
    from raypack.model.build import load_model, tiny_config

    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=768) if smoke else LlamaConfig(**LLAMA_1B, pad_token_id=0,
                                                                           bos_token_id=1, eos_token_id=2)
    config.use_cache = False  # with a cache, transformers' sdpa lets packed examples see each other
    model = load_model(config, attention="sdpa", dtype="float32" if smoke else "bfloat16")
    model.save_pretrained(path, safe_serialization=True)


# --- one configuration, in its own process -----------------------------------------------------------


def child_trl(args, work: Path, attention: str) -> dict:
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from raypack.config import ASSETS
    from raypack.model.attention import attn_implementation_name
    from raypack.model.kernels import liger_installed

    cuda = torch.cuda.is_available()
    impl = "sdpa" if attention == "sdpa" else attn_implementation_name("auto")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=dtype, attn_implementation=impl)
    data = datasets.load_dataset("parquet", data_files=str(work / "data.parquet"), split="train")
    tokens, times = [], []

    def count(module, args, kwargs):  # every micro-batch's real tokens: padding-free rows carry no pad
        tokens.append(int(kwargs["input_ids"].numel()))

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append((time.time(), sum(tokens)))
            if len(times) == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

    liger = cuda and liger_installed()
    config = SFTConfig(
        output_dir=str(work / f"trl-{attention}"), packing=True, packing_strategy="bfd", padding_free=True,
        max_length=args.budget, per_device_train_batch_size=1, gradient_accumulation_steps=args.accum,
        bf16=cuda, activation_checkpointing=args.gradient_checkpointing, use_liger_kernel=liger,
        max_steps=args.warmup + args.steps, learning_rate=1e-4, lr_scheduler_type="cosine", warmup_steps=2,
        logging_steps=1, report_to=[], save_strategy="no", seed=args.seed, dataloader_num_workers=0,
        use_cpu=not cuda,
    )  # fmt: skip
    # The data is tokenized already; TRL still wants a tokenizer (for its pad id): the bundled one.
    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (t0, n0), (t1, n1) = times[args.warmup - 1], times[-1]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0), "last_step_time": t1, "loss": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "tokens_per_step": (n1 - n0) / args.steps, "liger": liger}


def child_raypack(args, work: Path, fast: bool) -> dict:
    from benchmarks.train_throughput import read_tensorboard
    from raypack.config import Config, DataConfig, ModelConfig, PackConfig, RunConfig, TokenizeConfig, TrainConfig
    from raypack.model.kernels import liger_installed
    from raypack.runs import run_dir
    from raypack.train.trainer import start

    import torch

    cuda = torch.cuda.is_available()
    cfg = Config(
        data=DataConfig(paths=(str(work / "data.parquet"),), format="tokenized", eval_fraction=0.0),
        tokenize=TokenizeConfig(num_cpus=0.5),
        pack=PackConfig(strategy="balanced", budget=args.budget, seed=args.seed),
        model=ModelConfig(name=str(work / "model"), dtype="bfloat16" if cuda else "float32",
                          gradient_checkpointing=args.gradient_checkpointing, kernels="auto" if fast else "none"),
        train=TrainConfig(num_workers=1, use_gpu=cuda, zero_stage=2, optimizer="torch", grad_accum=args.accum,
                          max_steps=args.warmup + args.steps, seed=args.seed, warmup_steps=2, lr=1e-4,
                          report_every_steps=5, checkpoint_every_steps=0, eval_every_steps=0, max_failures=0,
                          compile=fast),
        run=RunConfig(name=f"peers-{'fast' if fast else 'default'}", storage_path=str(work / "runs")),
    )  # fmt: skip
    result = start(cfg).result  # starts Ray as `raypack train` does (its settings: the dashboard too)
    tb = read_tensorboard(f"{run_dir(cfg)}/tensorboard")
    measured = range(args.warmup + 1, args.warmup + args.steps + 1)
    tokens = sum(tb[s]["train/tokens"] for s in measured)
    t0, t1 = tb[args.warmup]["wall_time"], tb[args.warmup + args.steps]["wall_time"]
    return {"tokens_per_s": tokens / (t1 - t0), "last_step_time": t1, "loss": tb[args.warmup + args.steps]["train/loss"],
            "peak_gib": (result.metrics or {}).get("peak_memory_gb", float("nan")), "tokens_per_step": tokens / args.steps,
            "liger": fast and cuda and liger_installed(),
            # the worker's count after warm-up and at the end: equal when no measured step recompiled
            "graphs": [tb[s].get("train/compiled_graphs") for s in (args.warmup, args.warmup + args.steps)] if fast else None}


# --- the run -------------------------------------------------------------------------------------------


def run_config(name: str, args, work: Path) -> dict:
    """One configuration in a fresh process; its wall time counts from that process's launch."""
    cmd = [sys.executable, __file__, "--child", name, "--work", str(work), *child_args(args)]
    launched = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out = json.loads(lines[-1].removeprefix("RESULT "))
    out["wall_s"] = out.pop("last_step_time") - launched
    print(name, out, flush=True)
    return out


def child_args(args) -> list[str]:
    return ["--budget", str(args.budget), "--accum", str(args.accum), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]


def graphs(counts) -> str:
    """"after warm-up -> at the end" of a compiled run's graph count; "-" for an uncompiled one."""
    if not counts:
        return "-"
    return f"{counts[0]:.0f} -> {counts[1]:.0f}" + (" (recompiled)" if counts[1] != counts[0] else "")


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> str:
    return f"{tokens_per_s * flops_per_token / peak:.1%}" if peak else "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256-token packs, 3 steps, CPU: proves the script runs")
    p.add_argument("--examples", type=int, default=20_000)
    p.add_argument("--budget", type=int, default=16_384, help="tokens a packed row (TRL: max_length)")
    p.add_argument("--accum", type=int, default=1, help="rows per optimizer step (TRL: gradient_accumulation_steps)")
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the measured ones (compile, caches)")
    p.add_argument("--gradient-checkpointing", action="store_true", default=None)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=900, help="seconds a configuration may take")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = not args.smoke
    if args.child:
        work = Path(args.work)
        kind, _, variant = args.child.partition("-")
        result = (child_trl(args, work, variant) if kind == "trl" else child_raypack(args, work, variant == "fast"))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.smoke:
        args.examples, args.budget, args.steps, args.warmup = 600, 256, 3, 1
    if gpu_or_smoke(__file__, args.smoke, "compares TRL and raypack on one GPU") is None:
        return 2

    import torch

    from raypack.config import load
    from raypack.model.build import model_config
    from raypack.train.metrics import model_flops_per_token, peak_flops

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="peers_") as tmp:
        work = Path(tmp)
        vocab = 768 if args.smoke else 32000
        data = write_data(work / "data.parquet", args.examples, args.budget, vocab, args.seed)
        save_model(work / "model", args.smoke, args.seed)
        results = {name: run_config(name, args, work) for name in args.configs}
        config = model_config(str(work / "model"))
    per_token = model_flops_per_token(config, data["length_sq_mean"], data["mean_length"])
    peak = peak_flops() if torch.cuda.is_available() else None
    lines = [
        f"# raypack against TRL's SFTTrainer, {device_name()}, {time.strftime('%Y-%m-%d')}",
        *smoke_banner(args.smoke),
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        f"Machine: {machine()}; started {started}. Versions: {versions('trl', 'ray', 'deepspeed', 'liger_kernel')}.",
        "",
        f"Model: {'tiny-llama' if args.smoke else 'Llama-style ~1.1B (hidden 2048, 16 layers)'}, random init. Data: "
        f"{data['examples']:,} pre-tokenized examples, {data['tokens']:,} tokens, half FLAN-like and half WildChat-like "
        f"lengths (mean {data['mean_length']:.0f}). Budget {args.budget:,} tokens a row, {args.accum} row(s) an optimizer "
        f"step, {args.warmup} warm-up then {args.steps} measured steps; gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}; loss on every token.",
        "",
        "| config | tokens/s | tokens / step | peak GiB | MFU | wall s (start to last step) | loss at the last step | Liger | graphs compiled (after warm-up -> end) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_step']:,.0f} | {r['peak_gib']:.1f} | "
                     f"{mfu(r['tokens_per_s'], per_token, peak)} | {r['wall_s']:.0f} | {r['loss']:.4f} | "
                     f"{'yes' if r.get('liger') else 'no'} | {graphs(r.get('graphs'))} |")
    lines.append("")
    for goal, target in GOALS.items():
        left, right = goal.split(" tokens/s")[0].split(" / ")
        if left in results and right in results:
            ratio = results[left]["tokens_per_s"] / results[right]["tokens_per_s"]
            lines.append(f"- {goal}: **{ratio:.2f}x** (goal {target}x on an H100)")
    if "raypack" in results and "trl-varlen" in results:
        lines.append(f"- wall time to the same step, raypack / trl-varlen: **{results['raypack']['wall_s'] / results['trl-varlen']['wall_s']:.2f}x** "
                     "(goal 0.8x or less)")
    lines += ["", "tokens/s counts real tokens over the measured steps (TRL: its packed rows' tokens, counted at the "
              "model's input; raypack: its TensorBoard tokens per step). MFU: raypack's FLOP count per token for the "
              "data's length mix over the GPU's dense bf16 peak. The last-step losses differ by each trainer's packing "
              "of the same data: they should be close, not equal.", ""]
    write_results("peers", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
