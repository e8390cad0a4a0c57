"""Liger-Kernel's kernels inside compiled graphs, as opaque ops: `model.kernels: liger` with
`train.compile` (raypack/model/kernels.py).

Dynamo tracing into Liger's autograd Functions and Triton launches is where Liger's users report
failures, and keeping them out with torch.compiler.disable breaks every layer's graph (a
checkpointed layer then runs eagerly, forward and recompute). So each Liger call a compiled
layer makes is one torch.library custom op, `raypack::liger`, that Dynamo and Inductor treat as
a black box with a known output shape:

    forward     the Liger call as it runs uncompiled, on copies of its tensor inputs (Liger's
                RoPE rotates q and k in place, and an op may not write into its inputs);
                its outputs made contiguous
    backward    a second op that runs the call again with autograd on and takes its gradients
                (Liger's own backward kernels), so the backward reruns Liger's forward kernel

Which calls: the Functions Liger's modules call (LigerRMSNormFunction, LigerLayerNormFunction,
LigerSiLUMulFunction, LigerGELUMulFunction), swapped in the globals of Liger's modules for a shim
whose `apply` is the op, and Liger's functions put into a model's modeling module (RoPE). Any
other Liger code in a layer is traced by Dynamo as before; where it breaks the graph, the setup
probe (`kernels.check_compiled`) refuses the run. What this costs against letting Inductor fuse
the same work is benchmarks/recompute.py's to measure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

FUNCTIONS = {"LigerRMSNormFunction": 1, "LigerLayerNormFunction": 1, "LigerSiLUMulFunction": 1,
             "LigerGELUMulFunction": 1}  # fmt: skip
"""Liger autograd Functions made opaque, and how many tensors each returns (shaped like its first inputs)."""
ROPE_OUTPUTS = 2
"""Liger's RoPE functions return (q, k), shaped like their first two inputs."""

_CALLS: dict[str, tuple[Callable[..., Any], int]] = {}
"""Name -> (the Liger callable, its output count): what the op runs, by the name it is given."""


SEP = "\x1f"
"""Joins the strings of a call, and its keyword names, into one op argument (no list of str in a schema)."""


def _pack(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[float], list[int], str, str, str]:
    """A call's arguments in an op's schema: tensors, floats, ints (bools as ints), strings (joined
    by SEP), a layout string (one letter an argument: T f i b s, N for None) saying where each goes,
    and the keyword names (joined by SEP) of the last ones."""
    tensors, floats, ints, strs, layout = [], [], [], [], ""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            layout += "T"
        elif value is None:
            layout += "N"
        elif isinstance(value, bool):
            ints.append(int(value))
            layout += "b"
        elif isinstance(value, int):
            ints.append(value)
            layout += "i"
        elif isinstance(value, float):
            floats.append(value)
            layout += "f"
        elif isinstance(value, str):
            strs.append(value)
            layout += "s"
        else:
            raise TypeError(f"model.kernels=liger with train.compile: can't pass a {type(value).__name__} to Liger")
    return tensors, floats, ints, SEP.join(strs), layout, SEP.join(kwargs)


def _unpack(tensors, floats, ints, strs: str, layout: str, names: str) -> tuple[list, dict]:
    sources = {"T": iter(tensors), "f": iter(floats), "i": iter(ints), "s": iter(strs.split(SEP) if strs else [])}
    names = names.split(SEP) if names else []
    values = [None if c == "N" else bool(next(sources["i"])) if c == "b" else next(sources[c]) for c in layout]
    split = len(values) - len(names)
    return values[:split], dict(zip(names, values[split:]))


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@torch.library.custom_op("raypack::liger", mutates_args=())
def _liger_op(name: str, tensors: list[torch.Tensor], floats: list[float], ints: list[int], strs: str, layout: str,
              names: str) -> list[torch.Tensor]:  # fmt: skip
    fn, _ = _CALLS[name]
    args, kwargs = _unpack([t.clone() for t in tensors], floats, ints, strs, layout, names)
    # contiguous, as the fake outputs are (Liger's RoPE returns transposed views)
    return [t.contiguous() for t in _as_list(fn(*args, **kwargs))]


