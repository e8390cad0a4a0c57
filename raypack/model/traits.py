"""Can this model train on packed rows, exactly? Its traits decide, before training starts.

A packed row holds several examples. Packing is exact only if every layer that mixes tokens
keeps them apart, which raypack guarantees for attention routed through its varlen backends
(`attention.py`) and for the token mixers it knows (`mixers.py`: the gated delta rule, KDA, Mamba-2,
short convolutions), and for nothing else. So a model is refused, naming the model, the trait and
what still works, when it has

    a token mixer raypack doesn't know   modules that mix along the sequence: nn.Conv1d
                                         (Mamba-1, RecurrentGemma), SSM parameters `A_log`,
                                         attention modules with is_causal=False (BERT without
                                         is_decoder), and in a layer whose `layer_types` entry
                                         isn't an attention raypack implements, any module whose
                                         forward takes the sequence's mask or cache (an indexer,
                                         a compressor) without being attention it routes or a
                                         mixer it knows. They see the whole row and would mix
                                         examples. Such a layer holding only an MLP or an MoE
                                         (Nemotron-H's `mlp` and `moe`) mixes nothing. Known
                                         mixers count only under raypack's attention backends,
                                         which install them (not `sdpa`, whose refusal names the backend, not a trait). Only the text decoder
                                         is searched (`get_decoder()`): vision and audio towers
                                         never see a packed row.
    known mixers, split or compiled      train.sequence_parallel > 1 (a recurrence can't follow a
                                         row across ranks) and train.compile
    attention outside transformers'      no `_supports_attention_backend`, or no position_ids
    attention interface                  in forward (Bloom, GPT-2-era classes). A stack of known
                                         mixers with no attention layer has nothing to route, and
                                         no positions to read
    boundaries that can't reach the      a forward that doesn't hand its keyword arguments (the
    mixers                               row's cu_seq_lens) to its decoder (Mamba2ForCausalLM)
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

import ast
import inspect
import textwrap
from collections.abc import Sequence

import torch

from raypack.errors import UnsupportedModelError
from raypack.model import mixers
from raypack.model.facts import ModelTree, decoder, describe, read_tree  # noqa: F401 (decoder: its old home)

ROUTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
"""`layer_types` entries naming attention raypack implements. Any other entry (an MLP, an MoE, a
recurrence, a kind a newer transformers adds) is judged by the modules of the layer it names
(`layer_mixes`), or refused where no layer can be found for it."""

SEQUENCE_ARGUMENTS = ("attention_mask", "cache", "cache_params", "past_key_values", "past_key_value",
                      "cu_seqlens", "cu_seq_lens_q", "seq_idx")  # fmt: skip
"""What only a module that works along the sequence takes. An MLP, an MoE, its router and experts
and a norm take the hidden states (and the token ids) alone; positions alone are per token."""

PADDED = "pad or pad_sorted"
"""The padded strategies, as every refusal names them (data/strategies.py is their home; the
model layer knows no strategy, tests/unit/model/test_build.py keeps the two in step)."""


def token_mixers(model: torch.nn.Module, known_exact: bool = False, tree: ModelTree | None = None) -> list[str]:
    """What, besides causal attention, mixes tokens along the sequence: layers and modules.
    `known_exact`: the mixers raypack keeps exact (mixers.py) will be installed, so they don't
    count; only what it doesn't know does. `tree`: the model's, if read already."""
    found = []
    tree = tree or read_tree(model)
    text = tree.decoder
    known = tree.mixers if known_exact else {}
    inside = tuple(f"{name}." for name in known)
    layers = getattr(text, "layers", None)
    types = list(describe(getattr(model, "config", None)).layer_types)
    if types and isinstance(layers, torch.nn.ModuleList) and len(layers) == len(types):
        attention = attention_types(text, tree.mixers)
        odd = {}
        for i, t in enumerate(types):
            if t not in ROUTED_LAYER_TYPES and (why := layer_mixes(layers[i], f"layers.{i}", known, attention)):
                odd.setdefault(t, why)
        if odd:
            found.append(f"layer_types {', '.join(f'{t} ({why})' for t, why in sorted(odd.items()))}")
    else:  # no layer to read: the names alone, attention raypack implements or refused
        odd = sorted({t for t in types if t not in ROUTED_LAYER_TYPES})
        if odd:
            found.append(f"layer_types {', '.join(odd)}")
    # MTP layers (`mtp_layer_types`) are not built by transformers (their weights are skipped on
    # load), so they train nothing; one built beside the decoder's layers would be searched below.
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


def layer_mixes(layer: torch.nn.Module, where: str, known: dict[str, mixers.MixerKind],
                attention: set[type]) -> str | None:  # fmt: skip
    """Why `layer` (named `where` in the decoder) mixes a packed row's examples, or None: its
    modules are attention raypack routes, mixers it knows (`known`, by name in the decoder), and
    what takes the hidden states alone (an MLP, an MoE). A module whose forward takes the mask or
    the cache, holding neither attention nor a known mixer, works along the sequence unchecked."""
    names = {name.removeprefix(f"{where}.") for name in known if name.startswith(f"{where}.")}
    holds = {name for name, m in layer.named_modules() if type(m) in attention or name in names}
    for name, module in layer.named_modules():
        if not name or any(name == k or name.startswith(f"{k}.") for k in names):
            continue
        if type(module) in attention:
            if not _routed(type(module)):
                return f"{where}.{name} is attention outside AttentionInterface"
            continue
        if any(h == name or h.startswith(f"{name}.") for h in holds):
            continue  # a block around attention or a mixer, handing the mask down
        takes = _sequence_arguments(module)
        if takes:
            return f"{where}.{name}: {type(module).__name__} takes the {takes[0]}, so it works along the sequence"
    return None


def _sequence_arguments(module: torch.nn.Module) -> list[str]:
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return []
    return [a for a in SEQUENCE_ARGUMENTS if a in params]


def _routed(cls: type) -> bool:
    """Whether the attention class looks its function up in ALL_ATTENTION_FUNCTIONS (raypack's backends)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


_QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "q_a_proj", "q_b_proj", "query")


