"""Token mixers other than attention, kept exact on packed rows: short convolutions, the gated
delta rule, Mamba-2 and KDA (the hybrid layers of Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Bamba,
Kimi-Linear, ...).

A convolution over the sequence or a recurrence sees the whole packed row. Exact means what it
means for attention: every example sees what it would see alone.

    row          [a0 a1 a2 a3 | b0 b1 b2]        cu_seq_lens [0, 4, 7]
    convolution   0 0 0 a0..a3  0 0 0 b0..b2      b0 sees zeros on its left, not a1..a3
    recurrence    S=0 -> a0..a3 S=0 -> b0..b2     no state flows from a into b

Boundaries are the `cu_seq_lens_q` collate computes once per batch (raypack/data/collate.py),
which transformers' decoder layers pass to the mixer with the rest of the forward's keyword
arguments, as they do to attention. Two paths, one answer:

    torch    the layer's own forward, with no cache, over the row's examples as right-padded
             batches (one example a row): transformers' unpacked computation itself (its torch
             fallbacks, or the kernels) on each example. Any device. The examples, sorted by
             length, are cut into `BUCKETS` batches each padded to its own longest, the cuts
             chosen for the fewest padded slots (raypack/model/mixer_buckets.py), so the mixer
             runs about the row's tokens, not examples x longest. The boundaries are read once
             per batch, from the host copy collate kept where the step kept one (raypack's loop
             does: no device read), and the layer is called `BUCKETS` times whatever the
             examples, as ZeRO-3's weight gathering needs.
    kernels  CUDA, with the packages below installed: the whole row in one call, the layer told
             the boundaries the way its kernels take them. transformers already hands
             `cu_seqlens` to flash-linear-attention's gated delta rule; raypack adds `seq_idx`
             (each token's example), which causal-conv1d's convolution and mamba-ssm's chunked
             scan take, and which transformers forwards to them, and for KDA `cu_seqlens`
             (`MixerKind.varlen`), which its layer doesn't derive. Built on the device, no read.

A kernel that does not name the keyword carrying the boundaries would lose them silently
(raypack/model/mixer_kernels.py): the kernels path is taken only where every function the layer
calls names it, else the exact torch path, said on the start line.

Adapters: a Mamba-2 layer's fused training kernel (mamba-ssm's
`mamba_split_conv1d_scan_combined`) reads `out_proj.weight` itself, so a LoRA layer there would
never run; such a layer is kept off the fused kernel (`keep_unfused`), onto the one its eval
forward takes: the convolution and the scan, then `out_proj` called as a module. Every path reads
the convolution's weight directly (`MixerKind.by_weight`): an adapter there is refused.

A module is a known mixer by its structure (`KINDS`): what parameters and submodules it holds,
and that its forward takes (hidden_states, cache, attention_mask, **kwargs), the convention
every one of them shares in transformers 5. Anything else that mixes tokens stays refused
(traits.token_mixers).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raypack.errors import UnsupportedModelError
from raypack.model import mixer_buckets, ulysses
from raypack.model.mixer_kernels import CONV, HUB_KERNELS_OFF, KernelCall, problem, swapped  # noqa: F401 (build's)
from raypack.model.exact import LastCache, host_copy

PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""What a packed row adds to the forward's keyword arguments: the torch path runs each example
as if unpacked, so none of them reaches the layer there."""


def _depthwise(conv) -> bool:
    conv = getattr(conv, "base_layer", conv)  # one peft has wrapped (an adapter, refused: read_by_weight)
    return isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels


def _param(module: nn.Module, name: str, ndim: int) -> bool:
    p = module._parameters.get(name)
    return p is not None and p.ndim == ndim


def _takes_row(module: nn.Module) -> bool:
    """forward(hidden_states, cache, attention_mask, **kwargs): what the decoder layers of every
    hybrid family in transformers 5 call their mixer with."""
    params = inspect.signature(type(module).forward).parameters
    return ({"hidden_states", "attention_mask"} <= set(params) and ("cache" in params or "cache_params" in params)
            and any(p.kind is p.VAR_KEYWORD for p in params.values()))  # fmt: skip


