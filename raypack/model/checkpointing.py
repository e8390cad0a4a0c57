"""What a training backward recomputes instead of keeping from the forward: `model.gradient_checkpointing`.

    mode        kept from the forward, per decoder layer           recomputed in backward
    none        every activation                                   nothing
    selective   the matmul outputs (q, k, v, o, gate, up, down)    the elementwise work between them:
                and the attention output                           norms, RoPE, activations, residuals
    full        the layer's input                                  the whole layer

Fastest first; memory the other way round (raypack/train/memory/estimate.py sizes each). Each is exact: it
changes when values are computed, not the values. `auto` is not a mode here: the training loop
resolves it before the model is built, by the memory estimate (raypack/train/memory/auto.py).

Both recomputing modes go through transformers' own per-layer checkpointing (each decoder
layer's forward in a non-reentrant torch.utils.checkpoint). `selective` gives that checkpoint
PyTorch's selective activation checkpointing as its context (`create_selective_checkpoint_contexts`
with `policy` below): during the forward, the outputs of the ops in SAVED are cached, and the
recompute in backward takes them from the cache instead of running those ops again, so only the
cheap, memory-bound ops run twice. It is the policy torchtitan's selective AC applies per op
(matmuls and attention saved), minus its every-other-matmul rule. With `train.compile`, Dynamo
traces the checkpoint, policy included, as a higher-order op, so the recompute is compiled too.
A model that writes in place into a kept output is not exact under `selective`: `check_selective`
finds it at setup (refused if configured, full instead under `auto`).

A matmul between weights alone is recomputed, not kept: peft's LoRA on a parameter (an MoE's
experts, a router) folds its adapter into the weight each forward (`baddbmm(W, B, A)`, or `B @ A`
then `mul_` in peft 0.22). Kept, that fold holds a second copy of every expert's weight per layer
(the whole expert stack of the model, beside the activations selective exists to shrink), and
peft 0.22's in-place scaling mutates it. `check_selective` finds these products on the setup probe
(each operand computed from parameters and buffers alone) and enables the policy with their
signatures (op and operand shapes, which don't depend on the batch).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from raypack.model.traits import UnsupportedModelError

MODES = ("none", "selective", "full")
"""model.gradient_checkpointing's modes, fastest (and hungriest) first; plus `auto`."""

SAVED = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "raypack::exact_varlen", "torch_attn::_varlen_attn",
    "flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_forward",
})  # fmt: skip
"""The ops whose outputs `selective` keeps: the matmuls (a linear is mm or addmm by the time it is
dispatched) and every attention backend raypack runs (raypack's exact path, torch's varlen_attn,
flash-attn's custom ops, SDPA's kernels). By name, so no backend need be imported to name it."""


Signature = tuple[str, tuple[tuple[int, ...], ...]]
"""An op's name and its tensor operands' shapes."""


def signature(op, args) -> Signature | None:
    """`op`'s signature, or None where a size is symbolic (Dynamo's dynamic token count): a
    product of weights has sizes of its own."""
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
    return (op.name(), shapes) if all(type(n) is int for shape in shapes for n in shape) else None


def policy(weight_products: frozenset[Signature], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's choice per op: keep SAVED's outputs but the products of weights
    alone (`weight_products`, found by check_selective), recompute the rest."""
    if op.name() not in SAVED or (weight_products and signature(op, args) in weight_products):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def enable(model: nn.Module, mode: str, weight_products: frozenset[Signature] = frozenset()) -> None:
    """Apply `mode` (one of MODES) to a freshly built transformers model; under selective, recompute
    the matmuls in `weight_products` (check_selective's) instead of keeping them."""
    if mode not in MODES:
        raise ValueError(f"model.gradient_checkpointing: expected one of {', '.join(MODES)} here, got {mode!r}")
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        # a functools.partial of this function, as Dynamo requires of a checkpoint's context_fn
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 functools.partial(policy, weight_products))  # fmt: skip
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def active_mode(model: nn.Module) -> str:
    """The mode `model`'s layers run (as `enable` set it)."""
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]  # fmt: skip
    if not funcs:
        return "none"
    return "selective" if "context_fn" in getattr(funcs[0], "keywords", {}) else "full"


