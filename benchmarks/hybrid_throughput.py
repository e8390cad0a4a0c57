"""A Qwen3.5-shaped hybrid on packed rows (issue 42), or a Kimi-Linear-shaped one (KDA, issue 54):
exact against its own unpacked forward, and tokens/s packed over padded on the same data, in one
run, saying which path its mixers took.

    PYTHONPATH=. python benchmarks/hybrid_throughput.py            # one GPU: ~280M parameters, bf16
    PYTHONPATH=. python benchmarks/hybrid_throughput.py --family kimi_linear   # KDA and MLA 3:1, MoE
    PYTHONPATH=. python benchmarks/hybrid_throughput.py --smoke    # tiny model on the CPU: proves the script runs

1. Exactness (tests/exactness.py `packed_vs_alone`: two packed rows, forward and backward, against
   every example alone through transformers' eager model with the same weights; the logits, the
   summed loss and every gradient, relative), on a small config (hidden 256, 3 gated delta rule
   layers and 1 attention layer; examples of 1 to 500 tokens, longer than the scans' 64-token
   chunks), under benchmarks/common.py's EXACT_BOUNDS:
       fp32      attention sdpa_varlen (raypack's exact path); the mixers as they run here
       bf16      raypack's CUDA varlen attention (`auto`)
       noise     the fp32 packed model against the bf16 reference: bf16's own rounding of the
                 examples alone; the bf16 bound is the larger of EXACT_BOUNDS' and twice it
       control   fp32 with raypack's mixers bypassed (the packing keyword arguments dropped, as
                 benchmarks/hybrid_exactness.py's `before`): must exceed the bound, or the check
                 could not fail
2. Throughput: the same 16 FLAN-like examples a step, forward and backward (no optimizer), both
   models loaded from one folder saved in bf16 as published checkpoints are (sharded safetensors):
       packed    one row, raypack's model (varlen attention, mixers.install)
       padded    [16, longest] with attention_mask, transformers' sdpa model (strategy `pad`)
   tokens/s counts real tokens only.

Which path ran is in the results: raypack's (mixers.describe: the varlen kernels where
flash-linear-attention and causal-conv1d are both installed, else the exact torch path, the
examples in padded batches by length) and what transformers bound the gated delta rule's functions to when it
imported the model (fla's Triton kernels where `fla` imports, else its torch reference), which
holds in both of raypack's paths. On the CPU fla's Triton kernels can't run (no driver), and
transformers binds them whenever fla imports: --smoke hides fla, as on a machine without it.
Exit status 1 when an exactness check fails (the results file is written first).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.common import (EXACT_BOUNDS, command_line, device_name, gpu_or_smoke, machine, results_path,  # noqa: E402
                               save_checkpoint, smoke_banner, packed_over_padded, versions, write_results)  # fmt: skip

EXACT_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
                   layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
"""The exactness checks' config (tests/gpu/model/test_mixers.py's sizes, Qwen3.5's 3:1 layer pattern)."""
EXACT_LENGTHS = ([300, 41, 1, 150], [500, 77])
MEASURED = dict(vocab_size=32_000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, layer_types=None, max_position_embeddings=8192)  # fmt: skip
"""Qwen3.5's shape scaled down: head_dim 256, gated attention, the gated delta rule's heads of 128,
a full attention layer every 4th (layer_types None: the config's own pattern)."""
KDA_EXACT = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=None, intermediate_size=512,
                 linear_num_heads=4, linear_head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_hidden_layers=4)  # fmt: skip
"""Kimi-Linear's layout at the exactness checks' size: KDA and MLA 3:1, a dense first layer, then MoE."""
KDA_MEASURED = dict(vocab_size=32_000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=8, num_key_value_heads=8, head_dim=None, linear_num_heads=8, linear_head_dim=128,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
                    mlp_layer_types=["dense"] + ["sparse"] * 11, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=512, max_position_embeddings=8192)  # fmt: skip
