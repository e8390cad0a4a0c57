"""A mixture-of-experts model's routers: which modules score the experts, what kind of router each
is, and their scores captured during a forward (the training loop's router loss reads them:
raypack/train/objectives/router_loss.py).

    routers = find_routers(model, name)        # once at setup; None for a dense model
    with routers.capture() as calls:            # hooks record only inside the block
        loss_sum = loss(engine, batch)
    calls[0].logits, calls[0].selected          # [tokens, experts], [tokens, top_k] per router call

How a router is found, in order:
1. The model says which module records its `router_logits` (transformers' `_can_record_outputs`,
   what `output_router_logits=True` returns): those modules, at that output index. Every MoE
   family transformers 5.24 ships declares one (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, PhiMoE,
   GPT-OSS, Llama 4, DeepSeek-V2/V3, GLM-4.5, ERNIE 4.5, MiniMax-M2, ...). The hooks are raypack's
   own, on those modules: the forward need not return the logits, and the chunked loss (which
   never reads the model's output) still sees them.
2. Otherwise, by trait, from one probe forward (remote-code models): a module whose output holds
   a [tokens, E] tensor from which, in the autograd graph, the input of a `topk` (or a `max`
   along a dimension, PhiMoE's sparsemixer) over E scores derives: a module that scores E
   experts and feeds a top-k. No name is read.

Kind. A router that keeps a per-expert score-correction buffer (a [E] tensor it adds to its
scores to choose, trained by no gradient: the bias-corrected top-k of DeepSeek-V3 and GLM-4.5,
which score with a sigmoid) is `sigmoid`; its loss is DeepSeek-V3's sequence-wise balance loss. Any other
is `softmax`: transformers' `load_balancing_loss_func` (Switch Transformer), as transformers applies
it to the router logits it returns. `selected` is the router's own choice where it returns one (an
integer [tokens, top_k] output: the bias-corrected, group-limited top-k), else the top-k of its
logits.

Hooks record only while a `capture()` block is open: gradient checkpointing's recompute in
backward runs the routers again, and those calls must not count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from raypack.model.facts import describe, expert_count  # noqa: F401 (expert_count: its old home)
from raypack.model.traits import UnsupportedModelError


class RouterNotFoundError(UnsupportedModelError):
    """An MoE model with a router loss asked for, whose routers raypack can't find."""


@dataclass
class RouterCall:
    """One router's scores for one forward's tokens."""

    logits: torch.Tensor
    """[tokens, experts], as the router computed them (grad attached)."""
    selected: torch.Tensor
    """[tokens, top_k] int64: the experts each token was sent to."""
    layer: int = 0
    """Which router (its index in `Routers.modules`)."""


@dataclass
class Routers:
    """The routers of one model, hooked (see the module docstring)."""

    modules: list[nn.Module]
    """In forward order: one per MoE layer."""
    kind: str
    """`softmax` or `sigmoid` (bias-corrected top-k)."""
    num_experts: int
    top_k: int
    index: int = 0
    """Which element of a router's tuple output holds its logits."""
    how: str = "declared"
    """`declared` (the model's router_logits recorder) or `trait` (found by a probe)."""
    _calls: list[RouterCall] | None = field(default=None, repr=False)
    _handles: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._layer = {id(module): i for i, module in enumerate(self.modules)}
        for module in self.modules:
            self._handles.append(module.register_forward_hook(self._record))

    @property
    def layers(self) -> int:
        return len(self.modules)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls is None:
            return
        outs = output if isinstance(output, (tuple, list)) else (output,)
        logits = outs[self.index]
        logits = logits.reshape(-1, logits.shape[-1])
        chosen = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point() and o.dim() >= 1
                  and o.shape[-1] == self.top_k and o.numel() == logits.shape[0] * self.top_k]
        selected = chosen[0].reshape(-1, self.top_k).long() if chosen else logits.detach().topk(self.top_k, -1).indices
        self._calls.append(RouterCall(logits, selected, self._layer[id(module)]))

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[RouterCall]]:
        """The router calls of the forward run inside the block, in order."""
        calls: list[RouterCall] = []
        self._calls = calls
        try:
            yield calls
        finally:
            self._calls = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No capture inside the block (a forward whose routers are not the loss's: DPO's reference)."""
        calls, self._calls = self._calls, None
        try:
            yield
        finally:
            self._calls = calls

    def per_layer(self, calls: list[RouterCall]) -> list[RouterCall]:
        """One call per router that ran, in layer order: a router called on its tokens in pieces
        (model.tiled_mlp_tokens runs the MoE block a tile at a time) has its pieces joined, in
        the order they ran, which is the tokens' order (kernels._tiled)."""
        pieces: dict[int, list[RouterCall]] = {}
        for call in calls:
            pieces.setdefault(call.layer, []).append(call)
        return [parts[0] if len(parts) == 1 else
                RouterCall(torch.cat([c.logits for c in parts]), torch.cat([c.selected for c in parts]), layer)
                for layer, parts in sorted(pieces.items())]  # fmt: skip

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def describe(self) -> str:
        formula = ("DeepSeek-V3's sequence-wise balance loss" if self.kind == "sigmoid"
                   else "the Switch load-balancing loss (transformers' load_balancing_loss_func)")
        return (f"{self.layers} routers ({type(self.modules[0]).__name__}, {self.how}), {self.num_experts} experts, "
                f"top {self.top_k}; {formula}")


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def declared(model: nn.Module) -> tuple[type, int] | None:
    """(router class, output index) from the model's own `router_logits` recorder, if it has one."""
    for module in _base(model).modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder.target_class, int(recorder.index or 0)
    return None


