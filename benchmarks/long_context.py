"""The longest packed row one GPU trains, with and without the long-row memory options (issue 27).

    PYTHONPATH=. python benchmarks/long_context.py            # one GPU; part of `make bench-gpu`
    PYTHONPATH=. python benchmarks/long_context.py --smoke    # tiny model on the CPU: proves the script runs

Settings: a Llama-3.2-1B-shaped model (~1.2B, benchmarks/loss_memory.py's) with full fine-tuning,
and a Llama-3.1-8B-shaped one with LoRA (r 16 on every linear layer, base frozen), each with
gradient checkpointing, bf16, raypack's varlen attention and chunked loss, and with
`model.tiled_mlp_tokens` / `model.offload_checkpoints` off or on (raypack/model/kernels.py). One
packed row a step, of examples of `--example-tokens` (32k) each; the row's length doubles from
`--start` tokens while a step (forward, backward, AdamW) fits in memory and the time left allows.
Per length: the step's seconds after a warm-up step, tokens/s and peak memory. Each setting runs
in its own process (an out-of-memory error leaves nothing behind for the next).

Sequence parallelism can't run on one GPU. The results file states what N GPUs would hold under
`train.sequence_parallel: N` from the per-rank length measured here: N x that length, computed,
not run (each rank holds 1/N of the row; the all-to-alls' buffers, a layer's q, k, v and output
twice over, come and go within the layer).
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

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1 << 20,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
OPTIONS = {"none": (0, False), "tiled": (4096, False), "offload": (0, True), "both": (4096, True)}
"""Option set -> (model.tiled_mlp_tokens, model.offload_checkpoints)."""
ALST_8B_ONE_H100 = 500_000
"""ALST's (arXiv 2506.13996) single-H100 figure for Llama-3.1-8B: the one to beat."""


def child(args) -> None:
    """One setting: lengths doubling until a step no longer fits or the time is up; a JSON line each."""
    import torch
    from transformers import LlamaConfig

    from benchmarks.loss_memory import LLAMA3_1B, set_checkpointing
    from raypack.config import PeftConfig
    from raypack.data.collate import collate_packed, move_batch
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model
    from raypack.model.kernels import checkpoint_offload, tile_mlps
    from raypack.train.objectives.loss import label_targets, make_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiles, offload = OPTIONS[args.options]
    torch.manual_seed(0)
    with torch.device(device):
        if args.smoke:
            model = load_model("tiny-llama", attention="auto", dtype="float32", vocab_size=768)
        else:
            shape = LLAMA3_8B if args.model == "8b-lora" else LLAMA3_1B
            model = load_model(LlamaConfig(**shape), attention="auto", dtype="bfloat16")
    set_checkpointing(model, True)
    if args.model == "8b-lora":
        model = apply_adapters(model, PeftConfig(method="lora", r=16, alpha=32, target_modules=("all-linear",)))
    if tiles:
        tile_mlps(model, tiles if not args.smoke else 16)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-5, fused=device == "cuda")
    loss = make_loss(model, "chunked")
    vocab = model.get_input_embeddings().num_embeddings
    deadline = time.time() + args.seconds
    length = args.start
    while length <= args.max_tokens and time.time() < deadline:
        sizes = [min(args.example_tokens, length - i) for i in range(0, length, args.example_tokens)]
        ids = torch.randint(3, vocab, (length,)).tolist()
        rows = [{"input_ids": ids, "labels": ids, "position_ids": [p for n in sizes for p in range(n)]}]
        batch = collate_packed(rows)
        batch.update(label_targets(batch["labels"]))
        batch = move_batch(batch, device)
        try:
            times = []
            for _ in range(2):  # a warm-up step, then the timed one
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with checkpoint_offload(offload, torch.device(device)):
                    value = loss(model, batch)
                value.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
            print("ROW " + json.dumps({"tokens": length, "seconds": times[-1], "peak_gib": peak}), flush=True)
        except torch.OutOfMemoryError:
            print("ROW " + json.dumps({"tokens": length, "oom": True}), flush=True)
            return
        length *= 2


