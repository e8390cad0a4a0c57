"""What a training backward recomputes instead of keeping from the forward: `model.gradient_checkpointing`.

    mode        kept from the forward, per decoder layer           recomputed in backward
    none        every activation                                   nothing
    selective   the matmul outputs (q, k, v, o, gate, up, down)    the elementwise work between them:
                and the attention output                           norms, RoPE, activations, residuals
    full        the layer's input                                  the whole layer

Fastest first; memory the other way round (raypack/train/memory.py sizes each). Each is exact: it
changes when values are computed, not the values. `auto` is not a mode here: the training loop
resolves it before the model is built, by the memory estimate (`memory.choose_checkpointing`).

Both recomputing modes go through transformers' own per-layer checkpointing (each decoder
layer's forward in a non-reentrant torch.utils.checkpoint). `selective` gives that checkpoint
PyTorch's selective activation checkpointing as its context (`create_selective_checkpoint_contexts`
with `policy` below): during the forward, the outputs of the ops in SAVED are cached, and the
recompute in backward takes them from the cache instead of running those ops again, so only the
cheap, memory-bound ops run twice. It is the policy torchtitan's selective AC applies per op
(matmuls and attention saved), minus its every-other-matmul rule. With `train.compile`, Dynamo
traces the checkpoint, policy included, as a higher-order op, so the recompute is compiled too.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's choice per op: keep SAVED's outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op.name() in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def enable(model: nn.Module, mode: str) -> None:
    """Apply `mode` (one of MODES) to a freshly built transformers model."""
    if mode not in MODES:
        raise ValueError(f"model.gradient_checkpointing: expected one of {', '.join(MODES)} here, got {mode!r}")
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        # a functools.partial of this function, as Dynamo requires of a checkpoint's context_fn
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