"""Kimi-Linear-48B-A3B's shape scaled down: KDA heads of 128, MLA every 4th layer, MoE after a dense layer."""
SHAPES = {"qwen3_5": (EXACT_SIZES, MEASURED, "hybrid"), "kimi_linear": (KDA_EXACT, KDA_MEASURED, "hybrid_kda")}
"""--family -> (exactness sizes, measured sizes, results theme)."""
KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "causal_conv1d_fn")
"""The functions of transformers' gated delta rule and KDA layers that it binds to a kernel package
at import (each module has the ones of its own layer)."""


def hide_kernels_on_cpu(device: str) -> str:
    """On the CPU, make `fla` unimportable before transformers imports a hybrid model (it binds
    fla's Triton kernels whenever fla imports, and Triton has no CPU driver). Says what it did."""
    if device != "cpu" or "fla" in sys.modules or importlib.util.find_spec("fla") is None:
        return ""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    try:
        dist = packages_distributions().get("fla", ["fla-core"])[0]
        found = f"{dist} {version(dist)}"
    except PackageNotFoundError:
        found = "a package"
    sys.modules["fla"] = None  # import fla raises ImportError; find_spec answers None
    return f"fla ({found}) is installed but hidden on the CPU, so `fla not installed` above (its Triton kernels need a GPU)"


