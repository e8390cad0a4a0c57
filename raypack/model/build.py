"""Load a Hugging Face causal LM ready for packed training, or build a tiny one from a config.

    model = load_model("tiny-qwen3")                       # random init, CPU tests
    model = load_model("meta-llama/Llama-3.2-1B", dtype="bfloat16")
    model = load_model(name, attention="sdpa")             # for padded batches

Every model comes back with a raypack varlen attention (see `attention.py`) unless `attention`
is `sdpa`/`eager`, which the caller picks for padded batches (the training loop asks the packed
data, `Prepared.padded`; this module knows no packing strategy), and with `use_cache=False`:
with the cache on, transformers stops finding example boundaries in position_ids and examples
leak into each other.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from raypack.config import InputError
from raypack.model import attention as attn

_TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
# special ids are the bundled tokenizer's (768 tokens): pad_token_id becomes the embedding's
# padding_idx, whose row never trains, so it must not be a real token such as BOS.
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
}
"""`tiny-<family>`: config class and what it needs beyond the shared tiny sizes."""


class UnsupportedModelError(InputError):
    """The model cannot run packed (varlen) attention; padded strategies still work."""


class ModelNotFoundError(InputError):
    """`model.name` resolves to no model config: not a tiny family, a local folder or a hub name."""


def resolve_dtype(dtype: str | torch.dtype = "auto") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


def tiny_config(family: str, vocab_size: int = 1024, **overrides: Any):
    """A small random-init config of `family` (hidden 64, 2 layers, 4 heads, 2 kv heads)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {', '.join(TINY_FAMILIES)}")
    cls_name, extra = TINY_FAMILIES[family]
    return getattr(transformers, cls_name)(**{**_TINY_COMMON, **extra, "vocab_size": vocab_size, **overrides})


def model_config(name: str, trust_remote_code: bool = False, vocab_size: int = 1024) -> PretrainedConfig:
    """The config `load_model(name)` builds from, without the weights: `tiny-<family>`'s, or a
    local folder's or hub model's config.json. What the driver checks before training starts."""
    if name.startswith("tiny-"):
        try:
            return tiny_config(name.removeprefix("tiny-"), vocab_size=vocab_size)
        except ValueError as e:
            raise ModelNotFoundError(f"model.name {name!r}: {e}") from None
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # no such folder or hub repo, no network, not a model
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"model.name {name!r}: can't load its config ({reason})") from e


def check_model(config: PretrainedConfig, name: str, packed: bool) -> None:
    """What can be known of a model from its config alone, before any worker loads it: that its
    architecture is a causal LM transformers knows here (remote code is checked once built), and,
    for packed rows, that its attention can be routed to raypack's varlen attention."""
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_cls is None and not getattr(config, "auto_map", None):
        raise UnsupportedModelError(f"model.name {name!r}: {type(config).__name__} is not a causal language model here")
    if model_cls is not None and packed:
        check_packable(model_cls, name)


def model_vocab_size(config: PretrainedConfig) -> int:
    """Rows of the input embedding: every token id must be below it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def check_packable(model_cls: type, name: str) -> None:
    """Refuse, naming the model, a class whose attention transformers can't route to raypack."""
    reasons = []
    if not getattr(model_cls, "_supports_attention_backend", False):
        reasons.append("transformers can't route its attention through AttentionInterface")
    if "position_ids" not in inspect.signature(model_cls.forward).parameters:
        reasons.append("its forward takes no position_ids")
    if reasons:
        raise UnsupportedModelError(
            f"{name} ({model_cls.__name__}) can't train on packed rows: {'; '.join(reasons)}. "
            "Use a padded strategy instead (pad or pad_sorted), whose batches load it with attention='sdpa'."
        )


def _attn_implementation(attention: str) -> str:
    return attention if attention in ("sdpa", "eager") else attn.attn_implementation_name(attention)


def load_model(
    name_or_config: str | PretrainedConfig,
    attention: str = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    vocab_size: int = 1024,
    **config_overrides: Any,
):
    """A causal LM for packed training. Accepts a hub name or local path, `tiny-<family>` or a
    transformers config (random init). `attention` is `auto`, one of `attention.BACKENDS`, or
    `sdpa`/`eager` for padded batches. `vocab_size` only sizes tiny models; `config_overrides` are
    set on the config before the model is built."""
    source = name_or_config
    torch_dtype = resolve_dtype(dtype)
    impl = _attn_implementation(attention)

    pretrained = False
    if isinstance(source, PretrainedConfig):
        # transformers 5 writes attn_implementation into the config it is given: never share one
        config, name = copy.deepcopy(source), type(source).__name__
    elif isinstance(source, str):
        config, name = model_config(source, trust_remote_code, vocab_size), source
        pretrained = not source.startswith("tiny-")
    else:
        raise TypeError(f"load_model: expected a name, path or transformers config, got {type(source).__name__}")
    for key, value in config_overrides.items():
        setattr(config, key, value)
    config.use_cache = False

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_cls is not None and impl.startswith("raypack_"):
        check_packable(model_cls, name)
    if model_cls is not None and impl == "sdpa" and not getattr(model_cls, "_supports_sdpa", False):
        impl = "eager"  # older architectures (Bloom, ...): padded batches still train
    common = dict(attn_implementation=impl, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if pretrained:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, **common)
    else:
        model = AutoModelForCausalLM.from_config(config, **common)
    if model_cls is None and impl.startswith("raypack_"):  # remote code: only known once built
        check_packable(type(model), name)
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False
    # from_pretrained returns a model in eval mode: dropout off, and transformers skips gradient
    # checkpointing unless `training`; nothing else would switch it back before the first eval.
    model.train()
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
