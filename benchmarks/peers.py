"""raypack against TRL's SFTTrainer on the same GPU, in one run (`make gpu-check`'s second step).

    PYTHONPATH=. python benchmarks/peers.py                # ~1B Llama, bf16, 16k-token packs, 1 GPU
    PYTHONPATH=. python benchmarks/peers.py --smoke        # tiny model on the CPU: proves the script runs

The same model (a random-init Llama saved once; no download), the same data, the same row budget,
tokens per optimizer step, number of optimizer steps, AdamW (betas 0.9/0.95, eps 1e-8, fused on
CUDA) and learning-rate schedule (raypack's warmup then cosine, `raypack.train.engines.optim.lr_lambda`,
given to TRL as its scheduler), for each configuration, one after the other, each in a fresh
process so that its wall time includes its own start-up (CONFIGS below, in the order they run):

- `raypack`: `raypack train`'s defaults on this machine (Ray Train, DeepSpeed ZeRO-2, its loop,
  loss and kernels as a user gets them), only the data, budget, steps and schedule set.
- `trl`: TRL at its best: `packing=True` (bfd) with padding-free batches, raypack's varlen attention
  registered with transformers (torch's varlen_attn on CUDA), Liger where installed, the model
  loaded in bf16 (weights, gradients and Adam moments in bf16: 8 bytes a parameter, and updates
  below half a bf16 ulp are lost), gradient checkpointing (TRL's default).
- `raypack-full` / `trl-mixed`: like for like, the same precision recipe (fp32 master weights and
  moments, bf16 compute: TRL with the model loaded in fp32 under bf16 autocast), the same full
  gradient checkpointing, the same kernels (Liger where installed) on both sides.
- `raypack-bf16` / `trl`: like for like in bf16: `train.precision: bf16` (bf16 weights and moments,
  with Kahan-summed AdamW, so small updates are not lost), full checkpointing and Liger.
- `trl-sdpa`: `trl` on transformers' `sdpa` attention, what TRL gets without a varlen kernel.

Each configuration has its own time limit (--config-timeout, and what --deadline-s leaves) and
streams its output as it runs; its row is written into the results file when it ends, a failure
or time-out as a row that says so, and the next one still runs. A configuration's scratch files
(runs, TRL's output folder) are removed before the next, and neither side saves a checkpoint.

Data: pre-tokenized random ids, half FLAN-like and half WildChat-like lengths (clipped to the
budget), `--examples` of them; both sides train on every token. Measured per configuration: real
tokens/s over optimizer steps warmup+1..warmup+steps; the peak GPU memory over those steps (reset
after warm-up) and the memory still allocated after the last optimizer step (weights, optimizer
state: what stays between steps); MFU (raypack's FLOP count for both); seconds from the process's
start to its first step and to its last; the loss at the last step. Results:
benchmarks/results/peers_<device>_<yyyymmdd>.md (with --smoke, the temp folder). Needs trl, ray and
deepspeed (on the GPU machine, the wheels tools/gpu_wheels.sh gathers, installed by gpu-check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # ray.train.report blocks ~2 s a call otherwise

import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402
    child_env, command_line, device_name, gpu_or_smoke, machine, results_path, run_streaming, save_checkpoint, smoke_banner,
    versions,
)  # fmt: skip


@dataclass(frozen=True)
class Peer:
    side: str
    """`raypack` or `trl`."""
    about: str
    overrides: tuple[str, ...] = ()
    """raypack: config overrides on top of the benchmark's settings."""
    attention: str = "varlen"
    """trl: `varlen` (raypack's kernel registered with transformers) or `sdpa`."""
    precision: str = "bf16"
    """trl: `bf16` (the model loaded in bf16) or `mixed` (fp32 under bf16 autocast)."""


