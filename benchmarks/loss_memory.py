"""Peak memory and tokens/s of a train step: today's full-logit loss against the chunked loss, side by side.

    PYTHONPATH=. python benchmarks/loss_memory.py            # Llama-3-shaped ~1.2B, vocab 128256, 16k tokens, bf16, CUDA
    PYTHONPATH=. python benchmarks/loss_memory.py --smoke    # tiny model on the CPU: proves the script runs

One model (random init, tied embeddings, raypack's varlen attention) and one torch AdamW; one
packed row of FLAN-like examples per micro-batch, every token but each example's first a label.
A step is forward + backward + optimizer step. For each memory setting (activations kept, and
gradient checkpointing, where the loss is most of the step's extra memory), the two losses of
raypack/train/objectives/loss.py (`full`, `chunked`) alternate in rounds on the same batches: warmup steps,
then measured steps timed after a device sync, with the peak allocated memory of the measured
steps. Before timing, one batch's loss and gradients are computed both ways and compared (bf16).
Needs torch and transformers only (no Ray, no DeepSpeed). A path that runs out of memory is
recorded as OOM and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, results_path, smoke_banner, versions  # noqa: E402
from raypack.data.collate import move_batch  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402
from raypack.model import attention as attn  # noqa: E402
from raypack.model.build import load_model  # noqa: E402
from raypack.train.objectives.loss import CausalLMLoss, make_loss  # noqa: E402
from raypack.train.prefetch import prepare_step  # noqa: E402

LLAMA3_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
"""Llama-3.2-1B's shape (random weights)."""
TARGET_MEMORY, TARGET_SPEED = 0.6, 1.0
LOSSES = ("full", "chunked")


