"""Can this model train on packed rows, exactly? Its traits decide, before training starts.

A packed row holds several examples. Packing is exact only if every layer that mixes tokens
keeps them apart, which raypack guarantees for attention routed through its varlen backends
(`attention.py`) and for the token mixers it knows (`mixers.py`: the gated delta rule, Mamba-2,
short convolutions), and for nothing else. So a model is refused, naming the model, the trait and
what still works, when it has

    a token mixer raypack doesn't know   `layer_types` entries such as conv, linear_attention,
                                         hybrid, or modules that mix along the sequence:
                                         nn.Conv1d (Mamba-1, RecurrentGemma, KDA), SSM parameters
                                         `A_log`, attention modules with is_causal=False (BERT
                                         without is_decoder). They see the whole row and would mix
                                         examples. Known mixers, and the layer types of the layers
                                         holding them, count only under raypack's attention
                                         backends, which install them (not `sdpa`, whose refusal
                                         names the backend, not a trait). Only the text
                                         decoder is searched (`get_decoder()`): vision and audio
                                         towers never see a packed row.
    known mixers, split or compiled      train.sequence_parallel > 1 (a recurrence can't follow a
                                         row across ranks) and train.compile
    attention outside transformers'      no `_supports_attention_backend`, or no position_ids
    attention interface                  in forward (Bloom, GPT-2-era classes)
    row-position query scaling           Llama 4's `attn_temperature_tuning` scales NoPE layers'
                                         queries by the position in the row, not in the example:
                                         exact only while rows are shorter than `floor_scale`

and, depending on the backend that will run:

    attention sinks (a `sinks` tensor)   exact on sdpa_varlen; the CUDA kernels have none
    logit softcapping                    exact on sdpa_varlen and flash_attn; not torch_varlen
    attention dropout                    exact on sdpa_varlen and flash_attn; not torch_varlen

Chunked attention (`attention_chunk_size` on `chunked_attention` layers, Llama 4) and sliding
windows are exact on every raypack backend. Padded strategies (pad, pad_sorted) load the model
with its own attention and one example per row, so every trait above still trains there.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from raypack.errors import UnsupportedModelError
from raypack.model import mixers

EXACT_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention",
                               "moe", "sparse", "dense"})  # fmt: skip
"""`layer_types` entries raypack keeps exact: attention kinds it implements, and MLP kinds, which
mix no tokens. Anything else (conv, linear_attention, mamba, hybrid, indexed/compressed
attention, and kinds a newer transformers adds) is refused until checked."""

PADDED = "pad or pad_sorted"
"""The padded strategies, as every refusal names them (data/strategies.py is their home; the
model layer knows no strategy, tests/unit/model/test_build.py keeps the two in step)."""


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder, where packed rows flow (a vision or audio tower sees no packed row)."""
    try:
        found = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        found = None
    return found if isinstance(found, torch.nn.Module) else model


def token_mixers(model: torch.nn.Module, known_exact: bool = False) -> list[str]:
    """What, besides causal attention, mixes tokens along the sequence: layer types and modules.
    `known_exact`: the mixers raypack keeps exact (mixers.py) will be installed, so they and
    their layers' types don't count; only what it doesn't know does."""
    found = []
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    text = decoder(model)
    known = mixers.find(text) if known_exact else {}
    modules = dict(text.named_modules())
    inside = tuple(f"{name}." for name in known)
    # a layer whose type is a mixer's kind is exact if it holds a known mixer (by layer_idx)
    mixer_layers = {getattr(modules[name], "layer_idx", None) for name in known}
    for field in ("layer_types", "mtp_layer_types"):
        types = getattr(config, field, None) or []
        odd = sorted({t for i, t in enumerate(types) if t not in EXACT_LAYER_TYPES
                      and not (field == "layer_types" and i in mixer_layers)})  # fmt: skip
        if odd:
            found.append(f"{field} {', '.join(odd)}")
    for name, module in text.named_modules():
        if isinstance(module, torch.nn.Conv1d) and not name.startswith(inside):
            found.append(f"a convolution over the sequence ({name})")
            break
    for name, module in text.named_modules():
        if getattr(module, "is_causal", None) is False:
            found.append(f"bidirectional attention ({name}.is_causal is False)")
            break
    for name, _ in text.named_parameters():
        if name.rsplit(".", 1)[-1] == "A_log" and not name.startswith(inside):
            found.append(f"a state-space (Mamba-style) scan ({name.rsplit('.', 1)[0]})")
            break
    return found


_QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


def routes_attention(model: torch.nn.Module) -> bool:
    """Whether raypack's attention reaches every attention layer. transformers promises it for
    classes that declare `_supports_attention_backend`. The hybrids (Qwen3.5, Qwen3-Next,
    Nemotron-H, Bamba, ...) don't, because transformers' own padding-free path can't reach their
    mixers; raypack's mixers do, so for a model holding them it reads the attention layers
    themselves: every module with query projections must look its function up in
    ALL_ATTENTION_FUNCTIONS. `late_attention` says such a model gets the name after it is built."""
    if getattr(type(model), "_supports_attention_backend", False):
        return True
    return late_attention(model)


def late_attention(model: torch.nn.Module) -> bool:
    """A hybrid whose class doesn't declare `_supports_attention_backend` but whose attention
    layers all go through AttentionInterface: transformers refuses a registered name at build,
    so the model is built with eager and the name set on its config afterwards (build.py)."""
    if getattr(type(model), "_supports_attention_backend", False):
        return False
    text = decoder(model)
    found = mixers.find(text)
    if not found:
        return False
    kinds = {type(text.get_submodule(name)) for name in found}  # a gated delta rule has q_proj too
    attention = {type(m) for m in text.modules()
                 if any(hasattr(m, p) for p in _QUERY_PROJECTIONS) and type(m) not in kinds}  # fmt: skip
    return bool(attention) and all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward) for cls in attention)