def _gated_delta(m: nn.Module) -> bool:
    """The gated delta rule (Qwen3.5, Qwen3-Next): a depthwise convolution over q, k, v, then a
    per-head decay (A_log, dt_bias) and learning rate; no skip parameter D."""
    return (_depthwise(getattr(m, "conv1d", None)) and _param(m, "A_log", 1) and _param(m, "dt_bias", 1)
            and "D" not in m._parameters and hasattr(m, "head_k_dim"))  # fmt: skip


def _mamba2(m: nn.Module) -> bool:
    """Mamba-2 (Nemotron-H, Bamba, Granite 4, ...): depthwise convolution, scalar decay per head
    (A_log of one dimension), skip D, grouped B/C of ssm_state_size."""
    return (_depthwise(getattr(m, "conv1d", None)) and _param(m, "A_log", 1) and _param(m, "D", 1)
            and _param(m, "dt_bias", 1) and hasattr(m, "n_groups") and hasattr(m, "ssm_state_size"))  # fmt: skip


def _kda(m: nn.Module) -> bool:
    """Kimi Delta Attention (Kimi-Linear, Bailing's hybrid): a depthwise convolution over q, k, v,
    then a delta rule whose decay is per channel, from a forget gate holding A_log and dt_bias,
    with a learning rate from b_proj."""
    gate = getattr(m, "forget_gate", None)
    return (_depthwise(getattr(m, "conv1d", None)) and isinstance(gate, nn.Module)
            and {"A_log", "dt_bias"} <= set(gate._parameters) and _linear(getattr(m, "b_proj", None))
            and "A_log" not in m._parameters)  # fmt: skip


def _linear(m) -> bool:
    """A linear layer, or one peft has wrapped (an adapter around its `base_layer`)."""
    return isinstance(m, nn.Linear) or isinstance(getattr(m, "base_layer", None), nn.Linear)


def _short_conv(m: nn.Module) -> bool:
    """LFM2's gated short convolution: in_proj to B, C, x; a depthwise convolution of B*x; C gates."""
    return (_depthwise(getattr(m, "conv", None)) and _linear(getattr(m, "in_proj", None))
            and _linear(getattr(m, "out_proj", None)) and not any(m.parameters(recurse=False)))  # fmt: skip


@dataclass(frozen=True)
class MixerKind:
    name: str
    """What it is, in messages and the start line."""
    matches: Callable[[nn.Module], bool]
    """Its structure."""
    packages: tuple[str, ...]
    """Import names whose kernels transformers' layer calls on CUDA, all needed for the kernels path."""
    kernels: str
    """Those kernels, as the start line and the docs name them."""
    fused: tuple[str, ...] = ()
    """Linear submodules whose weight a fused CUDA kernel reads directly, never calling their
    forward: an adapter there would be skipped, so LoRA's `all-linear` leaves them out, and a layer
    whose target list reaches one is kept off that kernel (`keep_unfused`)."""
    calls: tuple[KernelCall, ...] = ()
    """The kernel functions its packed forward calls (training and eval), each checked for its boundaries."""
    by_weight: tuple[str, ...] = ()
    """Submodules whose weight the layer hands a function itself on every path (the
    convolution's): an adapter there never runs, and is refused."""
    varlen: Callable[[torch.Tensor], dict] | None = None
    """What its kernels take of the boundaries beyond `seq_idx` that transformers' layer doesn't
    derive itself, from cu_seq_lens_q (passed on with the forward's keyword arguments)."""


