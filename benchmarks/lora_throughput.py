"""LoRA against full fine-tuning, side by side: tokens/s, peak memory and MFU of a train step.

    PYTHONPATH=. python benchmarks/lora_throughput.py            # Llama-3.2-1B-shaped ~1.2B, 16k tokens, bf16, CUDA
    PYTHONPATH=. python benchmarks/lora_throughput.py --smoke    # tiny model on the CPU: proves the script runs

The model, rows and loss are loss_memory.py's (random init, tied embeddings, raypack's varlen
attention, one packed row of FLAN-like examples per micro-batch, the chunked loss). Two copies of
it, built from the same seed: `full` trains every weight; `lora` is the same model wrapped by
raypack's `apply_adapters` with r=16, alpha=32 adapters on every linear layer
(jobs/configs/llama8b_lora_1gpu.yaml's), base frozen, adapters cast to bf16 as DeepSpeed's bf16
engine casts them in training. Each side has its own torch AdamW over its trainable parameters
only. A step is forward + backward + optimizer step. For each memory setting (activations kept,
gradient checkpointing) the two sides alternate in rounds on the same batches: warmup steps, then
measured steps timed after a device sync, with the peak allocated memory of the measured steps.
Both models stay on the GPU, so each side's peak and resident memory are reported less the other
side's resident weights and optimizer state (their exact byte counts).

Before timing, a few LoRA steps run and the frozen base weights are compared with a host copy
taken before them, bit for bit (and with `adapters.frozen_digest`, the checksum raypack's training
loop compares); the comparison is made again after all the timed steps. Needs torch,
transformers and peft (no Ray, no DeepSpeed). A side that runs out of memory is recorded as OOM.

MFU counts the work each side does, per token, with raypack's own FLOP count
(raypack/train/metrics.py `model_flops_per_token`: 6N + attention, N the matmul weights with the
LM head, attention 12 L H D ctx):
    full: 6N + attention
    lora: 4N + 6 P_lora + attention
The frozen weights run forward (2N) and backward to the activations (2N) but get no weight
gradient (the 2N full fine-tuning adds); the adapters do all three (6 P_lora); the attention's
own FLOPs are the same (its backward to q, k, v is needed either way). Recomputation under
gradient checkpointing is not counted, as raypack's MFU doesn't count it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, results_path, smoke_banner, versions  # noqa: E402
from benchmarks.loss_memory import build, gib, make_rows, merge, run_path, set_checkpointing  # noqa: E402
from raypack.config import PeftConfig  # noqa: E402
from raypack.data.collate import move_batch  # noqa: E402
from raypack.model import attention as attn  # noqa: E402
from raypack.train.objectives.loss import make_loss  # noqa: E402
from raypack.train.metrics import model_flops_per_token, peak_flops  # noqa: E402
from raypack.train.prefetch import prepare_step  # noqa: E402

SIDES = ("full", "lora")
PEFT = PeftConfig(method="lora", r=16, alpha=32, target_modules=("all-linear",))
"""jobs/configs/llama8b_lora_1gpu.yaml's adapters."""


def build_side(args, device: str, side: str):
    """(model, optimizer, loss) for one side; both sides start from the same weights."""
    from raypack.model.adapters import apply_adapters

    model = build(args, device)
    if side == "lora":
        model = apply_adapters(model, PEFT, "benchmark")
        if device == "cuda":
            # peft makes the adapters fp32; DeepSpeed's bf16 engine casts every parameter (not the
            # buffers, such as RoPE's inv_freq) to bf16, so training runs them in bf16: do the same.
            for param in model.parameters():
                param.data = param.data.to(torch.bfloat16)
        # Input gradients on, as apply_adapters does under checkpointing: the backward then runs
        # through every layer, which is what the FLOP count assumes.
        model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    return model, opt, make_loss(model, "chunked", args.chunk_tokens)


def resident_gib(model, opt) -> float:
    """Bytes a side keeps between steps: weights, buffers and optimizer state (gradients are freed)."""
    n = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    n += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return n / 2**30


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if not p.requires_grad}


def trained_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def check_base(model, before: dict[str, torch.Tensor], digest_before: int, adapters_before: dict) -> dict:
    """Whether every frozen weight is bit-identical to `before`, and that the adapters did train."""
    from raypack.model.adapters import frozen_digest

    params = dict(model.named_parameters())
    changed = [n for n, t in before.items() if not torch.equal(params[n].detach().cpu(), t)]
    moved = sum(not torch.equal(params[n].detach().cpu(), t) for n, t in adapters_before.items())
    return {"frozen": len(before), "changed": changed, "digest_same": frozen_digest(model) == digest_before,
            "adapters": len(adapters_before), "adapters_moved": moved}  # fmt: skip