@_liger_op.register_fake
def _(name, tensors, floats, ints, strs, layout, names):
    return [t.new_empty(t.shape) for t in tensors[: _CALLS[name][1]]]


@torch.library.custom_op("raypack::liger_backward", mutates_args=())
def _liger_backward_op(name: str, grads: list[torch.Tensor], tensors: list[torch.Tensor], needs: list[bool],
                       floats: list[float], ints: list[int], strs: str, layout: str,
                       names: str) -> list[torch.Tensor]:  # fmt: skip
    """The gradient of each input in `needs` (an empty tensor for the others)."""
    fn, _ = _CALLS[name]
    # Autograd is off inside an op's kernel; this backward builds and consumes its own graph of
    # Liger's Functions (as torch.utils.checkpoint's selective mode does with the same guard).
    keys = torch._C.DispatchKey
    with (torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False),
          torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False), torch.enable_grad()):
        inputs = [t.detach().clone().requires_grad_(need) for t, need in zip(tensors, needs)]
        args, kwargs = _unpack(inputs, floats, ints, strs, layout, names)
        outs = _as_list(fn(*args, **kwargs))
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad(outs, wanted, [g.clone() for g in grads], allow_unused=True))
    result = []
    for t, need in zip(inputs, needs):
        g = next(got) if need else None
        result.append((torch.zeros(t.shape, dtype=t.dtype, device=t.device) if g is None else g.contiguous())
                      if need else t.new_empty(0))
    return result


@_liger_backward_op.register_fake
def _(name, grads, tensors, needs, floats, ints, strs, layout, names):
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(tensors, needs)]


def _setup_context(ctx, inputs, output) -> None:
    name, tensors, floats, ints, strs, layout, names = inputs
    ctx.save_for_backward(*tensors)
    ctx.call = (name, floats, ints, strs, layout, names)
    ctx.needs = [t.requires_grad for t in tensors]


def _backward(ctx, grads):
    name, floats, ints, strs, layout, names = ctx.call
    tensors = list(ctx.saved_tensors)
    got = _liger_backward_op(name, list(grads), tensors, ctx.needs, floats, ints, strs, layout, names)
    # the inputs' structure: a list of numbers is one leaf (None), but an empty list stays a list
    return (None, [g if need else None for g, need in zip(got, ctx.needs)], None if floats else [],
            None if ints else [], None, None, None)


_liger_op.register_autograd(_backward, setup_context=_setup_context)


def opaque(name: str, fn: Callable[..., Any], outputs: int) -> Callable[..., Any]:
    """`fn` (a Liger call returning `outputs` tensors) as one `raypack::liger` op."""
    _CALLS[name] = (fn, outputs)

    def call(*args, **kwargs):
        tensors, floats, ints, strs, layout, names = _pack(args, kwargs)
        out = _liger_op(name, tensors, floats, ints, strs, layout, names)
        return out[0] if outputs == 1 else tuple(out)

    call.__wrapped__ = fn
    return call


class _Shim:
    """Stands in for a Liger autograd Function where Liger's modules look it up: `apply` is the op."""

    def __init__(self, function: type) -> None:
        self.function = function
        self.apply = opaque(function.__name__, function.apply, FUNCTIONS[function.__name__])


def make_opaque(modeling_modules: set) -> int:
    """Swap Liger's Functions in its modules' globals for shims, and Liger's RoPE functions in
    `modeling_modules` (where Liger put them) for ops. Process-wide, as Liger's own patches are;
    the ops compute what the calls did. Returns how many places were swapped."""
    swapped = 0
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("liger_kernel.transformers") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if name in FUNCTIONS and isinstance(value, type) and issubclass(value, torch.autograd.Function):
                setattr(module, name, _Shim(value))
                swapped += 1
    for source in modeling_modules:
        for name, fn in list(vars(source).items()):
            module = getattr(fn, "__module__", "") or ""
            if callable(fn) and module.startswith("liger_kernel") and "rotary_pos_emb" in getattr(fn, "__name__", ""):
                setattr(source, name, opaque(f"{module}.{fn.__name__}", fn, ROPE_OUTPUTS))
                swapped += 1
    return swapped