KINDS: tuple[MixerKind, ...] = (
    MixerKind("gated delta rule", _gated_delta, ("fla", "causal_conv1d"),
              "flash-linear-attention chunk_gated_delta_rule (cu_seqlens) + causal-conv1d (seq_idx)",
              calls=(CONV, KernelCall("chunk_gated_delta_rule", "fla", "ops.gated_delta_rule", "cu_seqlens")),
              by_weight=("conv1d",)),
    MixerKind("Mamba-2", _mamba2, ("mamba_ssm", "causal_conv1d"),
              "mamba-ssm chunked scan (seq_idx) + causal-conv1d (seq_idx)",
              # mamba-ssm's mamba_split_conv1d_scan_combined takes outproj_weight (peft refuses
              # out_proj for Nemotron-H and Falcon-H1 for this reason; the kernel is the same in all)
              fused=("out_proj",),
              calls=(CONV, KernelCall("mamba_split_conv1d_scan_combined", "mamba_ssm", "ops.triton.ssd_combined", "seq_idx"),
                     KernelCall("mamba_chunk_scan_combined", "mamba_ssm", "ops.triton.ssd_combined", "seq_idx")),
              by_weight=("conv1d",)),
    MixerKind("short convolution", _short_conv, ("causal_conv1d",), "causal-conv1d (seq_idx)", calls=(CONV,),
              by_weight=("conv",)),
    # transformers 5.24's Kimi-Linear and Bailing layers hand the forward's keyword arguments to
    # fla's chunk_kda as they come (cu_seq_lens_q, which it doesn't take): raypack adds cu_seqlens
    MixerKind("KDA", _kda, ("fla", "causal_conv1d"),
              "flash-linear-attention chunk_kda (cu_seqlens) + causal-conv1d (seq_idx)", varlen=lambda cu: cu_seqlens(cu),
              calls=(CONV, KernelCall("chunk_kda", "fla", "ops.kda", "cu_seqlens")), by_weight=("conv1d",)),
)  # fmt: skip
"""The mixers raypack keeps exact. To add one: its structure, and a family row in raypack/model/family_table.py."""


def kind_of(module: nn.Module) -> MixerKind | None:
    """The known mixer `module` is, if any."""
    for kind in KINDS:
        if kind.matches(module) and _takes_row(module):
            return kind
    return None


def find(decoder: nn.Module) -> dict[str, MixerKind]:
    """Every known mixer in `decoder` (the text model), by module name."""
    return {name: kind for name, module in decoder.named_modules() if (kind := kind_of(module)) is not None}


_PACKAGES = {name: importlib.util.find_spec(name) is not None for kind in KINDS for name in kind.packages}
"""Looked up once, as transformers resolves its kernels once, at import."""


GPU_ONLY = {"fla": "flash-linear-attention (fla)"}
"""Packages whose kernels transformers binds at import and then calls whatever the device, and
which run only on a GPU (fla's are Triton kernels: on the CPU, "0 active drivers")."""


def gpu_only_installed() -> bool:
    """Whether any GPU_ONLY package imports here (else no model needs `refuse_gpu_only_kernels`)."""
    return any(_PACKAGES[p] for p in GPU_ONLY)


def refuse_gpu_only_kernels(model: nn.Module, name: str, device_type: str) -> None:
    """An UnsupportedModelError for a model whose mixers would call a GPU-only kernel on the CPU:
    transformers' layer takes fla's kernel once fla imports, packed or padded, on any device."""
    if device_type == "cuda" or not gpu_only_installed():
        return
    found = find(model)
    here = sorted({GPU_ONLY[p] for kind in found.values() for p in kind.packages if p in GPU_ONLY and _PACKAGES[p]})
    if here:
        kinds = ", ".join(sorted({kind.name for kind in found.values()}))
        raise UnsupportedModelError(
            f"{name}: its {kinds} layers would run on the CPU, and {', '.join(here)} is installed here: transformers "
            "then calls its Triton kernels whatever the device, and they need a GPU. Run on CUDA (train.use_gpu=true), "
            "or uninstall it for CPU runs (pip uninstall fla-core flash-linear-attention)"
        )


@functools.cache
def kernels_problem(kind: MixerKind) -> str | None:
    """Why `kind`'s kernels, installed here, would not keep a packed row's examples apart (None:
    they would); checked once per process (mixer_kernels.problem)."""
    return problem(kind.calls)


def path(kind: MixerKind, device_type: str) -> str:
    """`kernels` where `kind`'s CUDA kernels run here and keep examples apart, else `torch`."""
    if device_type != "cuda" or not all(_PACKAGES[p] for p in kind.packages):
        return "torch"
    return "kernels" if kernels_problem(kind) is None else "torch"


DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}
"""What `pip install` names the kernels' packages."""


def describe(found: dict[str, MixerKind], device_type: str) -> str:
    """The start line's account of the mixers and the path each takes: what transformers' own
    fallback warnings said from every worker (`quiet_fallback_warnings`), said once."""
    counts: dict[MixerKind, int] = {}
    for kind in found.values():
        counts[kind] = counts.get(kind, 0) + 1
    parts = []
    for kind, n in counts.items():
        if path(kind, device_type) == "kernels":
            how = f"varlen kernels: {kind.kernels}"
        elif device_type == "cuda" and (missing := ", ".join(DISTRIBUTIONS.get(p, p) for p in kind.packages
                                                            if not _PACKAGES[p])):
            how = f"exact torch path, examples in padded batches by length ({missing} not installed: slower)"
        elif device_type == "cuda":
            how = (f"exact torch path, examples in padded batches by length: slower; not the kernels: "
                   f"{kernels_problem(kind)}")
        else:
            how = "exact torch path, examples in padded batches by length: the CPU's; the kernels are CUDA's"
        parts.append(f"{n} {kind.name} layer{'s' if n > 1 else ''} ({how})")
    return "; ".join(parts)


_FALLBACK = "is falling back to its reference PyTorch implementation"
"""transformers' warning (integrations/hub_kernels.py), once per process and kernel, that a mixer
runs its torch code because a kernel package is missing: from every worker, some after the run's
summary, and telling a CPU run to install CUDA kernels. The start line says it once (`describe`)."""


class _NoFallbackWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK not in record.getMessage()


def quiet_fallback_warnings() -> None:
    """Leave out transformers' kernel fallback warnings in this process (idempotent)."""
    log = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _NoFallbackWarning) for f in log.filters):
        log.addFilter(_NoFallbackWarning())


_per_batch = LastCache()


def _segments(cu: torch.Tensor, total: int) -> list[int]:
    hit = _per_batch.get(cu, ("segments", total))
    if hit is None:
        # the host copy collate built, where the step kept one (exact.keep_host_copy): no device read on CUDA
        host = host_copy(cu)
        bounds = (host if host is not None else cu).tolist()
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seq_lens_q must run from 0 to the row's {total} tokens, got {bounds[0]}..{bounds[-1]}")
        hit = _per_batch.put(cu, ("segments", total), [e - s for s, e in zip(bounds[:-1], bounds[1:]) if e > s])
    return hit


def _buckets(cu: torch.Tensor, total: int, device: torch.device) -> tuple[tuple[tuple[int, int], ...],
                                                                         torch.Tensor]:
    """(examples, longest) of each bucket's padded batch, and where each row token goes in those
    batches laid end to end (mixer_buckets.layout), once per batch: the index is built on the
    host from the boundaries and copied over once, from pinned memory on CUDA (a pageable copy
    would block the host until the device is idle)."""
    key = ("buckets", total, device, mixer_buckets.BUCKETS)
    hit = _per_batch.get(cu, key)
    if hit is None:
        found = mixer_buckets.layout(_segments(cu, total), mixer_buckets.BUCKETS)
        index = torch.from_numpy(found.index)
        # pinned, so the copy is queued behind the step's work instead of waiting for the device
        index = index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index.to(device)
        hit = _per_batch.put(cu, key, (found.shapes, index))
    return hit