@dataclass(frozen=True)
class Survey:
    """What one forward shows about `selective` for a model (`survey`)."""

    hazard: str | None
    """Why selective would not be exact, or None."""
    weight_products: frozenset[Signature]
    """The SAVED ops whose operands all come from parameters and buffers: recomputed, not kept."""


def survey(model: nn.Module, batch: dict) -> Survey:
    """One no-grad forward of `batch` that follows which tensors come from the model's parameters
    and buffers alone (an op's output does when all its tensor inputs do), to find the products of
    weights (recomputed under `policy`), and watches for an op writing in place into the output of
    a SAVED op that selective keeps. Selective checkpointing's recompute would take that output from
    its cache, already overwritten. PyTorch checks the cached tensor's version counter, but a
    matmul's output reaches the model through `_unsafe_view`, whose writes bump another counter
    (Gemma 3n's AltUp: `predictions +=`), so only a check by storage catches them. A tensor taken
    for the batch's where it came from weights costs a recompute, never exactness."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Watch(TorchDispatchMode):
        def __init__(self, state: list[torch.Tensor]) -> None:
            super().__init__()
            self.kept: dict[int, tuple[str, torch.Tensor]] = {}  # referenced: no storage is reused meanwhile
            self.weights: dict[int, weakref.ref] = {id(t): weakref.ref(t) for t in state}  # by identity
            self.products: set[Signature] = set()
            self.hazard: str | None = None

        def from_weights(self, t: torch.Tensor) -> bool:
            if isinstance(t, nn.Parameter):  # FSDP2's unsharded parameters too, gathered for the forward
                return True
            ref = self.weights.get(id(t))
            return ref is not None and ref() is t

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            weights_only = all(self.from_weights(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            written = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info and arg.alias_info.is_write]
            for tensor in written:
                if not isinstance(tensor, torch.Tensor):
                    continue
                if not weights_only:  # now holds the batch's values
                    self.weights.pop(id(tensor), None)
                source = self.kept.get(tensor.untyped_storage().data_ptr())
                if source is not None and self.hazard is None:
                    self.hazard = f"{func.name()} writes in place into the output of {source[0]}, which it keeps"
            if weights_only:
                self.weights.update((id(t), weakref.ref(t)) for t in outs)
                if func.name() in SAVED and (products := signature(func, args)) is not None:
                    self.products.add(products)
            elif func.name() in SAVED:
                self.kept.update((t.untyped_storage().data_ptr(), (func.name(), t)) for t in outs)
            return out

    was_training = model.training
    model.eval()
    try:
        # eagerly: Dynamo meeting a dispatch mode in compiled layers (train.compile) would skip
        # them, and keep skipping them after
        state = [*model.parameters(), *model.buffers()]
        with torch.compiler.set_stance("force_eager"), torch.no_grad(), Watch(state) as watch:
            model(**batch)
    finally:
        model.train(was_training)
    return Survey(watch.hazard, frozenset(watch.products))


def check_selective(model: nn.Module, batch: dict, configured: str) -> tuple[str, str | None]:
    """At setup, with the model on its device: `selective` where it is exact. Where it is not, an
    UnsupportedModelError if it was configured, and full instead if `auto` chose it. Returns the
    mode the layers run and, if it changed, why."""
    if active_mode(model) != "selective":
        return active_mode(model), None
    found = survey(model, batch)
    hazard = found.hazard
    if hazard is None:
        if found.weight_products:
            enable(model, "selective", found.weight_products)
        return "selective", None
    if configured == "selective":
        raise UnsupportedModelError(f"model.gradient_checkpointing=selective is not exact for {type(model).__name__}: "
                                    f"{hazard}; set it to full (or auto)")
    enable(model, "full")
    return "full", f"selective is not exact for this model ({hazard})"