CONFIGS = {
    "raypack": Peer("raypack", "raypack train's defaults"),
    "trl": Peer("trl", "TRL at its best: varlen kernel, Liger, pure bf16, checkpointing"),
    "raypack-full": Peer("raypack", "mixed precision, full checkpointing, Liger (as trl-mixed)",
                         ("model.gradient_checkpointing=full", "model.kernels=auto")),
    "trl-mixed": Peer("trl", "fp32 weights under bf16 autocast, full checkpointing, Liger (as raypack-full)",
                      precision="mixed"),
    "raypack-bf16": Peer("raypack", "train.precision bf16 (Kahan-summed AdamW), full checkpointing, Liger (as trl)",
                         ("train.precision=bf16", "model.gradient_checkpointing=full", "model.kernels=auto")),
    # the torch engine on one GPU is the bare model, no wrapper: TRL's own setting (issue 51)
    "raypack-torch-bf16": Peer("raypack", "train.engine torch (zero_stage 0: no wrapper on one rank), precision bf16, "
                               "full checkpointing, Liger (as trl)",
                               ("train.engine=torch", "train.zero_stage=0", "train.precision=bf16",
                                "model.gradient_checkpointing=full", "model.kernels=auto")),
    "trl-sdpa": Peer("trl", "TRL on transformers' sdpa: no varlen kernel", attention="sdpa"),
}
RATIOS = [  # (numerator, denominator, what, goal on an H100)
    ("raypack", "trl", "raypack's defaults over TRL's best, tokens/s", ">= 1.3x"),
    ("raypack-full", "trl-mixed", "like for like (same precision, checkpointing, kernels), tokens/s", ">= 1.1x"),
    ("raypack-bf16", "trl", "like for like in bf16 (same checkpointing, kernels), tokens/s", ">= 1.1x"),
    ("raypack-torch-bf16", "trl", "the torch engine, like for like in bf16, tokens/s", ">= 1.1x"),
    ("raypack-torch-bf16", "raypack-bf16", "the torch engine over the DeepSpeed engine (ZeRO-2), bf16, tokens/s",
     "measured"),
]
MEMORY = [("raypack-full", "trl-mixed", "peak memory at the same precision recipe", "<= 1.0x"),
          ("raypack-bf16", "trl", "train.precision: bf16 peak memory over TRL's pure bf16", "<= 1.0x"),
          ("raypack-torch-bf16", "trl", "the torch engine's bf16 peak memory over TRL's pure bf16", "<= 1.0x")]


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
    # bf16-representable weights, so that every side starts from the same values whatever it loads them as
    model = load_model(config, attention="sdpa", dtype="float32" if smoke else "bfloat16")
    if smoke:
        model.save_pretrained(path, safe_serialization=True)
    else:
        save_checkpoint(model, path)  # sharded, as published checkpoints are


# --- one configuration, in its own process -----------------------------------------------------------


def child_trl(args, work: Path, peer: Peer) -> dict:
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from raypack.config import ASSETS
    from raypack.model.attention import attn_implementation_name
    from raypack.model.kernels import liger_installed
    from raypack.train.engines.optim import lr_lambda

    cuda = torch.cuda.is_available()
    impl = "sdpa" if peer.attention == "sdpa" else attn_implementation_name("auto")
    dtype = torch.bfloat16 if cuda and peer.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=dtype, attn_implementation=impl)
    model.to("cuda" if cuda else "cpu")
    data = datasets.load_dataset("parquet", data_files=str(work / "data.parquet"), split="train")
    tokens, times, resident = [], [], []

    def count(module, args, kwargs):  # every micro-batch's real tokens: padding-free rows carry no pad
        tokens.append(int(kwargs["input_ids"].numel()))

    model.register_forward_pre_hook(count, with_kwargs=True)
    # Checkpointing shows as a layer's MLP run twice a micro-batch (forward, then recompute in backward).
    layer_calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: layer_calls.append(1))

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):  # after the optimizer step and zero_grad
            if cuda:
                torch.cuda.synchronize()
                resident.append(torch.cuda.memory_allocated())
            times.append((time.time(), sum(tokens)))
            if len(times) == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

    liger = cuda and liger_installed()
    total = args.warmup + args.steps
    # raypack's optimizer and schedule (raypack/train/engines/deepspeed_engine.py), so that the losses compare.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=cuda)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup=2, total=total, min_ratio=0.1))
    config = SFTConfig(
        output_dir=str(work / "scratch"), packing=True, packing_strategy="bfd", padding_free=True,
        max_length=args.budget, per_device_train_batch_size=1, gradient_accumulation_steps=args.accum,
        bf16=cuda, activation_checkpointing=args.gradient_checkpointing, gradient_checkpointing=args.gradient_checkpointing,
        use_liger_kernel=liger, max_steps=total,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", seed=args.seed,
        dataloader_num_workers=0, use_cpu=not cuda,
    )  # fmt: skip
    # The data is tokenized already; TRL still wants a tokenizer (for its pad id): the bundled one.
    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()],
                         optimizers=(optimizer, schedule))  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (t0, n0), (t1, n1) = times[args.warmup - 1], times[-1]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0), "first_step_time": times[0][0], "last_step_time": t1,
            "loss": losses[-1], "tokens_per_step": (n1 - n0) / args.steps, "liger": liger,
            "checkpointing": f"{len(layer_calls) / len(tokens):.0f} forward(s) of a layer a micro-batch",
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "resident_gib": resident[-1] / 2**30 if resident else None}  # fmt: skip


