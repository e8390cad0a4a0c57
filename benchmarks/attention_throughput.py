"""Forward+backward throughput and peak memory: padded SDPA vs packed HF SDPA vs packed varlen.

    PYTHONPATH=. python benchmarks/attention_throughput.py            # ~1B Llama, bf16, CUDA
    PYTHONPATH=. python benchmarks/attention_throughput.py --tiny     # CPU smoke run, tiny model

One model (random init) switches attention implementation between three modes, on the same
batches of 16 examples a step:

    pad          collate(padded=True): [16, Lmax] with attention_mask, transformers' sdpa
    packed_sdpa  one [1, T] row, position_ids only, use_cache=False: transformers' sdpa builds a
                 block-diagonal 4D mask from the position restarts
    packed_varlen one [1, T] row with cu_seqlens: raypack's varlen attention (flash-attn or
                 torch varlen_attn on CUDA)

tokens/s counts real (non-padding) tokens. Needs only torch and transformers (no Ray, no
DeepSpeed): it imports raypack.model, raypack.data.collate and raypack.data.synthetic.
Results go to benchmarks/results/attention_<device>_<yyyymmdd>.md (CUDA) or /tmp (--tiny).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from raypack.data.collate import collate_packed, count_label_tokens, move_batch
from raypack.data.synthetic import sample_lengths
from raypack.model import attention as attn
from raypack.model.build import load_model

MODES = ("pad", "packed_sdpa", "packed_varlen")
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
    model.set_attn_implementation("sdpa" if mode != "packed_varlen" else attn.attn_implementation_name("auto"))
    host = [batch_for(mode, rows) for rows in batches]
    real_tokens = sum(len(r["input_ids"]) for rows in batches[warmup:] for r in rows)
    cuda = device == "cuda"
    losses = []

    def step(batch):
        out = model(**move_batch(batch, device))
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out.loss.detach()

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
    p.add_argument("--tiny", action="store_true", help="tiny model, short examples, 3 steps: a CPU smoke run")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps per mode (default 3; tiny 1)")
    p.add_argument("--examples-per-step", type=int, default=16)
    p.add_argument("--distributions", default="flan,orcamath")
    p.add_argument("--max-length", type=int, default=None, help="clip example lengths (default 4096; tiny 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/... on CUDA, /tmp for --tiny)")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    max_length = args.max_length or (128 if args.tiny else 4096)
    if args.tiny:
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
    out = Path(args.out) if args.out else default_out(device, args.tiny)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"wrote {out}")
    return 0


def _llama_1b():
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA_1B, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    return "cpu"


def default_out(device: str, tiny: bool) -> Path:
    date = datetime.date.today().strftime("%Y%m%d")
    if tiny or device != "cuda":
        return Path("/tmp") / f"attention_{device_name(device)}_tiny_{date}.md"
    return Path(__file__).parent / "results" / f"attention_{device_name(device)}_{date}.md"


def render(args, argv, device, params, steps, warmup, max_length, results) -> str:
    import transformers

    command = "PYTHONPATH=. python benchmarks/attention_throughput.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    backend = "flash_attn" if attn.flash_attn_available() and device == "cuda" else ("torch_varlen" if device == "cuda" else "sdpa_varlen")
    lines = [
        f"# Attention throughput, {device_name(device)}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"- machine: {torch.cuda.get_device_name() if device == 'cuda' else platform.processor() or platform.machine()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"flash-attn {'yes' if attn.flash_attn_available() else 'no'}; varlen backend: {backend}",
        f"- model: {'tiny-llama' if args.tiny else 'Llama-style'}, {params / 1e6:.1f}M parameters, "
        f"{'fp32' if args.tiny else 'bf16'}, random init; forward+backward, no optimizer step",
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
    for kind, modes in results.items():
        for name, num, den, target in TARGETS.get(kind, []):
            ratio = modes[num]["tokens_per_s"] / modes[den]["tokens_per_s"]
            lines.append(f"| {kind}: {name} | {ratio:.2f}x | >= {target}x {'(met)' if ratio >= target else '(missed)'} |")
        if kind == "flan" and device == "cuda":
            mem = modes["packed_varlen"]["peak_gib"] / modes["pad"]["peak_gib"]
            lines.append(f"| flan: peak memory packed_varlen / pad | {mem:.2f}x | <= 0.3x {'(met)' if mem <= 0.3 else '(missed)'} |")
    lines += ["", "Same batches in every mode; the first-step losses should agree to bf16 noise "
              "(packed_sdpa and packed_varlen isolate examples; pad masks padding).", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