def make_rows(n: int, tokens: int, vocab: int, seed: int) -> list[dict]:
    """`n` packed rows of exactly `tokens` tokens: FLAN-like examples, the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        lengths = sample_lengths("flan", tokens // 8 + 16, seed=seed + i, max_length=min(4096, tokens)).tolist()
        cut, total = [], 0
        for length in lengths:
            length = min(length, tokens - total)
            cut.append(length)
            total += length
            if total == tokens:
                break
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        rows.append({
            "input_ids": ids, "labels": ids, "position_ids": [p for length in cut for p in range(length)],
            "num_tokens": tokens, "example_ids": list(range(len(cut))),
        })  # fmt: skip
    return rows


def build(args, device: str):
    if args.smoke:
        torch.manual_seed(0)
        return load_model("tiny-llama", attention="auto", dtype="float32", vocab_size=args.vocab or 768).to(device)
    from transformers import LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):  # initialize on the GPU: seconds instead of a minute on the host
        return load_model(LlamaConfig(**{**LLAMA3_1B, **({"vocab_size": args.vocab} if args.vocab else {})}),
                          attention="auto", dtype="bfloat16")  # fmt: skip


def set_checkpointing(model, on: bool) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def compare(model, losses: dict[str, CausalLMLoss], batch: dict) -> dict:
    """Loss and gradients of one batch, both ways: how close the chunked path is in this dtype."""
    out = {}
    for name in LOSSES:
        model.zero_grad(set_to_none=True)
        value = losses[name](model, batch)
        value.backward()
        out[name] = (value.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        del value
    model.zero_grad(set_to_none=True)
    (lf, gf), (lc, gc_) = out["full"], out["chunked"]
    grad_err = max(((gc_[n].float() - g.float()).abs().max() / g.float().abs().max().clamp_min(1e-12)).item() for n, g in gf.items())
    del out, gf, gc_
    return {"loss_full": lf, "loss_chunked": lc, "loss_rel": abs(lc - lf) / abs(lf), "grad_rel": grad_err}


def run_path(model, opt, loss: CausalLMLoss, batches: list[dict], warmup: int, device: str) -> dict:
    """`warmup` then the rest of `batches`, one train step each; time and peak of the measured ones."""
    cuda = device == "cuda"

    def step(batch):
        value = loss(model, batch)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for batch in batches[:warmup]:
            step(batch)
        sync(device)
        resident = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for batch in batches[warmup:]:
            step(batch)
        sync(device)
        seconds = time.perf_counter() - start
    except torch.OutOfMemoryError:
        seconds = None  # freed below: inside `except` the traceback still holds the step's tensors
    if seconds is None:
        release(model, opt)
        return {"oom": True}
    tokens = sum(int(b["input_ids"].numel()) for b in batches[warmup:])
    return {"oom": False, "seconds": seconds, "tokens": tokens, "resident_gib": resident,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}  # fmt: skip


def release(model, opt) -> None:
    """After an out-of-memory error: drop the step's gradients and cached blocks."""
    model.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def merge(a: dict | None, b: dict) -> dict:
    if a is None or a["oom"] or b["oom"]:
        return b if a is None else {"oom": True}
    return {"oom": False, "seconds": a["seconds"] + b["seconds"], "tokens": a["tokens"] + b["tokens"],
            "peak_gib": max(a["peak_gib"], b["peak_gib"]), "resident_gib": max(a["resident_gib"], b["resident_gib"])}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256 tokens, CPU: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 16384; smoke 256)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (default 128256; smoke 768)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per path per round (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per path per round")
    p.add_argument("--rounds", type=int, default=None, help="rounds alternating the two losses (default 2; smoke 1)")
    p.add_argument("--checkpointing", choices=["off", "on", "both"], default="both",
                   help="gradient checkpointing settings to measure (default both)")  # fmt: skip
    p.add_argument("--chunk-tokens", type=int, default=None, help="chunked loss: label tokens a chunk (default auto; smoke 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)

    device = gpu_or_smoke(__file__, args.smoke, "measures GPU memory")
    if device is None:
        return 2
    tokens = args.tokens or (256 if args.smoke else 16384)
    steps = args.steps or (1 if args.smoke else 3)
    args.rounds = args.rounds or (1 if args.smoke else 2)
    if args.chunk_tokens is None:
        args.chunk_tokens = 64 if args.smoke else 0  # smoke: several chunks of the tiny batch
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]

    t0 = time.perf_counter()
    model = build(args, device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    losses = {"full": CausalLMLoss(model, "full"), "chunked": make_loss(model, "chunked", args.chunk_tokens)}
    rows = make_rows(args.warmup + steps, tokens, vocab, args.seed)
    batches = [move_batch(prepare_step([r], pin=device == "cuda").batches[0], device) for r in rows]
    print(f"model {params / 1e6:.1f}M parameters, vocab {vocab}, {tokens} tokens a micro-batch, "
          f"{losses['chunked'].describe()}; built in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip

    results = {}
    for ckpt in settings:
        set_checkpointing(model, ckpt)
        label = "gradient checkpointing" if ckpt else "activations kept"
        check = None
        try:
            check = compare(model, losses, batches[0])
        except torch.OutOfMemoryError:
            pass
        if check is None:
            release(model, opt)
        measured: dict[str, dict | None] = {name: None for name in LOSSES}
        for r in range(args.rounds):
            order = LOSSES if r % 2 == 0 else LOSSES[::-1]  # alternate who goes first
            for name in order:
                measured[name] = merge(measured[name], run_path(model, opt, losses[name], batches, args.warmup, device))
        results[label] = {"check": check, **measured}
        for name in LOSSES:
            m = measured[name]
            print(f"{label:24s} {name:8s} " + ("OOM" if m["oom"] else
                  f"{m['tokens'] / m['seconds']:10.0f} tok/s  peak {gib(m['peak_gib'])} GiB"), flush=True)  # fmt: skip
        if check:
            print(f"{label:24s} check: loss {check['loss_full']:.5f} vs {check['loss_chunked']:.5f}, "
                  f"max grad diff {check['grad_rel']:.2e} of the largest", flush=True)  # fmt: skip

    out = results_path("loss_memory", args.smoke, args.out)
    out.write_text(render(args, argv, device, params, vocab, tokens, steps, losses["chunked"], results))
    print(f"wrote {out}")
    return 0


def render(args, argv, device, params, vocab, tokens, steps, chunked, results) -> str:
    dtype = "fp32" if args.smoke else "bf16"
    model_desc = "tiny-llama" if args.smoke else (
        "Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, tied embeddings)"
    )
    lines = [
        f"# Loss memory: full-logit vs chunked loss, {device_name()}, {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        *smoke_banner(args.smoke),
        f"- machine: {machine()}",
        f"- versions: {versions()}; attention {attn.attn_implementation_name('auto')} "
        f"(flash-attn {'yes' if attn.flash_attn_available() else 'no'})",
        f"- model: {model_desc}, {params / 1e6:.1f}M parameters, vocab {vocab}, {dtype}, random init",
        f"- step: forward + backward + torch AdamW{' (fused)' if device == 'cuda' else ''} on one packed row of {tokens} "
        f"tokens (FLAN-like examples; every token but each example's first is a label)",
        f"- chunked loss: {chunked.describe()}",
        f"- {args.rounds} rounds alternating the losses, each {args.warmup} warmup + {steps} measured steps per loss; "
        "peak = max allocated during the measured steps; resident = allocated before them (weights and optimizer "
        "state; gradients are freed after each step)",
        "",
        "| memory setting | loss | tokens/s | peak GiB | resident GiB |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for label, r in results.items():
        for name in LOSSES:
            m = r[name]
            if m["oom"]:
                lines.append(f"| {label} | {name} | OOM | OOM | |")
            else:
                lines.append(f"| {label} | {name} | {m['tokens'] / m['seconds']:.0f} | {gib(m['peak_gib'])} | "
                             f"{gib(m['resident_gib'])} |")  # fmt: skip
        full, ch = r["full"], r["chunked"]
        if not full["oom"] and not ch["oom"]:
            mem = ch["peak_gib"] / full["peak_gib"] if device == "cuda" else float("nan")
            speed = (ch["tokens"] / ch["seconds"]) / (full["tokens"] / full["seconds"])
            verdicts.append((label, mem, speed))
    lines += ["", "| memory setting | peak chunked / full | target | tokens/s chunked / full | target |", "|---|---|---|---|---|"]
    for label, mem, speed in verdicts:
        judge = (lambda ok: "(not judged: smoke run)") if args.smoke else (lambda ok: "(met)" if ok else "(missed)")
        lines.append(f"| {label} | {'n/a' if mem != mem else f'{mem:.2f}x'} | <= {TARGET_MEMORY}x {judge(mem <= TARGET_MEMORY)} | {speed:.3f}x | "
                     f">= {TARGET_SPEED}x {judge(speed >= TARGET_SPEED)} |")  # fmt: skip
    lines += ["", f"Same batch, loss and gradients both ways ({dtype}; the chunked path sums the head's gradient "
              "over chunks, so they agree to rounding, not bit for bit):", ""]  # fmt: skip
    for label, r in results.items():
        c = r["check"]
        lines.append(f"- {label}: " + ("OOM while comparing" if c is None else
                     f"loss {c['loss_full']:.6f} (full) vs {c['loss_chunked']:.6f} (chunked), relative difference "
                     f"{c['loss_rel']:.1e}; largest gradient difference {c['grad_rel']:.1e} of that parameter's largest gradient"))  # fmt: skip
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