def find_routers(model: nn.Module, name: str, probe: dict[str, Any] | None = None) -> Routers | None:
    """The model's routers, hooked; None for a dense model (no expert count in its config and no
    router found). An MoE model whose routers are not found raises RouterNotFoundError naming it.
    `probe`: model kwargs of a small batch for the trait search (only run when the model declares
    no router recorder)."""
    config = getattr(_base(model), "config", None)
    experts = describe(config).experts
    found = declared(model)
    modules: list[nn.Module] = []
    how, index = "declared", 0
    if found is not None:
        cls, index = found
        modules = [m for m in model.modules() if isinstance(m, cls)]
        if not modules:
            # The model names its router and builds none: its layers are all dense, whatever expert
            # settings its config carries (a hybrid whose layer pattern has no MoE layer).
            return None
    elif experts and probe is not None:
        modules, index = by_trait(model, probe, experts)
        how = "trait"
    if not modules:
        if not experts:
            return None
        raise RouterNotFoundError(
            f"model.name {name!r}: a mixture-of-experts model ({experts} experts), but raypack finds no router in it "
            "(no router_logits recorder, and no module that scores the experts and feeds a top-k); set "
            "train.router_aux_loss_coef: 0 to train it without the router's load-balancing loss")
    # peft's LoRA on a parameter (ParamWrapper, what `all-linear` puts on a router's weight) swaps the
    # weight while the router runs, so the hooked router's scores include the adapter; a LoRA layer
    # that adds its output to the base layer's (lora.Linear) would leave it out of them.
    wrapped = [m for m in model.modules() if getattr(m, "base_layer", None) in modules and not _swaps_weight(m)]
    if wrapped:
        raise RouterNotFoundError(
            f"model.name {name!r}: model.peft puts an adapter on its router ({type(wrapped[0]).__name__}), and "
            "raypack reads the router's scores below the adapter; leave the router out of model.peft.target_modules "
            "or set train.router_aux_loss_coef: 0")
    top_k = _top_k(config, modules[0])
    if not top_k:
        raise RouterNotFoundError(f"model.name {name!r}: its config names no num_experts_per_tok, so raypack can't "
                                  "tell its router's top-k; set train.router_aux_loss_coef: 0")
    num_experts = experts or _out_features(modules[0])
    return Routers(modules, router_kind(modules[0], num_experts), num_experts, top_k, index, how)


def builds_routers(model: nn.Module) -> bool:
    """Whether `model` holds a router: an instance of the router class it declares, or, where it
    declares none, an expert count in its config (the trait search then finds the modules)."""
    found = declared(model)
    if found is not None:
        return any(isinstance(m, found[0]) for m in _base(model).modules())
    config = getattr(_base(model), "config", None)
    return bool(describe(config).experts)


