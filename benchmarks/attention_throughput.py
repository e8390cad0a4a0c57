"""Forward+backward throughput and peak memory: padded SDPA vs packed HF SDPA vs packed varlen,
and packed varlen with raypack's chunked loss.

    PYTHONPATH=. python benchmarks/attention_throughput.py            # ~1B Llama, bf16, CUDA
    PYTHONPATH=. python benchmarks/attention_throughput.py --smoke    # tiny model on the CPU: proves the script runs

One model (random init) switches attention implementation between three modes, on the same
batches of 16 examples a step:

    pad          collate(padded=True): [16, Lmax] with attention_mask, transformers' sdpa
    packed_sdpa  one [1, T] row, position_ids only, use_cache=False: transformers' sdpa builds a
                 block-diagonal 4D mask from the position restarts
    packed_varlen one [1, T] row with cu_seqlens: raypack's varlen attention (flash-attn or
                 torch varlen_attn on CUDA)
    packed_chunked the same with raypack's chunked loss (train.loss's default) in place of the
                 model's own, which makes every logit: what `raypack train` runs, for the memory
                 goal (raypack's packed training against padded training as transformers does it)

tokens/s counts real (non-padding) tokens. Needs only torch and transformers (no Ray, no
DeepSpeed): it imports raypack.model, raypack.data.collate and raypack.data.synthetic.
Results go to benchmarks/results/attention_<device>_<yyyymmdd>.md, or with --smoke to the temp
folder (see benchmarks/common.py for --out and $RAYPACK_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, results_path, smoke_banner, versions  # noqa: E402
from raypack.data.collate import collate_packed, count_label_tokens, move_batch  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402
from raypack.model import attention as attn  # noqa: E402
from raypack.model.build import load_model  # noqa: E402
from raypack.train.objectives.loss import CausalLMLoss, label_targets  # noqa: E402

MODES = ("pad", "packed_sdpa", "packed_varlen", "packed_chunked")
TARGETS = {  # (ratio name, numerator, denominator, minimum) per distribution, from the issue
    "flan": [("tokens/s packed_varlen / pad", "packed_varlen", "pad", 3.5),
             ("tokens/s packed_varlen / packed_sdpa", "packed_varlen", "packed_sdpa", 2.5)],
    "orcamath": [("tokens/s packed_varlen / pad", "packed_varlen", "pad", 2.5)],
}  # fmt: skip
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192,
)  # fmt: skip


def make_steps(kind: str, steps: int, per_step: int, seed: int, max_length: int | None, vocab: int):
    """Lists of packed-contract rows, one row per example (the `flatten` layout)."""
    lengths = sample_lengths(kind, steps * per_step, seed=seed, max_length=max_length)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for s in range(steps):
        rows = []
        for n in lengths[s * per_step : (s + 1) * per_step].tolist():
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(n))})
        batches.append(rows)
    return batches


def batch_for(mode: str, rows):
    if mode == "pad":
        return collate_packed(rows, padded=True)
    batch = collate_packed(rows)
    if mode == "packed_sdpa":  # transformers' own packed path: position_ids only
        batch = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    return batch


def run_mode(model, mode: str, batches, warmup: int, device: str) -> dict:
    model.set_attn_implementation("sdpa" if mode in ("pad", "packed_sdpa") else attn.attn_implementation_name("auto"))
    host = [batch_for(mode, rows) for rows in batches]
    chunked = CausalLMLoss(model, "chunked") if mode == "packed_chunked" else None
    if chunked is not None:  # found on the host ahead of the step, as raypack's prefetcher does
        host = [{**b, **label_targets(b["labels"]), "count": count_label_tokens(b)} for b in host]
    real_tokens = sum(len(r["input_ids"]) for rows in batches[warmup:] for r in rows)
    cuda = device == "cuda"
    losses = []

    def step(batch):
        if chunked is None:
            loss = model(**move_batch(batch, device)).loss
        else:  # the mean over label tokens, as the model's own loss: the same first-step loss
            batch = dict(batch)
            count = batch.pop("count")
            loss = chunked(model, move_batch(batch, device)) / count
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    for batch in host[:warmup]:
        losses.append(step(batch))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in host[warmup:]:
        losses.append(step(batch))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": real_tokens / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "first_loss": losses[0].float().item(),
        "padded_tokens": sum(b["input_ids"].numel() for b in host[warmup:]),
        "real_tokens": real_tokens,
        "label_tokens": sum(count_label_tokens(b) for b in host[warmup:]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, short examples, few steps, CPU: proves the script runs")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 10; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps per mode (default 3; smoke 1)")
    p.add_argument("--examples-per-step", type=int, default=None, help="examples a step (default 16; smoke 4)")
    p.add_argument("--distributions", default="flan,orcamath")
    p.add_argument("--max-length", type=int, default=None, help="clip example lengths (default 4096; smoke 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)

    device = gpu_or_smoke(__file__, args.smoke, "compares CUDA attention kernels")
    if device is None:
        return 2
    steps = args.steps or (1 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else 1 if args.smoke else 3
    args.examples_per_step = args.examples_per_step or (4 if args.smoke else 16)
    max_length = args.max_length or (128 if args.smoke else 4096)
    torch.manual_seed(args.seed)  # the random init too: same seed, same first-step losses run to run
    if args.smoke:
        model = load_model("tiny-llama", attention="sdpa", dtype="float32")
    else:
        model = load_model(_llama_1b(), attention="sdpa", dtype="bfloat16")
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size

    results: dict[str, dict[str, dict]] = {}
    for kind in args.distributions.split(","):
        batches = make_steps(kind, warmup + steps, args.examples_per_step, args.seed, max_length, vocab)
        results[kind] = {}
        for mode in MODES:
            results[kind][mode] = r = run_mode(model, mode, batches, warmup, device)
            print(f"{kind:9s} {mode:14s} {r['tokens_per_s']:10.0f} tok/s  peak {r['peak_gib']:6.2f} GiB  "
                  f"loss {r['first_loss']:.4f}", flush=True)  # fmt: skip

    report = render(args, argv, device, params, steps, warmup, max_length, results)
    out = results_path("attention", args.smoke, args.out)
    out.write_text(report)
    print(f"wrote {out}")
    return 0


def _llama_1b():
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA_1B, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def render(args, argv, device, params, steps, warmup, max_length, results) -> str:
    backend = "flash_attn" if attn.flash_attn_available() and device == "cuda" else ("torch_varlen" if device == "cuda" else "sdpa_varlen")
    lines = [
        f"# Attention throughput, {device_name()}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        *smoke_banner(args.smoke),
        f"- machine: {machine()}",
        f"- versions: {versions()}, flash-attn {'yes' if attn.flash_attn_available() else 'no'}; varlen backend: {backend}",
        f"- model: {'tiny-llama' if args.smoke else 'Llama-style'}, {params / 1e6:.1f}M parameters, "
        f"{'fp32' if args.smoke else 'bf16'}, random init; forward+backward, no optimizer step",
        f"- {args.examples_per_step} examples a step, {warmup} warmup + {steps} measured steps per mode, "
        f"lengths clipped to {max_length}, seed {args.seed}; tokens/s counts real tokens only",
        "",
        "| lengths | mode | tokens/s | peak GiB | padding fraction | first-step loss |",
        "|---|---|---|---|---|---|",
    ]
    for kind, modes in results.items():
        for mode, r in modes.items():
            pad = 1 - r["real_tokens"] / r["padded_tokens"]
            lines.append(f"| {kind} | {mode} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {pad:.2f} | {r['first_loss']:.4f} |")
    lines += ["", "| ratio | value | target |", "|---|---|---|"]

    def verdict(ok: bool) -> str:
        return "(not judged: smoke run)" if args.smoke else "(met)" if ok else "(missed)"

    for kind, modes in results.items():
        for name, num, den, target in TARGETS.get(kind, []):
            ratio = modes[num]["tokens_per_s"] / modes[den]["tokens_per_s"]
            lines.append(f"| {kind}: {name} | {ratio:.2f}x | >= {target}x {verdict(ratio >= target)} |")
        if kind == "flan" and device == "cuda":
            for packed in ("packed_varlen", "packed_chunked"):
                mem = modes[packed]["peak_gib"] / modes["pad"]["peak_gib"]
                lines.append(f"| flan: peak memory {packed} / pad | {mem:.2f}x | <= 0.3x {verdict(mem <= 0.3)} |")
    lines += ["", "Same batches in every mode; the first-step losses should agree to bf16 noise "
              "(packed_sdpa and packed_varlen isolate examples; pad masks padding). packed_chunked is packed_varlen "
              "with raypack's chunked loss, which never holds every logit: the pad mode uses the model's own loss, "
              "as transformers' padded training does.", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