def attention_types(text: torch.nn.Module, known: dict[str, mixers.MixerKind] | None = None) -> set[type]:
    """The attention classes of the decoder `text`: modules with query projections or a causal
    flag, and the class transformers records attentions from (`_can_record_outputs`), less the
    known mixers' (a gated delta rule has q_proj too)."""
    known = mixers.find(text) if known is None else known
    kinds = {type(text.get_submodule(name)) for name in known}
    declared = getattr(text, "_can_record_outputs", None) or {}
    recorded = declared.get("attentions") if isinstance(declared, dict) else None
    recorded = recorded if isinstance(recorded, (list, tuple)) else [recorded]
    classes = {getattr(r, "target_class", r) for r in recorded if r is not None}
    return {type(m) for m in text.modules()
            if (type(m) in classes or hasattr(m, "is_causal") or any(hasattr(m, p) for p in _QUERY_PROJECTIONS))
            and type(m) not in kinds}  # fmt: skip


def routes_attention(model: torch.nn.Module, tree: ModelTree | None = None) -> bool:
    """Whether raypack's attention reaches every attention layer. transformers promises it for
    classes that declare `_supports_attention_backend`. The hybrids (Qwen3.5, Qwen3-Next,
    Nemotron-H, Bamba, ...) don't, because transformers' own padding-free path can't reach their
    mixers; raypack's mixers do, so for a model holding them it reads the attention layers
    themselves: every attention class must look its function up in ALL_ATTENTION_FUNCTIONS, and
    a stack of mixers with no attention layer has nothing to route. `late_attention` says such
    a model gets the name after it is built."""
    if getattr(type(model), "_supports_attention_backend", False):
        return True
    return late_attention(model, tree)