def _swaps_weight(wrapper: nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return False
    return isinstance(wrapper, ParamWrapper)


def _top_k(config: Any, module: nn.Module) -> int:
    value = getattr(module, "top_k", None)
    return describe(config).top_k or (value if isinstance(value, int) and value > 0 else 0)


def _out_features(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0


def router_kind(module: nn.Module, num_experts: int) -> str:
    """`sigmoid` for a router with a score-correction buffer ([E], no gradient: the bias-corrected
    top-k DeepSeek-V3 introduced), else `softmax`."""
    own_params = {id(p) for p in module.parameters(recurse=False)}
    for buffer in module.buffers(recurse=False):
        if buffer.is_floating_point() and tuple(buffer.shape) == (num_experts,) and id(buffer) not in own_params:
            return "sigmoid"
    return "softmax"


# --- the trait search -----------------------------------------------------------------------------


_CHOOSERS = (torch.topk, torch.Tensor.topk, torch.max, torch.Tensor.max, torch.argmax, torch.Tensor.argmax)
"""Ops that pick experts: a top-k, or a max along the experts taken k times (PhiMoE's sparsemixer)."""


class _TopKs(TorchFunctionMode):
    """Records the input of every top-k (or max along a dimension) the forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        along = func in (torch.topk, torch.Tensor.topk) or len(args) > 1 or "dim" in kwargs
        if func in _CHOOSERS and args and isinstance(args[0], torch.Tensor) and along:
            self.inputs.append(args[0])
        return func(*args, **kwargs)


def _ancestors(tensor: torch.Tensor, depth: int = 12) -> set[Any]:
    """The autograd nodes within `depth` steps above `tensor`."""
    seen: set[Any] = set()
    frontier = [tensor.grad_fn] if tensor.grad_fn is not None else []
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node is None or node in seen:
                continue
            seen.add(node)
            nxt.extend(parent for parent, _ in node.next_functions if parent is not None)
        frontier = nxt
    return seen


def by_trait(model: nn.Module, probe: dict[str, Any], experts: int) -> tuple[list[nn.Module], int]:
    """Modules that score `experts` experts and feed a top-k (see the module docstring), and the
    output index of their scores; ([], 0) if none."""
    outputs: list[tuple[nn.Module, int, torch.Tensor]] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for i, out in enumerate(outs):
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape[-1] == experts and out.grad_fn:
                outputs.append((module, i, out))

    def grads_from_here(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.detach().requires_grad_() if output.is_floating_point() else output

    handles = [m.register_forward_hook(keep) for m in model.modules()]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None:  # a frozen model (LoRA) still builds the graph the search reads
        handles.insert(0, embed.register_forward_hook(grads_from_here))
    topks = _TopKs()
    try:
        with torch.enable_grad(), topks:
            model(**probe)
    finally:
        for handle in handles:
            handle.remove()
    fed = set()
    for tensor in topks.inputs:
        if tensor.shape[-1] == experts:
            fed |= _ancestors(tensor)
    hits = [(m, i, out) for m, i, out in outputs if out.grad_fn in fed]
    # The scores, not what is made of them: a hit computed from the hit of a module nested with
    # it (ERNIE 4.5's router adds a correction to its softmax in a submodule and takes the top-k
    # of that) is not the router. (A later layer's scores derive from an earlier one's too, through
    # the residual stream: those modules are not nested.)
    def nested(a: nn.Module, b: nn.Module) -> bool:
        return a is not b and (any(x is b for x in a.modules()) or any(x is a for x in b.modules()))

    hits = [(m, i, out) for m, i, out in hits
            if not any(nested(m, m2) and out2.grad_fn is not out.grad_fn and out2.grad_fn in _ancestors(out)
                       for m2, _, out2 in hits)]
    if not hits:
        return [], 0
    # The innermost module that returns the scores (a Linear gate inside a router block returns the same tensor).
    inner: dict[int, tuple[nn.Module, int]] = {}
    for module, i, out in hits:
        key = id(out.grad_fn)
        if key not in inner or any(sub is module for sub in inner[key][0].modules()):
            inner[key] = (module, i)
    modules, indices = [], set()
    for module, i in inner.values():
        if module not in modules:
            modules.append(module)
            indices.add(i)
    if len(indices) != 1:
        return [], 0
    return modules, indices.pop()