def raypack_config(args, work: Path, name: str, cuda: bool):
    """The config row `name` trains with: the benchmark's settings, then the row's overrides. model.dtype
    stays `auto` on both devices: bfloat16 on CUDA, float32 on the CPU, and bfloat16 wherever a row
    sets train.precision: bf16 (which refuses a float32 model), so every row runs in a CPU smoke too."""
    import yaml

    from raypack.config import loads

    settings = {
        "data": {"paths": [str(work / "data.parquet")], "format": "tokenized", "eval_fraction": 0.0},
        "tokenize": {"num_cpus": 0.5},
        "pack": {"strategy": "balanced", "budget": args.budget, "seed": args.seed},
        "model": {"name": str(work / "model")},
        # report at the end of warm-up: the measured steps' memory peak is their reports' own
        "train": {"num_workers": 1, "use_gpu": cuda, "grad_accum": args.accum, "max_steps": args.warmup + args.steps,
                  "seed": args.seed, "warmup_steps": 2, "lr": 1e-4, "min_lr_ratio": 0.1, "weight_decay": 0.0,
                  "grad_clip": 1.0, "report_every_steps": args.warmup, "eval_every_steps": 0, "max_failures": 0,
                  "save_final": False},
        "run": {"name": "peers", "storage_path": str(work / "scratch")},
    }  # fmt: skip
    return loads(yaml.safe_dump(settings), CONFIGS[name].overrides, f"<peers.py {name}>")


def child_raypack(args, work: Path, name: str) -> dict:
    import torch

    from raypack.runs import run_dir
    from raypack.train.trainer import start

    cuda = torch.cuda.is_available()
    cfg = raypack_config(args, work, name, cuda)
    start(cfg)  # starts Ray as `raypack train` does (its settings: the dashboard too)
    # Only now: its module imports DeepSpeed and the attention benchmark (1.8 s measured), which
    # `raypack train` never pays before its first step, and this side's start-up is timed from launch.
    from benchmarks.train_throughput import read_tensorboard

    tb = read_tensorboard(f"{run_dir(cfg)}/tensorboard")
    last = args.warmup + args.steps
    tokens = sum(tb[s]["train/tokens"] for s in range(args.warmup + 1, last + 1))
    t0, t1 = tb[args.warmup]["wall_time"], tb[last]["wall_time"]
    reports = [s for s in tb if s > args.warmup and "train/window_peak_memory_gb" in tb[s]]
    return {"tokens_per_s": tokens / (t1 - t0), "first_step_time": tb[1]["wall_time"], "last_step_time": t1,
            "loss": tb[last]["train/loss"], "tokens_per_step": tokens / args.steps,
            "liger": cfg.model.kernels != "none" and cuda and _liger(),
            "checkpointing": f"model.gradient_checkpointing: {cfg.model.gradient_checkpointing}",
            "peak_gib": max(tb[s]["train/window_peak_memory_gb"] for s in reports) if cuda else None,
            "resident_gib": tb[reports[-1]].get("train/memory_gb") if cuda else None}  # fmt: skip


def _liger() -> bool:
    from raypack.model.kernels import liger_installed

    return liger_installed()


# --- the run -------------------------------------------------------------------------------------------


def run_config(name: str, args, work: Path, timeout: float) -> dict:
    """One configuration in a fresh process, its output streamed; its scratch folder removed after."""
    cmd = [sys.executable, "-u", __file__, "--child", name, "--work", str(work), *child_args(args)]
    launched = time.time()
    rc, seconds, lines = run_streaming(cmd, cwd=REPO, env=child_env(), timeout=timeout,
                                       echo=lambda line: print(f"[{name}] {line}", end="", flush=True))  # fmt: skip
    shutil.rmtree(work / "scratch", ignore_errors=True)
    results = [line for line in lines if line.startswith("RESULT ")]
    if rc or not results:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
        why = f"timed out after {timeout:.0f} s" if rc == 124 else f"failed (exit {rc})"
        return {"error": f"{why}: {last[:200]}"}
    out = json.loads(results[-1].removeprefix("RESULT "))
    out["first_step_s"] = out.pop("first_step_time") - launched
    out["wall_s"] = out.pop("last_step_time") - launched
    return out


def child_args(args) -> list[str]:
    return ["--budget", str(args.budget), "--accum", str(args.accum), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]


def fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def table(results: dict[str, dict], per_token: float, peak: float | None) -> list[str]:
    lines = ["| config | what | tokens/s | MFU | peak GiB (measured steps) | GiB after the optimizer step | "
             "s to first step | s to last step | loss at the last step | Liger | checkpointing |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        about = CONFIGS[name].about
        if "error" in r:
            lines.append(f"| {name} | {about} | **{r['error']}** | | | | | | | | |")
            continue
        mfu = f"{r['tokens_per_s'] * per_token / peak:.1%}" if peak else "n/a"
        lines.append(f"| {name} | {about} | {r['tokens_per_s']:,.0f} | {mfu} | {fmt(r['peak_gib'], '.2f')} | "
                     f"{fmt(r['resident_gib'], '.2f')} | {r['first_step_s']:.0f} | {r['wall_s']:.0f} | {r['loss']:.4f} | "
                     f"{'yes' if r['liger'] else 'no'} | {r['checkpointing']} |")  # fmt: skip
    ok = {n: r for n, r in results.items() if "error" not in r}
    lines.append("")
    for a, b, what, goal in RATIOS:
        if a in ok and b in ok:
            lines.append(f"- {what}, {a} / {b}: **{ok[a]['tokens_per_s'] / ok[b]['tokens_per_s']:.2f}x** (goal {goal})")
    for a, b, what, goal in MEMORY:
        if a in ok and b in ok and ok[a]["peak_gib"] and ok[b]["peak_gib"]:
            lines.append(f"- {what}, {a} / {b}: **{ok[a]['peak_gib'] / ok[b]['peak_gib']:.2f}x** (goal {goal})")
    if "raypack" in ok and "trl" in ok:
        lines.append(f"- process start to the first step, raypack / trl: **{ok['raypack']['first_step_s'] / ok['trl']['first_step_s']:.2f}x** "
                     "(goal <= 1.5x, issue 40)")  # fmt: skip
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with --smoke's sizes applied (a child gets them as plain arguments)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256-token packs, 3 steps, CPU: proves the script runs")
    p.add_argument("--examples", type=int, default=20_000)
    p.add_argument("--budget", type=int, default=16_384, help="tokens a packed row (TRL: max_length)")
    p.add_argument("--accum", type=int, default=1, help="rows per optimizer step (TRL: gradient_accumulation_steps)")
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the measured ones (compile, caches)")
    p.add_argument("--gradient-checkpointing", action="store_true", default=None,
                   help="TRL's side (default: on; raypack's rows set theirs)")  # fmt: skip
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-timeout", type=float, default=None, help="seconds one configuration may take "
                   "(default 150 on a GPU, 600 with --smoke)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=None, help="seconds for the whole comparison: a configuration "
                   "that can't get 30 s of it is a skipped row")  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = not args.smoke
    if args.smoke:
        args.examples, args.budget, args.steps, args.warmup = 600, 256, 3, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        peer = CONFIGS[args.child]
        work = Path(args.work)
        result = child_trl(args, work, peer) if peer.side == "trl" else child_raypack(args, work, args.child)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if gpu_or_smoke(__file__, args.smoke, "compares TRL and raypack on one GPU") is None:
        return 2
    began = time.time()
    timeout = args.config_timeout or (600.0 if args.smoke else 150.0)

    import torch

    from raypack.model.build import model_config
    from raypack.train.metrics import model_flops_per_token, peak_flops

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="peers_") as tmp:
        work = Path(tmp)
        vocab = 768 if args.smoke else 32000
        data = write_data(work / "data.parquet", args.examples, args.budget, vocab, args.seed)
        save_model(work / "model", args.smoke, args.seed)
        per_token = model_flops_per_token(model_config(str(work / "model")), data["length_sq_mean"], data["mean_length"])
        peak = peak_flops() if torch.cuda.is_available() else None
        header = [
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
            f"step, {args.warmup} warm-up then {args.steps} measured steps; AdamW (0.9, 0.95) and raypack's warmup-cosine "
            f"schedule on both sides; TRL's gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; loss "
            "on every token. Each configuration limited to "
            f"{timeout:.0f} s" + (f", all of them to {args.deadline_s:.0f} s" if args.deadline_s else "") + ".",
            "",
        ]  # fmt: skip
        notes = ["", "tokens/s counts real tokens over the measured steps (TRL: its packed rows' tokens, counted at "
                 "the model's input; raypack: its TensorBoard tokens per step). MFU: raypack's FLOP count per token for "
                 "the data's length mix over the GPU's dense bf16 peak. Peak GiB: the most allocated during the measured "
                 "steps (reset after warm-up); GiB after the optimizer step: what stays allocated between steps. Pure "
                 "bf16 (trl) keeps no fp32 copy of the weights and moments: smaller, and updates below half a bf16 ulp "
                 "are lost. The last-step losses differ by each trainer's packing of the same data: close, not equal.", ""]  # fmt: skip
        results: dict[str, dict] = {}
        for name in args.configs:
            left = (args.deadline_s - (time.time() - began)) if args.deadline_s else timeout
            if left < 30:
                results[name] = {"error": f"skipped: {max(left, 0):.0f} s of --deadline-s left"}
            else:
                print(f"[peers] {name}: {CONFIGS[name].about} (limit {min(timeout, left):.0f} s)", flush=True)
                results[name] = run_config(name, args, work, min(timeout, left))
            # The file holds every row so far: a run cut short keeps what it measured.
            lines = header + table(results, per_token, peak) + notes
            path = results_path("peers", args.smoke, args.out)
            path.write_text("\n".join(lines))
            print(f"[peers] {name}: row written to {path}", flush=True)
    print("\n".join(lines))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
