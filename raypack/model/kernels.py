"""Faster kernels and lighter memory for the same math, exact or refused: regional torch.compile,
Liger-Kernel, and for long rows a tiled MLP and checkpoints offloaded to the host.

`train.compile`: every decoder layer's forward is compiled with torch.compile (regional
compilation, `nn.Module.compile`): one layer's graph is compiled once and reused by every layer
of its class through Inductor's cache, so compile time stays in seconds, and `dynamic=True` makes
the row length (different every step for packed rows) and `max_length` symbolic from the first
call, so a new length does not recompile. A few variants do compile once each, early: the
no-grad setup probe, training mode, and a one-token row (an empty pack: Dynamo specializes sizes
0 and 1). A layer compiles whole, attention included (each backend is one op in the graph:
raypack's exact path is `raypack::exact_varlen`, exact.py), and under gradient checkpointing
Dynamo traces the checkpoint as a higher-order op, so the recompute is compiled with the rest.
`check_compiled` runs one training forward and backward at setup and refuses a model whose
layers break the graph (a broken checkpointed layer would run eagerly, forward and recompute).
Inductor fuses the memory-bound elementwise work (norms, RoPE, the MLP's activation, the
residual adds), so with compile `model.kernels: auto` leaves Liger off (KERNELS_COMPILED), and
`liger` puts Liger's kernels in the graphs as opaque ops (liger_graph.py).
A module whose class the `kernels` package decorated for hub kernel functions (transformers 5.25
installs it: Llama's attention, for RoPE) sets a context variable on every call to route those
functions to the instance's private copies (`_kernel_funcs`), a side effect Dynamo won't trace
inside a checkpoint ("HOP: Unsafe side effect"). Where no copy holds a hub kernel (raypack loads
packed models without them: mixer_kernels.HUB_KERNELS_OFF), each copy runs the function's own
code, as the unrouted call does, so the routing is taken off the instance before compiling
(`_unrouted`); where one does, the check refuses, naming the cause.
Refused under ZeRO-3, whose weight gathers run in hooks on every submodule that a compiled layer
would have to trace, and with sequence parallelism, which no test has run compiled.

`model.kernels`: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU/GeGLU (Triton, CUDA only; `pip
install 'raypack[liger]'`), applied to the model instance by Liger's own per-family function.
They compute per token (RoPE from each token's own position_ids), so packed examples stay apart;
`tests/gpu/model/test_kernels.py` (CUDA) and `tests/unit/model/test_liger_interpreted.py` (Triton's
CPU interpreter, `make test-liger`) check packed against each example alone with them on. `liger`
is refused, before Ray starts, without CUDA, without the package, or for a family Liger has no
kernels for; `auto` uses them where all three hold and runs the model's own code elsewhere;
`none` never. Liger's fused linear cross-entropy is `train.loss: liger` (raypack/train/objectives/loss.py).

For long rows (ALST's two memory savers, arXiv 2506.13996), both exact, as they change only where
values live and when they are computed, not the values:
- `model.tiled_mlp_tokens: N`: every decoder layer's MLP runs N tokens at a time, and in training
  each tile is recomputed in backward (a checkpoint per tile), so the MLP's [tokens, intermediate]
  activations (the largest of a layer: 8 bytes x intermediate size a token in bf16) exist for one
  tile at a time, also while gradient checkpointing recomputes the layer. The MLP works per token,
  MoE routing included (the router loss joins each router's tiles back: routers.per_layer); an MLP
  that returns more than its hidden states (GPT-OSS's router scores) is refused.
- `model.offload_checkpoints`: with gradient checkpointing, what autograd saves for backward, the
  layers' input hidden states, goes to pinned host memory during the forward and comes back for
  the backward (`torch.autograd.graph.save_on_cpu`): 2 bytes x hidden x layers a token leave the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raypack.errors import InputError
from raypack.model import attention
from raypack.model.traits import UnsupportedModelError, decoder

KERNELS = ("auto", "liger", "none")
LIGER_PATCHES = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, layer_norm=True,
                     cross_entropy=False, fused_linear_cross_entropy=False)  # fmt: skip
"""What raypack asks of Liger's per-family function: the layers' kernels, never its loss (that is
train.loss: liger, on the hidden states raypack selects) nor a patched forward of the whole model."""


MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
"""What transformers' decoder layers call their MLP (or MoE block)."""


LAYER_LISTS = ("layers", "h", "layer", "blocks")
"""What transformers' text models call their list of decoder layers (GPT-2: h; BERT: encoder.layer)."""