def lengths_of(rows: list[dict]) -> list[int]:
    """Example lengths of packed rows, from their position_ids (which restart at 0 per example)."""
    out = []
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        out += [b - a for a, b in zip(starts, starts[1:])]
    return out


def flops_per_token(config, lengths: list[int], lora_params: int) -> dict[str, float]:
    """Training FLOPs per token of each side (module docstring)."""
    sq_mean = sum(x * x for x in lengths) / len(lengths)
    mean = sum(lengths) / len(lengths)
    full = model_flops_per_token(config, sq_mean, mean)
    dense = model_flops_per_token(config, 0.0, 1.0)  # ctx = 0: the 6N term alone
    return {"full": full, "lora": full - dense + 4 * dense / 6 + 6 * lora_params, "n": dense / 6,
            "attention": full - dense}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256 tokens, CPU: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 16384; smoke 256)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (default 128256; smoke 768)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per side per round (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per side per round")
    p.add_argument("--rounds", type=int, default=None, help="rounds alternating the two sides (default 2; smoke 1)")
    p.add_argument("--check-steps", type=int, default=2, help="LoRA steps before timing, after which the base is compared")
    p.add_argument("--checkpointing", choices=["off", "on", "both"], default="both",
                   help="gradient checkpointing settings to measure (default both)")  # fmt: skip
    p.add_argument("--chunk-tokens", type=int, default=None, help="chunked loss: label tokens a chunk (default auto; smoke 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)

    device = gpu_or_smoke(__file__, args.smoke, "measures GPU throughput and memory")
    if device is None:
        return 2
    if importlib.util.find_spec("peft") is None:
        print("lora_throughput.py needs peft (pip install 'raypack[peft]'; tools/gpu_wheels.sh for the GPU machine)",
              file=sys.stderr)  # fmt: skip
        return 2
    tokens = args.tokens or (256 if args.smoke else 16384)
    steps = args.steps or (1 if args.smoke else 3)
    args.rounds = args.rounds or (1 if args.smoke else 2)
    if args.chunk_tokens is None:
        args.chunk_tokens = 64 if args.smoke else 0  # smoke: several chunks of the tiny batch
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    out = results_path("lora", args.smoke, args.out)

    t0 = time.perf_counter()
    sides = {side: build_side(args, device, side) for side in SIDES}
    full_model, lora_model = sides["full"][0], sides["lora"][0]
    params = sum(p.numel() for p in full_model.parameters())
    lora_params = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    vocab = full_model.config.vocab_size
    rows = make_rows(args.warmup + steps, tokens, vocab, args.seed)
    batches = [move_batch(prepare_step([r], pin=device == "cuda").batches[0], device) for r in rows]
    flops = flops_per_token(full_model.config, lengths_of(rows[args.warmup:]), lora_params)
    peak = peak_flops()
    print(f"model {params / 1e6:.1f}M parameters, LoRA {lora_params / 1e6:.2f}M trained, vocab {vocab}, {tokens} tokens "
          f"a micro-batch; built in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip

    # The base must come out of LoRA training bit for bit as it went in: checked before any timing.
    from raypack.model.adapters import frozen_digest

    base, digest, adapters = frozen_weights(lora_model), frozen_digest(lora_model), trained_weights(lora_model)
    model, opt, loss = sides["lora"]
    for batch in (batches * args.check_steps)[: args.check_steps]:
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    checks = {"before timing": check_base(lora_model, base, digest, adapters)}
    print(f"LoRA base after {args.check_steps} steps: {describe(checks['before timing'])}", flush=True)

    results = {}
    for ckpt in settings:
        label = "gradient checkpointing" if ckpt else "activations kept"
        for model, _, _ in sides.values():
            set_checkpointing(model, ckpt)
        measured: dict[str, dict | None] = {side: None for side in SIDES}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:  # alternate who goes first
                model, opt, loss = sides[side]
                other = sum(resident_gib(m, o) for s, (m, o, _) in sides.items() if s != side) if device == "cuda" else 0.0
                m = run_path(model, opt, loss, batches, args.warmup, device)  # frees the step's tensors on OOM
                if not m["oom"]:  # both models stay on the GPU: leave the other side's weights and state out
                    m = {**m, "peak_gib": m["peak_gib"] - other, "resident_gib": m["resident_gib"] - other}
                measured[side] = merge(measured[side], m)
        results[label] = measured
        for side in SIDES:
            m = measured[side]
            print(f"{label:24s} {side:5s} " + ("OOM" if m["oom"] else
                  f"{m['tokens'] / m['seconds']:10.0f} tok/s  MFU {mfu(m, flops[side], peak)}  peak {gib(m['peak_gib'])} GiB"),
                  flush=True)  # fmt: skip
        # written after each setting: a run stopped by its time limit still leaves what it measured
        out.write_text(render(args, argv, device, params, lora_params, vocab, tokens, steps, flops, peak, checks, results))

    checks["after every timed step"] = check_base(lora_model, base, digest, adapters)
    print(f"LoRA base after every step: {describe(checks['after every timed step'])}", flush=True)
    out.write_text(render(args, argv, device, params, lora_params, vocab, tokens, steps, flops, peak, checks, results))
    print(f"wrote {out}")
    return 0 if all(not c["changed"] and c["digest_same"] for c in checks.values()) else 1


def mfu(m: dict, flops: float, peak: float | None) -> str:
    return "n/a" if not peak else f"{m['tokens'] / m['seconds'] * flops / peak:.1%}"


def describe(c: dict) -> str:
    same = "bit-identical" if not c["changed"] else f"CHANGED in {len(c['changed'])} tensors (e.g. {c['changed'][0]})"
    return (f"{c['frozen']} frozen tensors {same}; frozen_digest {'unchanged' if c['digest_same'] else 'CHANGED'}; "
            f"{c['adapters_moved']} of {c['adapters']} adapter tensors updated")


def render(args, argv, device, params, lora_params, vocab, tokens, steps, flops, peak, checks, results) -> str:
    dtype = "fp32" if args.smoke else "bf16"
    model_desc = "tiny-llama" if args.smoke else (
        "Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, tied embeddings)"
    )
    lines = [
        f"# LoRA vs full fine-tuning: tokens/s, memory and MFU, {device_name()}, {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        *smoke_banner(args.smoke),
        f"- machine: {machine()}",
        f"- versions: {versions('peft')}; attention {attn.attn_implementation_name('auto')} "
        f"(flash-attn {'yes' if attn.flash_attn_available() else 'no'})",
        f"- model: {model_desc}, {params / 1e6:.1f}M parameters, vocab {vocab}, {dtype}, random init",
        f"- LoRA: r={PEFT.r}, alpha={PEFT.alpha}, dropout {PEFT.dropout}, all-linear (q, k, v, o, gate, up, down; "
        f"not the head), {lora_params:,} trained parameters, {dtype}, base frozen",
        f"- step: forward + backward + torch AdamW{' (fused)' if device == 'cuda' else ''} over the side's trainable "
        f"parameters, one packed row of {tokens} tokens (FLAN-like examples), chunked loss",
        f"- {args.rounds} rounds alternating the sides, each {args.warmup} warmup + {steps} measured steps per side; "
        "peak = max allocated during the measured steps, resident = allocated before them (weights, optimizer "
        "state), each less the other side's resident bytes (both models stay on the GPU)",
        f"- MFU = tokens/s x FLOPs per token / {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'peak (n/a here)'} "
        "(raypack/train/metrics.py's dense bf16 peak). FLOPs per token, with `model_flops_per_token` "
        f"(N = {flops['n'] / 1e6:.1f}M matmul weights with the head, P_lora = {lora_params / 1e6:.2f}M, attention "
        f"12 L H D ctx = {flops['attention'] / 1e9:.2f} GFLOP over these rows): full 6N + attention = "
        f"{flops['full'] / 1e9:.2f} GFLOP; LoRA 4N + 6 P_lora + attention = {flops['lora'] / 1e9:.2f} GFLOP (frozen "
        "weights: forward and backward to the activations, no weight gradient). Recomputation is not counted.",
        "",
        "| memory setting | fine-tuning | tokens/s | MFU | peak GiB | resident GiB |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        for side in SIDES:
            m = r[side]
            if m["oom"]:
                lines.append(f"| {label} | {side} | OOM | | OOM | |")
            else:
                lines.append(f"| {label} | {side} | {m['tokens'] / m['seconds']:.0f} | {mfu(m, flops[side], peak)} | "
                             f"{gib(m['peak_gib'])} | {gib(m['resident_gib'])} |")  # fmt: skip
    lines += ["", "| memory setting | tokens/s LoRA / full | peak LoRA / full | MFU LoRA / full |", "|---|---|---|---|"]
    for label, r in results.items():
        full, lora = r["full"], r["lora"]
        if full["oom"] or lora["oom"]:
            continue
        speed = (lora["tokens"] / lora["seconds"]) / (full["tokens"] / full["seconds"])
        mem = "n/a" if device != "cuda" else f"{lora['peak_gib'] / full['peak_gib']:.2f}x"
        lines.append(f"| {label} | {speed:.3f}x | {mem} | {speed * flops['lora'] / flops['full']:.3f}x |")
    lines += ["", "LoRA's frozen base weights, against a host copy taken before any LoRA step (bit for bit, "
              "`torch.equal`) and raypack's `frozen_digest`:", ""]  # fmt: skip
    lines += [f"- after {args.check_steps} LoRA steps, before timing: {describe(checks['before timing'])}"]
    if "after every timed step" in checks:
        lines.append(f"- after every timed step: {describe(checks['after every timed step'])}")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