def run_setting(args, model: str, options: str, seconds: float) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--options", options, "--start", str(args.start),
           "--max-tokens", str(args.max_tokens), "--example-tokens", str(args.example_tokens),
           "--seconds", str(seconds), *(["--smoke"] if args.smoke else [])]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=seconds + 120)
        out = proc.stdout
    except subprocess.TimeoutExpired as e:  # the rows it finished still count
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    print(model, options, rows, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, short rows, CPU: proves the script runs")
    p.add_argument("--models", nargs="+", default=["1b-full", "8b-lora"], choices=["1b-full", "8b-lora"])
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    p.add_argument("--start", type=int, default=16_384, help="first row length, doubled while it fits")
    p.add_argument("--max-tokens", type=int, default=1 << 20)
    p.add_argument("--example-tokens", type=int, default=32_768, help="tokens of each example in a row")
    p.add_argument("--budget", type=float, default=140.0, help="seconds for every setting together")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.options = args.options[0] if isinstance(args.options, list) else args.options
        child(args)
        return 0
    if args.smoke:
        args.start, args.max_tokens, args.example_tokens, args.budget = 64, 256, 48, 120.0
        args.models = ["1b-full", "8b-lora"]  # both tiny in a smoke run
    if gpu_or_smoke(__file__, args.smoke, "finds the longest row one GPU trains") is None:
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    settings = [(m, o) for m in args.models for o in args.options]
    results = {}
    for i, (model, options) in enumerate(settings):
        left = args.budget - sum(r.get("spent", 0) for r in results.values())
        t0 = time.time()
        rows = run_setting(args, model, options, max(left / (len(settings) - i), 5.0))
        results[(model, options)] = {"rows": rows, "spent": time.time() - t0}
    lines = [f"# Longest packed row on one GPU, {device_name()}, {time.strftime('%Y-%m-%d')}", *smoke_banner(args.smoke),
             "", f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {machine()}; started {started}. "
             f"Versions: {versions('peft')}.", "",
             f"Rows of examples of {args.example_tokens:,} tokens, doubled from {args.start:,}; gradient checkpointing, "
             "chunked loss, raypack's varlen attention; tiled = model.tiled_mlp_tokens 4096, offload = "
             "model.offload_checkpoints.", "",
             "| model | options | longest row that trained | tokens/s there | peak GiB there | first that did not fit | "
             "with train.sequence_parallel 8 (computed, not run) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (model, options), r in results.items():
        fit = [x for x in r["rows"] if not x.get("oom")]
        oom = next((x["tokens"] for x in r["rows"] if x.get("oom")), None)
        best = fit[-1] if fit else None
        lines.append(f"| {model} | {options} | {best['tokens']:,} | {best['tokens'] / best['seconds']:,.0f} | "
                     f"{best['peak_gib']:.1f} | {f'{oom:,}' if oom else 'not reached (time or --max-tokens)'} | "
                     f"{8 * best['tokens']:,} |" if best else f"| {model} | {options} | none | | | {oom} | |")
    lines += ["", "Every length measured (tokens: seconds a step, peak GiB):", ""]
    for (model, options), r in results.items():
        shown = ", ".join(f"{x['tokens']:,}: OOM" if x.get("oom") else f"{x['tokens']:,}: {x['seconds']:.2f} s, "
                          f"{x['peak_gib']:.1f} GiB" for x in r["rows"])
        lines.append(f"- {model}, {options}: {shown or 'no length finished in its time'}")
    lines += ["", f"ALST reports {ALST_8B_ONE_H100:,} tokens for Llama-3.1-8B on one H100 (with its own offloads "
              "and tiling); compare the 8b-lora rows, whose frozen base has no optimizer state.", ""]
    write_results("long_context", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
