"""Liger-Kernel's Triton kernels on the CPU, run by Triton's interpreter (TRITON_INTERPRET=1), so
that the checks of tests/gpu/model/test_kernels.py run without a GPU, in fp32:

- `model.kernels: liger` (raypack.model.kernels.apply_kernels, Liger's RMSNorm, RoPE, SwiGLU/GeGLU
  and LayerNorm on the model instance): one packed forward and backward gives each example's
  logits, loss and gradients run alone through the model's own code with the same weights;
- the same with `train.compile` on, as training runs it (layers checkpointed, Liger's calls opaque
  ops in their graphs: raypack/model/liger_graph.py), no graph break, and no new graph for rows of
  other lengths;
- `train.loss: liger` (Liger's fused linear cross-entropy): the chunked loss's sum and gradients.

Run in a fresh process, as tests/unit/model/test_liger_interpreted.py does: TRITON_INTERPRET is
read when Liger defines its kernels (at import), and Liger patches transformers' modules for the
whole process (RoPE is a module function, so the reference runs Liger's RoPE too; its norms and
MLPs are the model's own).

    TRITON_INTERPRET=1 python tests/liger_interpreted.py llama gemma2   # one JSON object on stdout:
    {"kernels/llama": {what: rel err}, ..., "compiled/llama": ..., "loss/llama": ...}  # or {"error": ...}
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime import interpreter

LENGTHS = ([30, 7, 1, 15], [50, 9])
LOSS_FAMILIES = ("llama", "gemma2")  # plain, and a softcapped head
COMPILED_FAMILIES = ("llama", "gemma2")  # SwiGLU, and GeGLU with sliding windows
MOE_GPU_ONLY = frozenset({"deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"})
"""Families whose experts Liger swaps for its fused MoE kernel, which asks the CUDA driver for the
device's properties: the interpreter has no driver; tests/gpu/model/test_kernels.py runs them."""


def _patch_interpreter() -> None:
    """Two gaps of Triton 3.9's interpreter that Liger's kernels fall into:
    - a Python float argument reaches the kernel as a Python float, where compiled Triton passes
      an fp32 scalar (Liger's RMSNorm calls `eps.to(tl.float32)`);
    - `triton.language.extra.libdevice`'s functions are stubs that return None; tl.math's same
      functions are interpreted, and tanh (GeGLU's GELU), which tl.math lacks, is 2σ(2x) - 1.
    Both before Liger imports its kernels, which bind libdevice's functions by name."""
    convert = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = implicit_cvt

    def late(name):  # looked up at call time: the interpreter swaps tl.math's functions in per launch
        return lambda *args, **kwargs: getattr(tl.math, name)(*args, **kwargs)

    for name in dir(libdevice):
        if not name.startswith("_") and hasattr(tl.math, name):
            setattr(libdevice, name, late(name))
    libdevice.tanh = lambda x: 2 * tl.sigmoid(2 * x) - 1


def check_kernels(family: str, compiled: bool = False) -> dict[str, float]:
    from exactness import packed_vs_alone
    from families import FAMILIES

    from raypack.model import kernels
    from raypack.model.build import load_model

    torch._dynamo.reset()
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    # compiled: as training runs it, each layer checkpointed (full recompute)
    model = load_model(config, attention="sdpa_varlen", dtype="float32",
                       gradient_checkpointing="full" if compiled else "none").eval()
    ref = load_model(config, attention="eager", dtype="float32").eval()  # built before Liger patches classes
    ref.load_state_dict(model.state_dict())
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # "cuda": the interpreter stands in for it; apply_kernels refuses Liger on any other device
    assert kernels.apply_kernels(model, "liger", "cuda") == "liger"
    swapped = sum(type(m).__name__.startswith("Liger") or m._get_name().startswith("Liger") for m in model.modules())
    if not swapped:
        raise AssertionError(f"{family}: Liger swapped no module in")
    if {k: v.shape for k, v in model.state_dict().items()} != shapes:
        raise AssertionError(f"{family}: Liger changed the weights' shapes")
    if not compiled:
        return {**packed_vs_alone(model, ref, lengths=LENGTHS), "liger_modules": swapped}
    # train.compile: Liger's calls are opaque ops in the layers' graphs (raypack/model/liger_graph.py;
    # Dynamo tracing into them would trace the interpreter here). Trained as the loop trains: the
    # setup probe refuses a graph break, the layers run in training mode, checkpointed.
    from torch._dynamo.utils import counters

    from raypack.train.objectives.loss import probe_batch

    counters.clear()
    kernels.compile_layers(model)
    kernels.check_compiled(model, {k: v for k, v in probe_batch(config.vocab_size, False).items() if k != "labels"})
    for layer in kernels.decoder_layers(model, "test"):
        layer.training = True
    errors = packed_vs_alone(model, ref, lengths=LENGTHS)
    graphs = kernels.compiled_graphs()
    more = packed_vs_alone(model, ref, lengths=([10, 7, 3, 2], [5, 19]), seed=1)
    return {**errors, **{f"{k} (other rows)": v for k, v in more.items()}, "liger_modules": swapped,
            "graphs": graphs, "new_graphs": kernels.compiled_graphs() - graphs,
            "graph_breaks": sum(counters["graph_break"].values())}


def check_compiled(family: str) -> dict[str, float]:
    return check_kernels(family, compiled=True)


def check_loss(family: str) -> dict[str, float]:
    from exactness import rel_err
    from families import FAMILIES

    from raypack.data.collate import collate_packed
    from raypack.model.build import load_model
    from raypack.train.objectives.loss import CausalLMLoss, label_targets

    config = FAMILIES[family].build_config(family)
    if family == "gemma2":
        config.final_logit_softcapping = 5.0
    torch.manual_seed(0)
    model = load_model(config, attention="sdpa_varlen", dtype="float32").eval()
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n)), "position_ids": list(range(n))}
            for n in (40, 17)]  # fmt: skip
    batch = collate_packed(rows)
    batch.update(label_targets(batch["labels"]))
    runs = {}
    for kind in ("chunked", "liger"):
        model.zero_grad(set_to_none=True)
        loss = CausalLMLoss(model, kind)(model, batch)
        loss.backward()
        runs[kind] = {"loss": loss.detach(), **{f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()}}
    return {what: rel_err(runs["liger"][what], runs["chunked"][what]) for what in runs["chunked"]}


def main(families: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    _patch_interpreter()
    results = {}
    checks = [(f"kernels/{f}", check_kernels, f) for f in families]
    checks += [(f"compiled/{f}", check_compiled, f) for f in COMPILED_FAMILIES]
    checks += [(f"loss/{f}", check_loss, f) for f in LOSS_FAMILIES]
    for name, check, family in checks:
        try:
            results[name] = check(family)
        except Exception as e:  # reported per check, so one family's failure names itself
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