def seq_idx(cu: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) int32: each token's example, as causal-conv1d and mamba-ssm take it; on cu's
    device, with no read back."""
    hit = _per_batch.get(cu, ("seq_idx", total))
    if hit is None:
        idx = torch.arange(total, device=cu.device)
        found = torch.searchsorted(cu[1:].to(torch.long), idx, right=True).to(torch.int32)[None]
        hit = _per_batch.put(cu, ("seq_idx", total), found)
    return hit


def cu_seqlens(cu: torch.Tensor) -> dict[str, torch.Tensor]:
    """fla's varlen arguments: the boundaries as int64 on cu's device, and on the host where the
    step kept a copy (exact.keep_host_copy), which spares fla its own read back."""
    hit = _per_batch.get(cu, ("cu_seqlens",))
    if hit is None:
        host = host_copy(cu)
        hit = {"cu_seqlens": cu.to(torch.long)} | ({} if host is None else {"cu_seqlens_cpu": host.to(torch.long)})
        hit = _per_batch.put(cu, ("cu_seqlens",), hit)
    return hit


class _Alongside(torch.autograd.Function):
    """`out` as it is, with the spare calls' outputs in its graph: backward hands each a zero
    gradient, so every rank's backward runs through the same calls too (ZeRO-3 fetches a
    submodule's weights again in backward where it released them), adding exactly nothing to any
    gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *spares: torch.Tensor) -> torch.Tensor:
        ctx.spares = [(s.shape, s.dtype, s.device) for s in spares]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor, *_):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.spares))