def has_sinks(model: torch.nn.Module) -> str | None:
    """The first attention module carrying a `sinks` tensor (GPT-OSS passes it as s_aux)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return f"{name}.sinks"
    return None


def row_scaled_layers(config) -> int | None:
    """Llama 4's query temperature on NoPE layers uses the row position: its `floor_scale`, if
    any NoPE layer applies it. A row shorter than floor_scale tokens keeps the scale at 1."""
    if not getattr(config, "attn_temperature_tuning", False):
        return None
    if 0 not in (getattr(config, "no_rope_layers", None) or []):
        return None
    return int(config.floor_scale)


def backend_reasons(model: torch.nn.Module, backend: str) -> list[str]:
    """Traits of `model` that `backend` (a raypack backend, or `sdpa` for transformers' own
    attention over packed position_ids) can't run exactly."""
    config = model.config
    reasons = []
    if backend in ("flash_attn", "torch_varlen") and (where := has_sinks(model)):
        reasons.append(f"attention sinks ({where}), which the CUDA varlen kernels don't apply")
    if backend == "torch_varlen":
        if getattr(config, "attn_logit_softcapping", None):
            reasons.append(f"attention logit softcapping ({config.attn_logit_softcapping}), which torch varlen_attn lacks")
        if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            reasons.append(f"attention dropout ({config.attention_dropout}), which torch varlen_attn lacks")
    return reasons


def check_packable(
    model: torch.nn.Module, name: str, backends: Sequence[str] = ("sdpa_varlen",), max_row_tokens: int | None = None,
    split: int = 1, compiled: bool = False,
) -> None:
    """Raise UnsupportedModelError unless `model` trains exactly on packed rows under one of
    `backends` (the ones `attention='auto'` may pick, or the one it names). `max_row_tokens`,
    when known, bounds the rows (the pack budget); row-position traits are checked against it
    here and otherwise per batch by the attention function. `split`: train.sequence_parallel,
    whose all-to-all hands each rank 1/split of every layer's query heads (raypack/model/ulysses.py).
    `compiled`: train.compile."""
    cls = type(model).__name__
    what = f"{name} ({cls})"
    if backends and (split > 1 or compiled) and (found := mixers.find(decoder(model))):
        kinds = ", ".join(sorted({kind.name for kind in found.values()}))
        if split > 1:
            raise UnsupportedModelError(
                f"{what} has {kinds} layers: train.sequence_parallel={split} splits every packed row over {split} "
                "ranks, and a convolution or recurrence over the row can't continue on the next rank without "
                "its state passed along, which raypack doesn't do; use train.sequence_parallel=1"
            )
        raise UnsupportedModelError(
            f"{what} has {kinds} layers, whose packed path reads the row's boundaries on the host (the "
            "examples as a padded batch, or their CUDA kernels): a compiled layer would break its graph there; "
            "use train.compile=false"
        )
    if not backends and (found := mixers.find(decoder(model))) and not token_mixers(model, known_exact=True):
        # what it lacks is the backend, not a trait: under raypack's own these layers are exact
        kinds = ", ".join(sorted({kind.name for kind in found.values()}))
        raise UnsupportedModelError(
            f"{what} has {kinds} layers, which transformers' own attention (model.attention=sdpa or eager) leaves "
            "running over the whole packed row, mixing its examples; raypack's attention backends keep them apart: "
            f"use model.attention=auto (or sdpa_varlen, torch_varlen, flash_attn), or a padded strategy ({PADDED})"
        )
    heads = getattr(model.config.get_text_config(), "num_attention_heads", None)
    if split > 1 and (not heads or heads % split):
        raise UnsupportedModelError(
            f"{what}: train.sequence_parallel={split} splits every attention layer's query heads over {split} ranks, "
            f"and it has {heads or 'no known number of'} heads; use a sequence_parallel that divides them"
        )
    reasons = []
    if not routes_attention(model):
        reasons.append("transformers can't route its attention through AttentionInterface")
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        reasons.append("its forward takes no position_ids")
    reasons += [f"{m}, which would mix the examples of a packed row" for m in token_mixers(model, bool(backends))]
    floor = row_scaled_layers(model.config)
    if floor is not None and max_row_tokens is not None and max_row_tokens >= floor:
        reasons.append(
            f"attn_temperature_tuning scales NoPE layers' queries by the position in the row, and rows of "
            f"{max_row_tokens} tokens reach its floor_scale {floor} (use a budget below {floor})"
        )
    if reasons:
        raise UnsupportedModelError(
            f"{what} can't train on packed rows: {'; '.join(reasons)}. "
            f"Use a padded strategy instead ({PADDED}), whose batches load it with its own attention."
        )
    per_backend = {b: backend_reasons(model, b) for b in backends}
    if per_backend and all(per_backend.values()):
        detail = "; ".join(f"attention={b}: {', '.join(r)}" for b, r in per_backend.items())
        raise UnsupportedModelError(
            f"{what} can't run exactly on {' or '.join(backends)}: {detail}. What works: "
            f"model.attention=sdpa_varlen (exact per example, slower on GPU), flash-attn for softcapping "
            f"and dropout, or a padded strategy ({PADDED})."
        )