def late_attention(model: torch.nn.Module, tree: ModelTree | None = None) -> bool:
    """A hybrid whose class doesn't declare `_supports_attention_backend` but whose attention
    layers, if any, all go through AttentionInterface: transformers refuses a registered name at
    build, so the model is built with eager and the name set on its config afterwards (build.py)."""
    if getattr(type(model), "_supports_attention_backend", False):
        return False
    tree = tree or read_tree(model)
    if not tree.mixers:
        return False
    return all(_routed(cls) for cls in attention_types(tree.decoder, tree.mixers))


def drops_boundaries(model: torch.nn.Module) -> str | None:
    """The decoder a model with known mixers calls without its forward's keyword arguments, which
    carry the row's boundaries (cu_seq_lens_q) to the mixers: Mamba2ForCausalLM calls its
    `backbone` with named arguments alone. None where the call passes them on, or can't be read."""
    prefix = getattr(model, "base_model_prefix", "")
    forward = getattr(type(model), "forward", None)
    if not prefix or forward is None or not hasattr(model, prefix):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == prefix and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]  # fmt: skip
    if calls and not any(k.arg is None for call in calls for k in call.keywords):
        return prefix
    return None


def positionless(model: torch.nn.Module, tree: ModelTree) -> bool:
    """A stack of known mixers with no attention layer: nothing in it reads positions (a causal
    convolution or recurrence has no position embedding), so a forward without position_ids loses
    nothing, as long as it hands its keyword arguments on (the row's boundaries ride there; whether
    the decoder gets them too is `drops_boundaries`). Mamba2ForCausalLM from transformers 5.25."""
    takes = inspect.signature(type(model).forward).parameters.values()
    return (bool(tree.mixers) and not attention_types(tree.decoder, tree.mixers)
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes))


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
    tree = read_tree(model)
    found = tree.mixers
    if backends and (split > 1 or compiled) and found:
        kinds = ", ".join(sorted({kind.name for kind in found.values()}))
        if split > 1:
            raise UnsupportedModelError(
                f"{what} has {kinds} layers: train.sequence_parallel={split} splits every packed row over {split} "
                "ranks, and a convolution or recurrence over the row can't continue on the next rank without "
                "its state passed along, which raypack doesn't do; use train.sequence_parallel=1"
            )
        raise UnsupportedModelError(
            f"{what} has {kinds} layers, whose packed path reads the row's boundaries on the host (the "
            "examples in padded batches by length, or their CUDA kernels): a compiled layer would break its graph "
            "there; use train.compile=false"
        )
    if not backends and found and not token_mixers(model, known_exact=True, tree=tree):
        # what it lacks is the backend, not a trait: under raypack's own these layers are exact
        kinds = ", ".join(sorted({kind.name for kind in found.values()}))
        raise UnsupportedModelError(
            f"{what} has {kinds} layers, which transformers' own attention (model.attention=sdpa or eager) leaves "
            "running over the whole packed row, mixing its examples; raypack's attention backends keep them apart: "
            f"use model.attention=auto (or sdpa_varlen, torch_varlen, flash_attn), or a padded strategy ({PADDED})"
        )
    heads = describe(model.config).heads
    if split > 1 and (not heads or heads % split):
        raise UnsupportedModelError(
            f"{what}: train.sequence_parallel={split} splits every attention layer's query heads over {split} ranks, "
            f"and it has {heads or 'no known number of'} heads; use a sequence_parallel that divides them"
        )
    reasons = []
    if not routes_attention(model, tree):
        reasons.append("transformers can't route its attention through AttentionInterface")
    if "position_ids" not in inspect.signature(type(model).forward).parameters and not positionless(model, tree):
        reasons.append("its forward takes no position_ids")
    if backends and found and (callee := drops_boundaries(model)):
        reasons.append(f"its forward calls self.{callee} without its keyword arguments, so the row's boundaries "
                       "never reach its convolutions and recurrences")
    reasons += [f"{m}, which would mix the examples of a packed row" for m in token_mixers(model, bool(backends), tree)]
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

