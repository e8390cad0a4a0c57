"""One description of a model, read once: what the memory estimate, the kernels, checkpointing,
the router loss, packability and the start line ask of a model, answered in one place.

    facts = describe(config)        # from its transformers config: no weights, before Ray starts
    facts.vlm, facts.layers, facts.experts, facts.text   # sizes, kind, routers, the text config
    tree = facts.meta_tree()        # its structure on the meta device, built once per description
    tree = read_tree(model)         # the same of a built model: decoder, mixers found, vision tower

Without it, each consumer asked the config again ("is it a VLM? its text config? how many
experts?") and built its own meta-device copy of the model to find its mixers and tower: a
worker's setup read one model's config twice and built its structure twice before building it
for real, and the driver's checks built the structure up to six times. Two answers to one
question drift apart (../shared/STYLE.md, "Describe the model once").

`describe` keeps the last few descriptions by config identity (and the config's state: a config
changed since is described again), so every consumer handed the same config object gets the same
record, its meta-device structure built once, and `load_model` gives the model it builds from a
description that description (`remember`): the worker's setup describes its model once.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.integrations import deepspeed as hf_deepspeed

from raypack.model import mixers

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that give a model's routed-expert count (the families' names for one thing)."""
TOWERS = ("visual", "vision_tower", "vision_model")
"""Where transformers' VLMs keep the vision tower, on the inner model (Qwen, LLaVA/Gemma, Idefics3/SmolVLM)."""

KEPT = 8
"""Descriptions `describe` keeps (a worker needs one; the driver's checks one per model)."""


def text_config(config: Any) -> Any:
    """The language model's config: a VLM's `text_config`, or the config itself."""
    return getattr(config, "get_text_config", lambda: config)()