def decoder_layers(model: nn.Module, option: str) -> nn.ModuleList:
    """The text decoder's layers (the first layer list found under it), which `option`, the
    setting that needs them, works on."""
    for name, module in decoder(model).named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and name.rsplit(".", 1)[-1] in LAYER_LISTS:
            return module
    raise InputError(f"{option}: {type(model).__name__} has no list of decoder layers ({', '.join(LAYER_LISTS)}) "
                     "to apply it to; turn it off")


def compile_layers(model: nn.Module) -> int:
    """torch.compile each decoder layer in place (see the module doc); returns how many."""
    layers = decoder_layers(model, "train.compile")
    attention.prepare_compile()
    _unrouted(layers)
    _liger_into_graphs(layers)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def _routed(module: nn.Module) -> bool | None:
    """None: `module` routes no hub kernel functions (see the module doc); False: it routes them,
    to private copies that all run the functions' own code; True: a copy holds a hub kernel."""
    copies = module.__dict__.get("_kernel_funcs")
    if not isinstance(copies, dict):
        return None
    return any("forward" in vars(copy) for copy in copies.values())  # a hub kernel's forward set on the copy


def _routing_wrapped(module: nn.Module):
    """The forward that `module`'s class forward routes kernel functions around, or None where that
    class forward is not the router: it wraps the function (`__wrapped__`) and closes over it and
    over the functions `_kernel_funcs` names (a subclass's own forward would not)."""
    forward = type(module).forward
    inner = getattr(forward, "__wrapped__", None)
    cells = [cell.cell_contents for cell in (getattr(forward, "__closure__", None) or ())]
    named = {getattr(f, "__name__", None) or getattr(f, "kernel_layer_name", None)
             for cell in cells if isinstance(cell, tuple) for f in cell}  # fmt: skip
    if inner is None or not any(cell is inner for cell in cells) or not set(module._kernel_funcs) <= named:
        return None
    return inner


def _unrouted(layers: nn.Module) -> int:
    """Take the kernel-function routing off every module under `layers` whose private copies all
    run the functions' own code: the instance's forward becomes the one the router wraps. Returns
    how many."""
    done = 0
    for module in layers.modules():
        if _routed(module) is False and "forward" not in module.__dict__:
            if (inner := _routing_wrapped(module)) is not None:
                module.forward = inner.__get__(module)
                done += 1
    return done


def check_compiled(model: nn.Module, batch: dict) -> int:
    """One training forward and backward of `batch` (a tiny packed batch on the model's device)
    through the compiled layers, in train mode, under the model's own checkpointing: what the
    first step runs. Refuses (UnsupportedModelError), before any step, a model whose layers don't
    run compiled: a graph break inside a checkpointed layer makes Dynamo run the whole checkpoint
    eagerly, so the layer would not be compiled at all, forward or recompute; and a layer that runs
    eagerly with no graph break at all (Dynamo disabled: TORCHDYNAMO_DISABLE, a `force_eager`
    stance; its recompile limit reached; layers never compiled) compiles nothing and would pass a
    check of breaks alone. The gradient is taken for the input embeddings only: no parameter's
    gradient is written, so DeepSpeed's gradient hooks never fire. Returns the graphs compiled so far."""
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    was_training = model.training
    model.train()
    try:
        with eager_layers(model) as eager:
            embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
            out = model(**{k: v for k, v in batch.items() if k not in ("input_ids", "labels")}, inputs_embeds=embeds)
            torch.autograd.grad(out.logits.float().sum(), embeds)
    finally:
        model.train(was_training)
    breaks = {why: n - before.get(why, 0) for why, n in counters["graph_break"].items() if n > before.get(why, 0)}
    if breaks:
        reasons = "; ".join(why.strip().splitlines()[0][:200] for why in breaks)
        hub = sorted({type(m).__name__ for m in decoder_layers(model, "train.compile").modules() if _routed(m)})
        cause = (f"; {', '.join(hub)} call hub kernels, routed through a context variable set on every call, which "
                 "Dynamo won't trace inside a checkpoint: set USE_HUB_KERNELS=NO in the environment, or"
                 if hub else "; ")  # fmt: skip
        raise UnsupportedModelError(
            f"train.compile: {type(model).__name__}'s decoder layers don't compile whole, so a compiled layer would "
            f"run eagerly where it breaks, and a checkpointed one entirely (Dynamo's graph breaks: {reasons}){cause} "
            "set train.compile: false"
        )
    if eager:
        layers = len(decoder_layers(model, "train.compile"))
        raise UnsupportedModelError(
            f"train.compile: {len(set(eager))} of {layers} decoder layers of {type(model).__name__} ran eagerly in a "
            "training forward, with no graph break: torch.compile ran none of their code (Dynamo disabled by "
            "TORCHDYNAMO_DISABLE or a force_eager stance, its recompile limit reached, or the layers not compiled); "
            "set train.compile: false or find what turned it off"
        )
    return compiled_graphs()