def _packed_forward(original, kind: MixerKind, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                    **kwargs) -> torch.Tensor:  # fmt: skip
    """The mixer over a packed row: its examples apart. Without cu_seq_lens_q (generation, a
    model called outside raypack's batches) or with a cache (decoding), the layer's own forward."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or cache is not None or kwargs.get("cache_params") is not None:
        return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if ulysses.active() is not None:  # preflight refuses this first (traits.check_packable)
        raise UnsupportedModelError(
            f"{kind.name} layer: train.sequence_parallel splits the packed row over ranks, and this layer's "
            "convolution or recurrence can't continue on the next rank without its state passed along; "
            "use train.sequence_parallel=1"
        )
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        attention_mask = None
    if attention_mask is not None and attention_mask.dim() == 2 and bool(attention_mask.all()):
        attention_mask = None  # a mask of ones pads nothing (checked only when one is passed)
    if attention_mask is not None:
        raise ValueError(f"{kind.name} layer: a packed row carries cu_seq_lens_q and no padding mask, got both")
    batch, length, width = hidden_states.shape
    total = batch * length
    row = hidden_states.reshape(1, total, width)  # cu_seq_lens index the flattened rows
    if path(kind, row.device.type) == "kernels":
        extra = kind.varlen(cu) if kind.varlen else {}
        out = original(row, cache=None, attention_mask=None, **{**kwargs, "seq_idx": seq_idx(cu, total), **extra})
    else:
        # The examples as the rows of right-padded batches, one a bucket of similar lengths: each
        # starts from zeros and ends before its padding, which a causal mixer never reads back.
        # Always BUCKETS calls, not one per example or per bucket found, because under ZeRO-3
        # every submodule call gathers its weights, a collective that ranks holding different
        # examples would otherwise call different numbers of times: a spare call runs one zero
        # token, its output kept in the graph with a zero gradient (_Alongside).
        rest = {k: v for k, v in kwargs.items() if k not in PACKING_KWARGS}
        shapes, index = _buckets(cu, total, row.device)
        sizes = [n * longest for n, longest in shapes]
        padded = row.new_zeros(sum(sizes), width).index_copy(0, index, row[0])
        outs = [original(part.view(n, longest, width), cache=None, attention_mask=None, **rest).reshape(size, -1)
                for (n, longest), size, part in zip(shapes, sizes, padded.split(sizes))]  # fmt: skip
        out = (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, index)
        # A spare's input requires a gradient where the row's does, so its backward runs the same
        # submodules' backward as a real bucket's: with frozen weights (LoRA) a spare input without
        # one skips the frozen linears' backward, and ZeRO-3 gathers their weights fewer times.
        spares = [original(row.new_zeros(1, 1, width).requires_grad_(row.requires_grad), cache=None,
                           attention_mask=None, **rest) for _ in range(mixer_buckets.BUCKETS - len(shapes))]  # fmt: skip
        if spares:
            out = _Alongside.apply(out, *spares)
    return out.reshape(batch, length, -1)


def install(decoder: nn.Module) -> dict[str, MixerKind]:
    """Route every known mixer of `decoder` (a model's text model) through `_packed_forward`;
    idempotent. Returns what it found. The wrapper is the instance's `forward`, so parameter
    names, state dicts, peft's targets and DeepSpeed's hooks are those of the model as built."""
    found = find(decoder)
    modules = dict(decoder.named_modules())
    for name, kind in found.items():
        module = modules[name]
        if getattr(module, "_raypack_packed", False):
            continue
        module.forward = functools.partial(_packed_forward, module.forward, kind)
        module._raypack_packed = True
    return found


def check_kept(model: nn.Module, name: str) -> None:
    """Refuse (UnsupportedModelError, one line) a loaded model whose routed mixers no longer run
    raypack's packed forward over transformers' own kernel functions (mixer_kernels.swapped: hub
    kernels swapped in, or raypack's forward removed, by transformers' kernelization), or which
    transformers would kernelize again at its next train() or eval(). raypack loads without them
    (mixer_kernels.HUB_KERNELS_OFF); this is the check that nothing turned them back on."""
    found = find(model)
    for where, kind in found.items():
        if lost := swapped(model.get_submodule(where), _packed_forward):
            what = ", ".join("raypack's packed forward removed" if x == "forward" else f"{x} replaced" for x in lost)
            raise UnsupportedModelError(
                f"{name}: transformers' hub kernels (the kernels package) changed its {kind.name} layer {where} "
                f"({what}), and raypack can't tell that they keep a packed row's examples apart; load it without "
                "them: set USE_HUB_KERNELS=NO in the environment"
            )
    if found and getattr(model, "use_kernels", False):
        raise UnsupportedModelError(
            f"{name}: transformers loaded it with hub kernels on (use_kernels), and would swap them into its "
            f"{next(iter(found.values())).name} layers at the next train() or eval(), where raypack can't tell that "
            "they keep a packed row's examples apart; set USE_HUB_KERNELS=NO in the environment"
        )


def fused_linears(model: nn.Module) -> list[str]:
    """Names (in `model`) of the linear layers known mixers' kernels read by weight (`MixerKind.fused`)."""
    return [f"{name}.{sub}" for name, kind in find(model).items() for sub in kind.fused]


def read_by_weight(model: nn.Module, adapted: Callable[[nn.Module], bool]) -> str | None:
    """The first submodule of a known mixer whose weight every path reads directly
    (`MixerKind.by_weight`) and on which `adapted` finds an adapter, with why, or None."""
    for name, kind in find(model).items():
        mixer = model.get_submodule(name)
        for sub in kind.by_weight:
            if adapted(getattr(mixer, sub, None)):
                return (f"{name}.{sub}, whose weight the {kind.name} layer hands its convolution itself, never calling "
                        "the module, so an adapter there would never run or train")
    return None


def keep_unfused(model: nn.Module, adapted: Callable[[nn.Module], bool]) -> list[str]:
    """Keep every known mixer of `model` off its fused kernel where `adapted` finds an adapter on
    a linear that kernel reads by weight (`MixerKind.fused`); returns the mixers' names.

    The fused kernel is what transformers' Mamba-2 layers call in training mode (`self.training
    and cache is None`: their only use of the flag); their eval forward runs the same kernels
    unfused and calls `out_proj` as a module, adapter included, at the cost of the fusion. So
    such a mixer's own `training` stays False while its submodules train (the flag and
    `train()`, which every `model.train()` calls on each child, are the instance's)."""
    kept = []
    for name, kind in find(model).items():
        mixer = model.get_submodule(name)
        if any(adapted(getattr(mixer, sub, None)) for sub in kind.fused):
            if not getattr(mixer, "_raypack_unfused", False):
                mixer.train = functools.partial(_train_unfused, mixer)
                mixer._raypack_unfused = True
            mixer.train(mixer.training)
            kept.append(name)
    return kept


def _train_unfused(mixer: nn.Module, mode: bool = True) -> nn.Module:
    nn.Module.train(mixer, mode)  # its submodules (LoRA dropout among them) follow `mode`
    mixer.training = False
    return mixer
