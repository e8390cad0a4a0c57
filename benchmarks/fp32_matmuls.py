"""Matmuls that run in fp32 on a train step's hot path under bf16 compute, counted on the CPU.

    PYTHONPATH=. python benchmarks/fp32_matmuls.py            # every model kind x engine path
    PYTHONPATH=. python benchmarks/fp32_matmuls.py --smoke    # the same, one tiny step each

A bf16 run whose head, loss, router or attention multiplies in fp32 runs those matmuls at a
fraction of the tensor cores' bf16 rate (and moves twice the bytes), and no throughput number
says which site did it. The dtype of every matmul's inputs is a fact of the code, the same on
the CPU as on a GPU, so it is counted here: a `TorchDispatchMode` sees every aten op of one
optimizer step's forward, loss and backward (`forward_backward`, as the loop runs it; the
optimizer's step is not a matmul) and counts the matrix products (mm, addmm, bmm, baddbmm,
linear, matmul, MoE experts' _grouped_mm, the `_scaled_dot_product_*` kernels, convolution; their backward ops too) by
input dtype: an op with any fp32 floating input counts as fp32. Each is attributed to its site:
the innermost frame in transformers, raypack, peft or DeepSpeed (in backward, the frame of the
forward that recorded the autograd node, which anomaly mode keeps).

Engine paths, one rank each, the engines' own code (raypack/train/engines):
- `deepspeed bf16`: DeepSpeed ZeRO-2, the model built in bf16 (precision mixed, model.dtype bfloat16);
- `torch mixed`: the torch engine at zero_stage 0 (DDP's path; one rank runs the bare model),
  fp32 master weights in the model, the forward under autocast, the head and loss cast;
- `torch bf16`: the torch engine, precision bf16 (bf16 weights, Kahan-summed AdamW).
FSDP2 (zero_stage 1-3) casts its gathered weights with MixedPrecisionPolicy and needs a sharded
mesh; it is not counted here.

Model kinds: dense (tiny-llama), MoE with its router loss (tiny-qwen3_moe), two hybrids
(tiny-qwen3_5: gated delta rule; tiny-nemotron_h: Mamba-2) and a VLM (tiny-qwen2_5_vl, the
bundled sample's images). Results: benchmarks/results/fp32_matmuls_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import command_line, machine, smoke_banner, versions, write_results  # noqa: E402

KINDS = {
    "dense": "tiny-llama",
    "MoE, router loss": "tiny-qwen3_moe",
    "hybrid (gated delta rule)": "tiny-qwen3_5",
    "hybrid (Mamba-2)": "tiny-nemotron_h",
    "VLM": "tiny-qwen2_5_vl",
}
PATHS = ("deepspeed bf16", "torch mixed", "torch bf16")
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_addmm_activation", "_grouped_mm", "convolution",
           "convolution_backward", "_convolution", "_conv_depthwise2d", "mkldnn_convolution"}
ORIGINS = ("transformers", "raypack", "peft", "deepspeed")
MODELS_OWN = {
    "transformers/models/qwen3_5/modeling_qwen3_5.py:torch_chunk_gated_delta_rule":
        "transformers' torch gated delta rule casts query, key and value to fp32 itself; the CPU's path (raypack "
        "keeps its examples apart around it), where CUDA runs flash-linear-attention's kernel",
    "transformers/models/nemotron_h/modeling_nemotron_h.py:mamba2_chunk_scan":
        "transformers' torch Mamba-2 scan casts the states, B and C to fp32 itself; the CPU's path, where CUDA runs "
        "mamba-ssm's kernel",
}
"""fp32 matmul sites that are the model's own code (not raypack's, not an engine's): allowed, and
listed in the results. Each runs only where no kernel is installed (the CPU)."""
OPEN: dict[tuple[str, str, str], str] = {}
"""fp32 matmul sites found and not yet fixed, by (kind, engine path, site), with why: the test's
stated allowance, to be emptied."""


def is_matmul(name: str) -> bool:
    return name in MATMULS or name.startswith("_scaled_dot_product") or name.startswith("cudnn_convolution")


def _site(frames: list[tuple[str, int, str]]) -> str:
    """`package/file.py:function` of the innermost frame in one of ORIGINS (files as in site-packages)."""
    for filename, _, function in reversed(frames):
        parts = Path(filename).parts
        for origin in ORIGINS:
            if origin in parts and "benchmarks" not in parts:
                i = len(parts) - 1 - parts[::-1].index(origin)
                return f"{'/'.join(parts[i:])}:{function}"
    return "torch"


def _backward_frames(node) -> list[tuple[str, int, str]] | None:
    stack = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not stack:
        return None
    frames = []
    for entry in stack:  # traceback.format_stack's strings: '  File "f", line n, in fn\n    code\n'
        head = entry.strip().splitlines()[0]
        if head.startswith("File "):
            filename = head.split('"')[1]
            function = head.rsplit(" in ", 1)[-1]
            frames.append((filename, 0, function))
    return frames


def _frames() -> list[tuple[str, int, str]]:
    """This thread's stack, outermost first, without reading source lines (traceback's would)."""
    out, frame = [], sys._getframe(2)
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


class _Autocast(TorchFunctionMode):
    """Where a custom op is called (raypack's exact attention), the autocast state it is called
    under: a dispatch mode's handler runs with autocast's keys excluded, so `MatmulCounter` runs a
    custom op's own implementation under the state recorded here, as it would run unobserved."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.dtype | None] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and func.namespace != "aten":
            self.state = {d: torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
                          for d in ("cpu", "cuda")}
        return func(*args, **(kwargs or {}))


class MatmulCounter(TorchDispatchMode):
    """Counts matrix products by (phase, site, op, input dtype) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.autocast = _Autocast()

    def __enter__(self):
        self.autocast.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.autocast.__exit__(*exc)

    def _custom(self, func, args, kwargs):
        """A custom op (not aten's) through its own implementation, counted inside, under the
        autocast state it was called with (`_Autocast`); None where it is none of torch.library's."""
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func._name)
        device = next((t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)), "cpu")
        fn = opdef and (opdef._backend_fns.get(device) or opdef._backend_fns.get(None) or opdef._init_fn)
        if fn is None:
            return None
        dtype = self.autocast.state.get(device)
        with contextlib.ExitStack() as stack:
            if dtype is not None:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(self)
            return (fn(*args, **(kwargs or {})),)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("aten", "prim") and torch._C._current_autograd_node() is None:
            out = self._custom(func, args, kwargs)
            if out is not None:
                return out[0]
        name = func.overloadpacket.__name__
        if is_matmul(name):
            floats = [t.dtype for t in pytree.tree_leaves((args, kwargs or {}))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if name.startswith("_scaled_dot_product"):
                # the query's (forward) or the incoming gradient's (backward) dtype: the fused
                # kernels keep the softmax's logsumexp in fp32 by design, on every device
                dtype = floats[0] if floats else None
            else:
                dtype = torch.float32 if torch.float32 in floats else min(floats, key=str) if floats else None
            node = torch._C._current_autograd_node()
            frames = _backward_frames(node)
            phase = "backward" if node is not None else "forward"
            if frames is None:
                frames = _frames()
            self.counts[(phase, _site(frames), name, str(dtype).removeprefix("torch."))] += 1
        return func(*args, **(kwargs or {}))

    def fp32(self) -> collections.Counter:
        return collections.Counter({k: n for k, n in self.counts.items() if k[3] == "float32"})

    def hot_path_fp32(self, known: set[str] = frozenset()) -> collections.Counter:
        """fp32 matmuls at sites that are not the model's own (MODELS_OWN) nor in `known`: what must be 0."""
        return collections.Counter({k: n for k, n in self.fp32().items() if k[1] not in set(MODELS_OWN) | set(known)})


def _engine(path: str, name: str):
    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.train import engines

    engine = "deepspeed" if path.startswith("deepspeed") else "torch"
    precision = "bf16" if path.endswith("bf16") and engine == "torch" else "mixed"
    cfg = TrainConfig(engine=engine, num_workers=1, zero_stage=2 if engine == "deepspeed" else 0, precision=precision,
                      grad_clip=1.0, warmup_steps=0, lr=1e-4, router_aux_loss="example")
    weights, compute = engines.weights_dtype(cfg, "bfloat16"), engines.compute_dtype(cfg, "bfloat16")
    torch.manual_seed(0)
    model = load_model(name, attention="auto", dtype=weights, vocab_size=768)
    return cfg, engines.build(model, cfg, dtype=compute, world_size=1, total_steps=2)


def count_step(path: str, kind: str, tokens: int) -> MatmulCounter:
    """One optimizer step (one packed row) of `kind` on engine `path`, counted."""
    from benchmarks.loop_syncs import rows_for
    from raypack.train.objectives.loss import make_loss, probe_batch
    from raypack.train.objectives.router_loss import make_router_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.step import forward_backward
    from raypack.train.vision_rows import VisionRows

    cfg, engine = _engine(path, KINDS[kind])
    loss = make_loss(engine, "chunked")
    probe = {k: v for k, v in probe_batch(loss.vocab, False).items() if k != "labels"}
    router = make_router_loss(engine.module, cfg, KINDS[kind], probe)
    rows, vision = rows_for(kind, KINDS[kind], 1, tokens, loss.vocab)
    collate = prepare_step if vision is None else functools.partial(
        prepare_step, collate=VisionRows(engine.module, *vision))
    step = collate(rows, router_scope=router.scope if router is not None else None)
    counter = MatmulCounter()
    try:
        # anomaly mode keeps each autograd node's forward stack: the backward's sites
        with counter, torch.autograd.detect_anomaly(check_nan=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forward_backward(engine, step.batches, 1.0 / max(step.label_tokens, 1), loss, router=router,
                             router_scale=0.01 if router is not None else 0.0)
        engine.step()
    finally:
        if router is not None:
            router.routers.remove()
        engine.destroy()
    return counter


@contextlib.contextmanager
def one_rank():
    """A gloo group of one, with the variables DeepSpeed's launcher would set."""
    from benchmarks.step_syncs import destroy_process_group

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")}
    with tempfile.TemporaryDirectory(prefix="fp32_matmuls_") as tmp:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", DS_ACCELERATOR="cpu")
        ours = not torch.distributed.is_initialized()
        if ours:
            torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            if ours:
                destroy_process_group()
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def measure(kinds, paths, tokens: int) -> dict[tuple[str, str], MatmulCounter]:
    with one_rank():
        return {(kind, path): count_step(path, kind, tokens) for kind in kinds for path in paths}


def _open(key: tuple[str, str]) -> set[str]:
    return {site for (kind, path, site) in OPEN if (kind, path) == key}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a 64-token row a kind: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the step's packed row (default 256)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tokens = args.tokens or (64 if args.smoke else 256)
    torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    results = measure(KINDS, PATHS, tokens)
    lines = ["# fp32 matmuls on a train step's hot path under bf16 compute, cpu", *smoke_banner(args.smoke), "",
             f"Command: `{command_line(__file__, argv)}`", "",
             f"Machine: {machine()}. Versions: {versions('deepspeed', 'peft')}.", "",
             f"One rank, one optimizer step of one {tokens}-token packed row (the VLM: the bundled sample's row), "
             "forward, chunked loss (and the MoE's router loss) and backward through `forward_backward`, each engine's "
             "own code (the script's docstring). Counted: every matrix product aten runs, by its inputs' dtype "
             "(fp32 if any input is).", "",
             "| kind | model | engine path | matmuls | bf16 | fp32 | fp32, not the model's own |",
             "|---|---|---|---|---|---|---|"]
    for (kind, path), counter in results.items():
        total = sum(counter.counts.values())
        fp32 = sum(counter.fp32().values())
        bf16 = sum(n for k, n in counter.counts.items() if k[3] == "bfloat16")
        own = sum(counter.hot_path_fp32().values())
        lines.append(f"| {kind} | {KINDS[kind]} | {path} | {total} | {bf16} | {fp32} | {own} |")
    hot = sum(sum(c.hot_path_fp32(_open(key)).values()) for key, c in results.items())
    known = sum(sum(c.hot_path_fp32().values()) for c in results.values()) - hot
    lines += ["", f"fp32 matmuls on the hot path, neither the model's own nor a known open site, all kinds and engine "
              f"paths: {hot}", "", f"Known open sites (OPEN, not fixed yet): {known} matmuls"]
    lines += [f"- {kind}, {path}, `{site}`: {why}." for (kind, path, site), why in OPEN.items()]
    lines += ["", "## fp32 matmuls by site", "",
              "| kind | engine path | phase | site | op | count | the model's own |", "|---|---|---|---|---|---|---|"]
    for (kind, path), counter in results.items():
        for (phase, site, op, _), n in sorted(counter.fp32().items()):
            lines.append(f"| {kind} | {path} | {phase} | {site} | {op} | {n} | {'yes' if site in MODELS_OWN else 'no'} |")
    lines += ["", "The model's own sites (allowed; benchmarks/fp32_matmuls.py MODELS_OWN):", ""]
    lines += [f"- `{site}`: {why}." for site, why in MODELS_OWN.items()]
    write_results("fp32_matmuls", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
