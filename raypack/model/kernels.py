"""Faster kernels for the same math, exact or refused: regional torch.compile and Liger-Kernel.

`train.compile`: every decoder layer's forward is compiled with torch.compile (regional
compilation, `nn.Module.compile`): one layer's graph is compiled once and reused by every layer
of its class through Inductor's cache, so compile time stays in seconds, and `dynamic=True` makes
the row length (different every step for packed rows) and `max_length` symbolic from the first
call, so a new length does not recompile. raypack's attention function stays out of the graphs
(`torch.compiler.disable` in attention.py): it reads cu_seqlens on the host and the exact CPU path
loops over examples, which Dynamo would unroll once per example count. What gets compiled is the
rest of each layer, the memory-bound elementwise work (norms, RoPE, the MLP's activation, the
residual adds) that Inductor fuses. Refused under ZeRO-3, whose weight gathers run in hooks on
every submodule that a compiled layer would have to trace, and with sequence parallelism, which
no test has run compiled.

`model.kernels`: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU/GeGLU (Triton, CUDA only; `pip
install 'raypack[liger]'`), applied to the model instance by Liger's own per-family function.
They compute per token (RoPE from each token's own position_ids), so packed examples stay apart;
`tests/gpu/model/test_kernels.py` checks packed against each example alone with them on. `liger`
is refused, before Ray starts, without CUDA, without the package, or for a family Liger has no
kernels for; `auto` uses them where all three hold and runs the model's own code elsewhere;
`none` never. Liger's fused linear cross-entropy is `train.loss: liger` (raypack/train/loss.py).
"""

from __future__ import annotations

import importlib.util

from torch import nn

from raypack.errors import InputError
from raypack.model.traits import decoder

KERNELS = ("auto", "liger", "none")
LIGER_PATCHES = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, layer_norm=True,
                     cross_entropy=False, fused_linear_cross_entropy=False)  # fmt: skip
"""What raypack asks of Liger's per-family function: the layers' kernels, never its loss (that is
train.loss: liger, on the hidden states raypack selects) nor a patched forward of the whole model."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers: what regional compilation compiles."""
    layers = getattr(decoder(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise InputError(f"train.compile: {type(model).__name__} has no decoder `layers` to compile one by one; "
                         "set train.compile: false")
    return layers


def compile_layers(model: nn.Module) -> int:
    """torch.compile each decoder layer in place (see the module doc); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_families() -> frozenset[str]:
    """The `model_type`s Liger has kernels for (its own table; empty when it is not installed)."""
    if not liger_installed():
        return frozenset()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def resolve_kernels(kernels: str, model_type: str, device_type: str) -> str:
    """`liger` or `none` for `model.kernels` on this model and device; `liger` asked for where it
    can't run is an InputError naming why."""
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels: expected one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "none":
        return "none"
    why = ("Liger-Kernel is Triton on CUDA: set train.use_gpu" if device_type != "cuda"
           else "the liger-kernel package is not installed (pip install 'raypack[liger]')" if not liger_installed()
           else f"Liger-Kernel has no kernels for model_type {model_type!r}" if model_type not in liger_families()
           else None)
    if why is None:
        return "liger"
    if kernels == "liger":
        raise InputError(f"model.kernels=liger: {why}; set model.kernels: auto (the model's own code where Liger "
                         "can't run) or none")
    return "none"


def apply_kernels(model: nn.Module, kernels: str, device_type: str) -> str:
    """Apply `model.kernels` to a loaded model that will train on `device_type` (before adapters
    wrap it): returns what was applied."""
    chosen = resolve_kernels(kernels, model.config.model_type, device_type)
    if chosen == "liger":
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model, **LIGER_PATCHES)
    return chosen


def liger_loss_available(device_type: str) -> None:
    """InputError unless train.loss: liger can run here."""
    if device_type != "cuda":
        raise InputError("train.loss=liger: Liger-Kernel's fused linear cross-entropy is Triton on CUDA; set "
                         "train.use_gpu, or train.loss: chunked")
    if not liger_installed():
        raise InputError("train.loss=liger: the liger-kernel package is not installed (pip install "
                         "'raypack[liger]'); or train.loss: chunked")


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far: what the benchmark counts recompiles by."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