@contextlib.contextmanager
def eager_layers(model: nn.Module):
    """Yields a list that collects the index of every decoder layer of `model` that runs outside
    torch.compile while the block runs (once per call: a checkpointed layer run eagerly counts its
    recompute too). A forward pre-hook on each layer asks `torch.compiler.is_compiling()`: Dynamo
    traces the hook with it a constant True, so a compiled layer's graph holds no trace of it and
    records nothing, while a layer run eagerly calls it for real. Hooks are not among Dynamo's
    guards (`skip_nnmodule_hook_guards`), so adding and removing them recompiles nothing."""
    layers = decoder_layers(model, "train.compile")
    ran: list[int] = []

    def hook(index: int):
        def note(module, args) -> None:
            if not torch.compiler.is_compiling():
                ran.append(index)

        return note

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield ran
    finally:
        for handle in handles:
            handle.remove()


def _liger_into_graphs(layers: nn.Module) -> None:
    """With model.kernels: liger, Liger's calls in the layers become opaque ops in their graphs
    (raypack/model/liger_graph.py): Dynamo never traces into Liger's Functions and Triton launches."""
    modules = {sys.modules[type(module).__module__] for module in layers.modules()}
    if any(m._get_name().startswith("Liger") for m in layers.modules()) or any(
            (getattr(fn, "__module__", "") or "").startswith("liger_kernel") for src in modules for fn in vars(src).values()):
        from raypack.model.liger_graph import make_opaque

        make_opaque(modules)