def is_vlm(config: Any) -> bool:
    """A config with a vision tower and a language model (transformers' image-text-to-text models)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None


def vlm_class(config: Any):
    """AutoModelForImageTextToText where raypack trains `config` as a VLM, else None: where
    transformers has an image-text-to-text class for it and no causal-LM class. A config with both
    (Qwen3.5, Gemma 3 and 4, published as multimodal checkpoints) trains as transformers' causal LM
    for it loads it: its text model, on text data, exact as the text families are (a Gemma 3
    checkpoint's bidirectional image mask never meets a packed row)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return None
    return AutoModelForImageTextToText


def trains_as_vlm(config: Any) -> bool:
    """Whether a run of `config` trains a VLM, images and all (`vlm_class`)."""
    return is_vlm(config) and vlm_class(config) is not None


def expert_count(config: Any) -> int:
    """The config's routed-expert count, 0 for a dense model."""
    text = text_config(config)
    for key in EXPERT_COUNT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def meta_model(config: Any, trust_remote_code: bool = False):
    """The model `config` describes, on the meta device: its structure, no weights (seconds for 70B)."""
    config = copy.deepcopy(config)
    config.use_cache = False
    # The attention name only has to be one transformers accepts for any class: the structure is
    # what the checks read, and raypack's names change no model's structure.
    auto = vlm_class(config) or AutoModelForCausalLM
    # Never under ZeRO-3's zero.Init (a worker probes the structure while its HfDeepSpeedConfig
    # lives): a probe needs no partitions, and its gathers hung a tiny LLaVA's two ranks at setup.
    zero3, hf_deepspeed._hf_deepspeed_config_weak_ref = hf_deepspeed._hf_deepspeed_config_weak_ref, None
    try:
        with torch.device("meta"):
            return auto.from_config(config, attn_implementation="eager", trust_remote_code=trust_remote_code)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = zero3


def inner(model: nn.Module) -> nn.Module:
    """The *Model inside a *ForConditionalGeneration (where get_rope_index and the tower live),
    through a peft wrapper (whose own `.model` is its LoRA layer, not the VLM's)."""
    model = getattr(model, "get_base_model", lambda: model)()
    return getattr(model, "model", model)


@dataclass(frozen=True)
class ModelTree:
    """What a model's modules say: read by structure, once per model read."""

    model: nn.Module = field(repr=False)
    decoder: nn.Module = field(repr=False)
    """The text decoder, where packed rows flow (`decoder`)."""
    mixers: dict[str, mixers.MixerKind]
    """The known token mixers besides attention in the decoder, by module name (mixers.find)."""
    tower: nn.Module | None = field(repr=False)
    """A VLM's vision tower (TOWERS on the inner model), or None."""


def decoder(model: nn.Module) -> nn.Module:
    """The text decoder, where packed rows flow (a vision or audio tower sees no packed row)."""
    try:
        found = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        found = None
    return found if isinstance(found, torch.nn.Module) else model


def read_tree(model: nn.Module) -> ModelTree:
    """The ModelTree of `model` (built, or on the meta device)."""
    text = decoder(model)
    tower = next((t for name in TOWERS if isinstance(t := getattr(inner(model), name, None), nn.Module)), None)
    return ModelTree(model, text, mixers.find(text), tower)


@dataclass(frozen=True)
class ModelFacts:
    """A model, as its config states it (`describe`). Sizes are the text decoder's; None where the
    config names none or sets it per layer (`varies`): the memory estimate refuses those."""

    config: Any = field(repr=False, compare=False)
    trust_remote_code: bool
    model_type: str
    multimodal: bool
    """A vision tower and a language model in one config (`is_vlm`)."""
    vlm: bool
    """Trains as a VLM, images and all (`trains_as_vlm`)."""
    layers: int | None
    hidden: int | None
    inter: int | None
    """The MLP's width: intermediate_size, or 4 x hidden where the config names none."""
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    """The config's head_dim, or hidden // heads."""
    vocab: int | None
    tied: bool
    qkv_bias: bool
    """q, k and v with a bias: attention_bias, or Qwen2 (which builds one its config doesn't name)."""
    layer_types: tuple[str, ...]
    experts: int
    """Routed experts (0: dense)."""
    top_k: int
    """Experts a token is routed to, as the config names it (0: not named)."""
    router_coef: float | None
    """The config's router_aux_loss_coef, where it names a number."""
    varies: tuple[str, ...] = ()
    """Sizes a heterogeneous config (Gemma 4) sets per layer, None above: one global value would be
    wrong for some layers, so the estimate refuses to size it."""
    attention: tuple[tuple[int, int, int], ...] = ()
    """Each layer's (heads, kv_heads, head_dim): what the FLOPs count sums, per layer where a
    heterogeneous config sets them per layer (Gemma 4's full-attention layers are wider)."""
    _built: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def text(self) -> Any:
        return text_config(self.config)

    def meta_model(self) -> nn.Module:
        """The model on the meta device (`meta_model`), built once; raises where transformers
        can't build it here (remote code not at hand). Shared: read it, don't change it."""
        if "meta" not in self._built:
            self._built["meta"] = meta_model(self.config, self.trust_remote_code)
        return self._built["meta"]

    def meta_tree(self) -> ModelTree | None:
        """`read_tree` of the meta model, or None where it can't be built (then sized as a
        Llama-like decoder by the estimate, as before hybrids and towers were known)."""
        if "tree" not in self._built:
            try:
                self._built["tree"] = read_tree(self.meta_model())
            except Exception:
                self._built["tree"] = None
        return self._built["tree"]


_KEPT: OrderedDict[int, tuple[Any, dict, ModelFacts]] = OrderedDict()
"""id(config) -> (config, its state when described, its description)."""


def describe(config: Any, trust_remote_code: bool = False) -> ModelFacts:
    """The ModelFacts of `config`: the same record for the same config object while its state is
    unchanged (the last KEPT; a config changed since is described again)."""
    state = _state(config)
    kept = _KEPT.get(id(config))
    if kept is not None and kept[0] is config and kept[1] == state and kept[2].trust_remote_code == trust_remote_code:
        _KEPT.move_to_end(id(config))
        return kept[2]
    facts = _describe(config, trust_remote_code)
    return remember(config, facts) if state is not None else facts


def remember(config: Any, facts: ModelFacts) -> ModelFacts:
    """Make `facts` what `describe(config)` answers while `config` stays as it is now: a model built
    from a description keeps it (its config a copy, differing in the attention's name and the cache)."""
    _KEPT[id(config)] = (config, _state(config), facts)
    _KEPT.move_to_end(id(config))
    while len(_KEPT) > KEPT:
        _KEPT.popitem(last=False)
    return facts


def _state(config: Any) -> dict | None:
    """What a description was read from (a transformers config's values, sub-configs included):
    None for what is no config, which is described every time."""
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def _describe(config: Any, trust_remote_code: bool) -> ModelFacts:
    c = text_config(config)
    varies: list[str] = []

    def read(key: str):
        try:
            return getattr(c, key, None)
        except RuntimeError:  # a heterogeneous config sets it per layer (AmbiguousGlobalPerLayerAttributeError)
            varies.append(key)
            return None

    hidden, heads, inter, kv_heads, head_dim, top_k, coef = (read(k) for k in (
        "hidden_size", "num_attention_heads", "intermediate_size", "num_key_value_heads", "head_dim",
        "num_experts_per_tok", "router_aux_loss_coef"))  # fmt: skip
    return ModelFacts(
        config=config, trust_remote_code=trust_remote_code, model_type=getattr(config, "model_type", ""),
        multimodal=is_vlm(config), vlm=trains_as_vlm(config),
        layers=read("num_hidden_layers"), hidden=hidden,
        inter=None if "intermediate_size" in varies or not hidden else inter or 4 * hidden,
        heads=heads, kv_heads=None if "num_key_value_heads" in varies or not heads else kv_heads or heads,
        head_dim=None if "head_dim" in varies else head_dim or (hidden // heads if hidden and heads else None),
        vocab=read("vocab_size"), tied=bool(read("tie_word_embeddings")),
        # Qwen2 builds q/k/v with a bias that its config doesn't mention; Llama-likes say attention_bias.
        qkv_bias=bool(read("attention_bias")) or getattr(c, "model_type", "") == "qwen2",
        layer_types=tuple(read("layer_types") or ()), experts=expert_count(config),
        top_k=top_k if isinstance(top_k, int) and top_k > 0 else 0,
        router_coef=float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else None,
        varies=tuple(varies), attention=_attention(c, heads, kv_heads, head_dim, read("num_hidden_layers"), varies),
    )  # fmt: skip


def _attention(c: Any, heads, kv_heads, head_dim, layers, varies: list[str]) -> tuple[tuple[int, int, int], ...]:
    """ModelFacts.attention: from each layer's own config where the config is heterogeneous."""
    if any(k in varies for k in ("num_attention_heads", "num_key_value_heads", "head_dim")):
        per = getattr(c, "per_layer_config", None) or ()
        return tuple((layer.num_attention_heads, layer.num_key_value_heads or layer.num_attention_heads,
                      layer.head_dim or layer.hidden_size // layer.num_attention_heads) for layer in per)  # fmt: skip
    if not (layers and heads):
        return ()
    kv = kv_heads or heads
    return ((heads, kv, head_dim or c.hidden_size // heads),) * layers