def implementation(fn):
    """What transformers' kernel wrapper `fn` calls: the `implementation` it closed over at import."""
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if code is None and callable(getattr(type(f), "forward", None)):
            todo.append(type(f).forward)  # with the `kernels` package, the wrapper is a Module calling it
        for name, cell in zip(code.co_freevars if code else (), getattr(f, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if name == "implementation":
                return value
            if callable(value):
                todo.append(value)
        if getattr(f, "__wrapped__", None) is not None:
            todo.append(f.__wrapped__)
    return None


def bindings(model) -> str:
    """`function -> module.function` for each of KERNEL_FUNCTIONS in the module of the model's
    first gated delta rule layer, or why not known."""
    from raypack.model import mixers
    from raypack.model.traits import decoder

    found = mixers.find(decoder(model))
    if not found:
        return "no mixer layers"
    module = sys.modules[type(decoder(model).get_submodule(next(iter(found)))).__module__]
    parts = []
    for name in KERNEL_FUNCTIONS:
        if not hasattr(module, name):
            continue
        impl = implementation(getattr(module, name))
        if impl is None:
            parts.append(f"{name}: not found")
        elif impl.__module__ == module.__name__:
            parts.append(f"{name} -> transformers' torch reference")
        else:
            parts.append(f"{name} -> {impl.__module__}.{impl.__name__}")
    return "; ".join(parts)


def fla_bound(model) -> bool:
    return "-> fla." in bindings(model)


RUNS = (("fp32", "float32", "float32", "sdpa_varlen"), ("noise", "float32", "bfloat16", "sdpa_varlen"),
        ("bf16", "bfloat16", "bfloat16", "auto"), ("control", "float32", "float32", "sdpa_varlen"))
"""(check, packed model's dtype, reference's dtype, packed attention). `noise`: the exact fp32 packed
model against the bf16 reference alone, which is bf16's own rounding of the example alone; the
bf16 check's bound is the larger of EXACT_BOUNDS' and twice that, since two bf16 computations
of the same thing (packed, alone) each carry it."""


def bf16_bound(noise: dict) -> tuple[float, float]:
    values, gradients = EXACT_BOUNDS["bfloat16"]
    return max(values, 2 * max(noise["logits"], noise["loss"])), max(gradients, 2 * noise["grad"])


def exactness(config, device: str, lengths) -> list[dict]:
    """The checks of the module doc (RUNS), each a dict: name, dtype, attention, errors, bound, ok."""
    import torch
    from exactness import packed_vs_alone

    from benchmarks.hybrid_exactness import _drop_boundaries
    from raypack.model import mixers
    from raypack.model.build import load_model
    from raypack.model.traits import decoder

    rows = {}
    for name, dtype, ref_dtype, attention in RUNS:
        torch.manual_seed(0)
        model = load_model(copy.deepcopy(config), attention=attention, dtype=dtype).to(device).eval()
        ref = load_model(copy.deepcopy(config), attention="eager", dtype=ref_dtype).to(device).eval()
        ref.load_state_dict(model.state_dict())
        if name == "control":
            for module_name in mixers.find(decoder(model)):
                module = decoder(model).get_submodule(module_name)
                module.forward = functools.partial(_drop_boundaries, module.forward)
        errors = packed_vs_alone(model, ref, lengths=lengths, device=device)
        grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
        worst = max(grads, key=grads.get)
        key = "tf32" if dtype == "float32" and device == "cuda" and fla_bound(model) else dtype
        rows[name] = {"name": name, "dtype": dtype if ref_dtype == dtype else f"{dtype} vs {ref_dtype}",
                      "bound_key": key, "attention": attention, "logits": errors["logits"], "loss": errors["loss"],
                      "worst": worst, "grad": grads[worst]}  # fmt: skip
        print(f"exactness {name}: logits {errors['logits']:.2e} loss {errors['loss']:.2e} {worst} {grads[worst]:.2e}",
              flush=True)  # fmt: skip
        del model, ref
    for row in rows.values():
        if row["name"] == "noise":
            row.update(bound=None, ok=True)
            continue
        values, gradients = bf16_bound(rows["noise"]) if row["name"] == "bf16" else EXACT_BOUNDS[row["bound_key"]]
        if row["name"] == "bf16":
            row["bound_key"] = "bfloat16, or twice bf16's own rounding"
        exact = row["logits"] < values and row["loss"] < values and row["grad"] < gradients
        row.update(bound=(values, gradients), ok=(not exact) if row["name"] == "control" else exact)
    return list(rows.values())


def bound_cell(check: dict) -> str:
    if check["bound"] is None:
        return ""
    return f"{check['bound'][0]:.1e}, {check['bound'][1]:.1e} ({check['bound_key']})"


def verdict(check: dict) -> str:
    if check["name"] == "noise":
        return "bf16's own rounding (sets the bf16 bound)"
    if not check["ok"]:
        return "FAILED"
    return "exceeds the bound: the check can fail" if check["name"] == "control" else "exact"


def throughput(config, device: str, steps: int, warmup: int, per_step: int, max_length: int) -> dict:
    import torch

    from benchmarks.attention_throughput import batch_for, make_steps
    from raypack.model.build import load_model

    dtype = "bfloat16" if device == "cuda" else "float32"
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="hybrid_model_") as folder:  # both load it, as users load a checkpoint
        save_checkpoint(load_model(copy.deepcopy(config), attention="sdpa", dtype="bfloat16"), folder)
        packed = load_model(folder, attention="auto", dtype=dtype).to(device).train()
        padded = load_model(folder, attention="sdpa", dtype=dtype).to(device).train()
    batches = make_steps("flan", warmup + steps, per_step, 0, max_length, config.vocab_size)
    real = sum(len(r["input_ids"]) for rows in batches[warmup:] for r in rows)
    out = {"params": sum(p.numel() for p in packed.parameters()), "real_tokens": real, "model": packed}
    host = {mode: [batch_for("pad" if mode == "padded" else "packed_varlen", rows) for rows in batches]
            for mode in ("packed", "padded")}  # fmt: skip
    out.update(packed_over_padded({"packed": packed, "padded": padded}, host, real, warmup, device))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models, short examples, CPU: proves the script runs")
    p.add_argument("--steps", type=int, default=None, help="measured steps a mode (default 10; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps a mode first (default 3; smoke 1)")
    p.add_argument("--examples-per-step", type=int, default=None, help="examples a step (default 16; smoke 4)")
    p.add_argument("--max-length", type=int, default=None, help="clip example lengths (default 4096; smoke 128)")
    p.add_argument("--family", choices=sorted(SHAPES), default="qwen3_5", help="the hybrid's shape (default qwen3_5)")
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)
    device = gpu_or_smoke(__file__, args.smoke, "measures the hybrid mixers' CUDA paths")
    if device is None:
        return 2
    hidden = hide_kernels_on_cpu(device)
    import torch

    from raypack.model import mixers
    from raypack.model.build import tiny_config
    from raypack.model.traits import decoder

    steps = args.steps or (1 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else 1 if args.smoke else 3
    per_step = args.examples_per_step or (4 if args.smoke else 16)
    max_length = args.max_length or (128 if args.smoke else 4096)
    exact_sizes, measured_sizes, theme = SHAPES[args.family]
    if args.smoke:  # the tests' tiny model (one mixer layer, one attention layer), short examples
        from exactness import LENGTHS as lengths

        exact_config, measured = tiny_config(args.family), tiny_config(args.family)
    else:
        exact_config, measured = tiny_config(args.family, **exact_sizes), tiny_config(args.family, **measured_sizes)
        lengths = EXACT_LENGTHS
    out = results_path(theme, args.smoke, args.out)
    shaped = {"qwen3_5": "Qwen3.5", "kimi_linear": "Kimi-Linear"}[args.family]
    header = [f"# Hybrid ({shaped}-shaped) on packed rows: exactness and throughput, {device_name()}, "
              f"{time.strftime('%Y-%m-%d')}", *smoke_banner(args.smoke), "", f"Command: `{command_line(__file__, argv)}`", "",
              f"Machine: {machine()}. Versions: {versions('fla', 'causal_conv1d', 'mamba_ssm', 'flash_attn', 'triton')}; "
              f"float32 matmul precision {torch.get_float32_matmul_precision()}.{' ' + hidden + '.' if hidden else ''}", ""]  # fmt: skip
    t0 = time.perf_counter()
    checks = exactness(exact_config, device, lengths)
    check_lines = [
        "## Exactness: packed against each example alone", "",
        f"Config: {type(exact_config).__name__}, hidden {exact_config.hidden_size}, layers {exact_config.layer_types}; "
        f"rows of examples {list(lengths)} tokens; {time.perf_counter() - t0:.0f} s.", "",
        "| check | dtype | attention | logits | loss | worst gradient | where | bound (values, gradients) | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {c['name']} | {c['dtype']} | {c['attention']} | {c['logits']:.2e} | {c['loss']:.2e} | {c['grad']:.2e} | "
          f"`{c['worst']}` | {bound_cell(c)} | {verdict(c)} |" for c in checks], ""]  # fmt: skip
    # what is done so far, in case the step's time limit cuts the throughput short
    out.write_text("\n".join([*header, *check_lines, "**Incomplete: the throughput part did not finish.**", ""]))

    t0 = time.perf_counter()
    got = throughput(measured, device, steps, warmup, per_step, max_length)
    model = got.pop("model")
    found = mixers.find(decoder(model))
    kind = next(iter(found.values())).name
    ratio = got["packed"]["tokens_per_s"] / got["padded"]["tokens_per_s"]
    lines = [
        *header,
        f"Mixer path on {device}: {mixers.describe(found, device)}.",
        f"transformers' bindings: {bindings(model)}.", "",
        *check_lines,
        "## Throughput: packed over padded, same examples", "",
        f"Model: {type(measured).__name__}, {got['params'] / 1e6:.1f}M parameters, hidden {measured.hidden_size}, "
        f"{measured.num_hidden_layers} layers ({measured.layer_types.count('linear_attention')} {kind}), "
        f"{'bf16' if device == 'cuda' else 'fp32'}, random init; forward and backward, no optimizer. {per_step} FLAN-like "
        f"examples a step (lengths clipped to {max_length}), {warmup} warm-up + {steps} measured steps a mode; "
        f"{got['real_tokens']:,} real tokens measured; {time.perf_counter() - t0:.0f} s.", "",
        "| mode | tokens/s | peak GiB | padding fraction | first-step loss |", "|---|---|---|---|---|",
        *[f"| {m} | {got[m]['tokens_per_s']:,.0f} | {got[m]['peak_gib']:.2f} | {got[m]['padding']:.2f} | "
          f"{got[m]['first_loss']:.4f} |" for m in ("packed", "padded")],
        "", f"**tokens/s packed / padded: {ratio:.2f}x.**", "",
        "packed: raypack's model, one row a step; padded: transformers' sdpa model, one example a row with "
        "attention_mask (what `pack.strategy: pad` trains). The first-step losses agree to bf16 noise when both are exact.",
        "",
    ]  # fmt: skip
    write_results(theme, args.smoke, str(out), lines)
    failed = [c["name"] for c in checks if not c["ok"]]
    if failed:
        print(f"hybrid_throughput: exactness check(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