def tile_mlps(model: nn.Module, tokens: int) -> int:
    """Run every decoder layer's MLP `tokens` tokens at a time (see the module doc); returns how many."""
    count = 0
    for layer in decoder_layers(model, "model.tiled_mlp_tokens"):
        mlp = next((getattr(layer, n) for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
        if mlp is None:
            raise InputError(f"model.tiled_mlp_tokens: {type(layer).__name__} has no MLP under a name raypack knows "
                             f"({', '.join(MLP_NAMES)}); set it to 0")
        # An instance attribute: the module's hooks (ZeRO-3's gathers) still run once around all tiles.
        mlp.forward = _tiled(mlp.forward, tokens, type(mlp).__name__)
        count += 1
    return count


def _tiled(forward, tokens: int, name: str):
    def tiled(hidden: torch.Tensor, *args, **kwargs):
        if args or kwargs:
            return forward(hidden, *args, **kwargs)
        shape = hidden.shape
        if hidden.dim() == 3 and shape[0] > 1 and shape[1] > tokens:
            # a padded batch's rows as one sequence of tokens, tiled in that order: an MoE block's
            # router then scores the tokens in the order it would have, row by row (routers.per_layer)
            hidden = hidden.reshape(1, -1, shape[-1])
        recompute = torch.is_grad_enabled() and hidden.shape[-2] > tokens
        outs = [checkpoint(forward, tile, use_reentrant=False) if recompute else forward(tile)
                for tile in hidden.split(tokens, dim=-2)]
        # Checked on every call, short ones too: the loss's setup probe then refuses it before any step.
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise UnsupportedModelError(f"model.tiled_mlp_tokens: {name} returns more than its hidden states (router "
                                        "scores), which tiles can't be joined back into; set it to 0")
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2).reshape(*shape[:-1], -1)

    return tiled


def checkpoint_offload(enabled: bool, device: torch.device):
    """The context the training forward runs in: what autograd saves goes to the host when `enabled`
    (model.offload_checkpoints), pinned on CUDA so the copies overlap compute."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.device(device).type == "cuda")


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_families() -> frozenset[str]:
    """The `model_type`s Liger has kernels for (its own table; empty when it is not installed)."""
    if not liger_installed():
        return frozenset()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


KERNELS_COMPILED = "none"
"""What `model.kernels: auto` applies under `train.compile`: `none`, so Inductor fuses the
elementwise work (norms, RoPE, SwiGLU) that Liger's kernels would do, inside each layer's graph,
recompute included. The other way is `liger`: Liger's kernels as opaque ops in the same graphs
(liger_graph.py), whose backward reruns Liger's forward kernel. The one place auto's choice with
compile lives; not measured yet: benchmarks/recompute.py's `compiled` and `compiled-liger` rows at
one recompute mode, on a GPU, decide it."""


SHARED_EXPERTS = ("shared_experts", "shared_expert")


def liger_unverified(model: nn.Module) -> str | None:
    """Where Liger's kernels gave wrong results on a GPU and no fix has passed there yet, found by
    the model's structure, not its name: an MoE block whose routed experts (which Liger swaps for its
    fused MoE) sit beside shared experts. On an H100 (2026-11-27) DeepSeek-V2 and -V3, which have
    them, failed the packed-against-alone check with Liger on, while Mixtral and Qwen3-MoE, routed
    experts alone, passed; the CPU interpreter can't run Liger's MoE kernel to say more. None when
    nothing such is found."""
    for name, module in model.named_modules():
        shared = next((n for n in SHARED_EXPERTS if isinstance(getattr(module, n, None), nn.Module)), None)
        if shared and isinstance(getattr(module, "experts", None), nn.Module):
            return f"{name} ({type(module).__name__}) has routed experts beside {shared}"
    return None


def resolve_kernels(kernels: str, model_type: str, device_type: str, model: nn.Module | None = None,
                    compiled: bool = False) -> str:
    """`liger` or `none` for `model.kernels` on this model and device, with `train.compile` or
    without; `liger` asked for where it can't run is an InputError naming why. `model` (on any
    device, the meta one included): checked for the structure Liger is not verified on
    (`liger_unverified`)."""
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels: expected one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "none" or (kernels == "auto" and compiled):
        return "none" if kernels == "none" else KERNELS_COMPILED
    why = ("Liger-Kernel is Triton on CUDA: set train.use_gpu" if device_type != "cuda"
           else "the liger-kernel package is not installed (pip install 'raypack[liger]')" if not liger_installed()
           else f"Liger-Kernel has no kernels for model_type {model_type!r}" if model_type not in liger_families()
           else None)
    if why is None and model is not None and (unverified := liger_unverified(model)):
        why = (f"Liger-Kernel's kernels failed the packed-against-alone check on a GPU for a model like this one "
               f"({unverified}; tests/gpu/model/test_kernels.py)")
    if why is None:
        return "liger"
    if kernels == "liger":
        raise InputError(f"model.kernels=liger: {why}; set model.kernels: auto (the model's own code where Liger "
                         "can't run) or none")
    return "none"


def check_selective_with(kernels: str, compiled: bool, checkpointing: str) -> bool:
    """Whether `selective` gradient checkpointing may run with the resolved `kernels`: not with
    Liger's uncompiled, whose RoPE rotates q and k in place inside the projections' outputs that
    selective keeps (compiled, Liger's calls run on copies: liger_graph.py). Configured
    `selective` there is an InputError; False tells `auto` to leave it out."""
    allowed = not (kernels == "liger" and not compiled)
    if not allowed and checkpointing == "selective":
        raise InputError("model.gradient_checkpointing=selective with Liger-Kernel's kernels uncompiled: Liger's RoPE "
                         "rotates q and k in place, inside the projections' outputs that selective keeps; set "
                         "train.compile: true, model.kernels: none, or model.gradient_checkpointing: full")
    return allowed


def apply_kernels(model: nn.Module, kernels: str, device_type: str, compiled: bool = False) -> str:
    """Apply `model.kernels` to a loaded model that will train on `device_type`, its layers then
    compiled or not (before adapters wrap it): returns what was applied."""
    chosen = resolve_kernels(kernels, model.config.model_type, device_type, model, compiled)
    if chosen == "liger":
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        try:
            _apply_liger_kernel_to_instance(model, **LIGER_PATCHES)
        except NotImplementedError:
            # Liger lists some families whose RoPE it has no kernel for (GLM-4, Qwen3.5 in 0.8.5): it
            # raises on rope=True before patching anything, so the rest still applies, with the
            # model's own RoPE.
            try:
                _apply_liger_kernel_to_instance(model, **{**LIGER_PATCHES, "rope": False})
            except NotImplementedError as e:
                raise UnsupportedModelError(f"model.kernels: Liger-Kernel refuses {model.config.model_type}: {e}; "
                                            "set model.kernels: none") from e
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

