"""Load a Hugging Face causal LM ready for packed training, or build a tiny one from a config.

    model = load_model("tiny-qwen3")                       # random init, CPU tests
    model = load_model("meta-llama/Llama-3.2-1B", dtype="bfloat16")
    model = load_model(name, attention="sdpa")             # for padded batches

Every model comes back with a raypack varlen attention (see `attention.py`) unless `attention`
is `sdpa`/`eager`, which the caller picks for padded batches (the training loop asks the packed
data, `Prepared.padded`; this module knows no packing strategy), and with `use_cache=False`:
with the cache on, transformers stops finding example boundaries in position_ids and examples
leak into each other. A model that can't train exactly on packed rows with the chosen backend
is refused (`traits.check_packable`): by `check_model` on the driver before any data or worker
work (a meta-device build, no weights), and again by `load_model` on the worker, which knows
its device and whether flash-attn is installed.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import transformers
from huggingface_hub import constants, get_session
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from raypack import storage
from raypack.errors import InputError
from raypack.model import attention as attn
from raypack.model import checkpointing, mixers, vision
from raypack.model.facts import ModelFacts, describe, meta_model, remember, text_config
from raypack.model.traits import UnsupportedModelError, check_packable, decoder

__all__ = [
    "ModelNotFoundError", "UnsupportedModelError", "check_model", "check_packable", "from_checkpoint", "load_model",
    "meta_model",
    "model_config", "model_vocab_size", "resolve_dtype", "tiny_config",
]  # fmt: skip

_TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
_TINY_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
# special ids are the bundled tokenizer's (768 tokens): pad_token_id becomes the embedding's
# padding_idx, whose row never trains, so it must not be a real token such as BOS.
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # hybrids (raypack/model/mixers.py): one mixer layer, one attention layer
    "qwen3_5": ("Qwen3_5TextConfig", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                      **_TINY_GDN}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                             "shared_expert_intermediate_size": 32, **_TINY_GDN}),
    "nemotron_h": ("NemotronHConfig", {"head_dim": 16, "layers_block_type": ["mamba", "attention"],
                                       "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                                       "chunk_size": 64, "num_hidden_layers": None}),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
    "kimi_linear": ("KimiLinearConfig", {"head_dim": None, "layer_types": ["linear_attention", "full_attention"],
                                         "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 4,
                                         "linear_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
}
"""`tiny-<family>`: config class and what it needs beyond the shared tiny sizes."""


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
    kwargs = {**_TINY_COMMON, **extra, "vocab_size": vocab_size, **overrides}
    return getattr(transformers, cls_name)(**{k: v for k, v in kwargs.items() if v is not None})


def _device_type() -> str:
    """Where a model loaded here will run: the worker's accelerator if it has one (as `dtype='auto'`)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_config(name: str, trust_remote_code: bool = False, vocab_size: int = 1024) -> PretrainedConfig:
    """The config `load_model(name)` builds from, without the weights: `tiny-<family>`'s, or a
    local folder's or hub model's config.json. What the driver checks before training starts."""
    if name in vision.TINY_VLMS:  # sized by the bundled processor, not `vocab_size`
        return vision.tiny_config(name)
    if name.startswith("tiny-"):
        try:
            return tiny_config(name.removeprefix("tiny-"), vocab_size=vocab_size)
        except ValueError as e:
            raise ModelNotFoundError(f"model.name {name!r}: {e}") from None
    # Only a hub name needs the hub. Offline, or where the hub doesn't answer, look in the local
    # cache alone: asked for a file it can't fetch and hasn't cached, huggingface_hub retries five
    # times with backoff (~50 s, 11 log lines) and has no setting that turns the retries off.
    local = os.path.exists(name)
    if not local and not storage.is_repo_id(name):
        raise ModelNotFoundError(f"model.name {name!r}: no such folder, and not a hub name (org/model)")
    unreachable = None if local else _hub_unreachable()
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code,
                                          local_files_only=unreachable is not None)
    except (OSError, ValueError) as e:  # no such folder or hub repo, no network, not a model
        if unreachable is not None and isinstance(e, OSError):
            raise ModelNotFoundError(f"model.name {name!r}: not a local folder, not in the Hugging Face cache "
                                     f"({constants.HF_HUB_CACHE}), and {unreachable}") from e
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"model.name {name!r}: can't load its config ({reason})") from e


def _hub_unreachable() -> str | None:
    """Why the hub can't be asked for a model config, or None when it answers: one request, no
    retries, within huggingface_hub's own metadata timeout (HF_HUB_ETAG_TIMEOUT)."""
    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set, so the hub is not asked"
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    # Any answer, whatever its status, means the hub is reachable; what fails here is the hub
    # client's transport (its exception types change with huggingface_hub's HTTP library).
    except Exception as e:
        why = str(e).strip() or type(e).__name__
        return (f"the hub ({constants.ENDPOINT}) can't be reached ({why}); "
                "with HF_HUB_OFFLINE=1 an unreachable hub fails at once, without a request")
    return None


def model_vocab_size(config: PretrainedConfig) -> int:
    """Rows of the input embedding: every token id must be below it."""
    return int(text_config(config).vocab_size)


def _attn_implementation(attention: str) -> str:
    return attention if attention in ("sdpa", "eager") else attn.attn_implementation_name(attention)


def _on_meta() -> bool:
    """Whether the model is being built under `torch.device("meta")`: structure, no weights."""
    return torch.get_default_device().type == "meta"


def from_checkpoint(name: str) -> bool:
    """Whether `load_model(name)` loads weights (a hub name or folder), not a random init (`tiny-<family>`)."""
    return not name.startswith("tiny-")


def _config(source: str | PretrainedConfig, trust_remote_code: bool, vocab_size: int) -> tuple[Any, str, bool]:
    """(config, name for messages, whether weights come from a checkpoint)."""
    if isinstance(source, PretrainedConfig):
        # transformers 5 writes attn_implementation into the config it is given: never share one
        return copy.deepcopy(source), type(source).__name__, False
    if isinstance(source, str):
        return model_config(source, trust_remote_code, vocab_size), source, from_checkpoint(source)
    raise TypeError(f"load_model: expected a name, path or transformers config, got {type(source).__name__}")


def check_model(
    name_or_config: str | PretrainedConfig,
    attention: str = "auto",
    device_type: str = "cpu",
    trust_remote_code: bool = False,
    max_row_tokens: int | None = None,
    vocab_size: int = 1024,
    *,
    name: str | None = None,
    packed: bool = True,
    split: int = 1,
    compiled: bool = False,
) -> None:
    """Refuse, before any data or worker work, a model that is not a causal LM transformers knows
    here (remote code is checked once built), or, if `packed`, one that can't train exactly on
    packed rows with `attention` on `device_type` (`sdpa` means transformers' own attention over
    packed position_ids: only the model-wide traits apply). Builds the model on the meta device:
    no weights, a few seconds for 70B. `max_row_tokens` is the longest packed row, if known;
    `name` names the model in errors (default: its name, or its config's class); `split`: the
    train.sequence_parallel its heads must divide by; `compiled`: train.compile."""
    config, default_name, _ = _config(name_or_config, trust_remote_code, vocab_size)
    name = name or default_name
    # the description of the config given, whose meta model the driver's other checks share
    facts = describe(name_or_config if isinstance(name_or_config, PretrainedConfig) else config, trust_remote_code)
    if facts.vlm:
        if packed:
            backends = () if attention in ("sdpa", "eager") else attn.candidate_backends(attention, device_type)
            vision.check_vlm_packable(facts.meta_model(), name, backends=backends)
        return
    if MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) is None and not getattr(config, "auto_map", None):
        raise UnsupportedModelError(f"model.name {name!r}: {type(config).__name__} is not a causal language model here"
                                    f"{vision.training_refusal(config)}")  # fmt: skip
    if not packed and (device_type == "cuda" or not mixers.gpu_only_installed()):
        return
    model = facts.meta_model()
    mixers.refuse_gpu_only_kernels(model, name, device_type)  # padded or packed: transformers' own call
    if not packed:
        return
    backends = () if attention in ("sdpa", "eager") else attn.candidate_backends(attention, device_type)
    check_packable(model, name, backends, max_row_tokens=max_row_tokens, split=split, compiled=compiled)


def load_model(
    name_or_config: str | PretrainedConfig,
    attention: str = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    gradient_checkpointing: str | bool = "none",
    vocab_size: int = 1024,
    quantization: Any = None,
    facts: ModelFacts | None = None,
    **config_overrides: Any,
):
    """A causal LM for packed training. Accepts a hub name or local path, `tiny-<family>` or a
    transformers config (random init). `attention` is `auto`, one of `attention.BACKENDS`, or
    `sdpa`/`eager` for padded batches; `gradient_checkpointing` one of checkpointing.MODES (True:
    full, False: none). `vocab_size` only sizes tiny models; `quantization` is a
    transformers quantization config for a checkpoint's weights (QLoRA: `adapters.quantization_config`);
    `config_overrides` are set on the config before the model is built; `facts`: the description
    of the config it builds from (raypack/model/facts.py), where the caller has one: its config is
    not read again, nor its meta-device structure built again."""
    source = name_or_config
    torch_dtype = resolve_dtype(dtype)
    impl = _attn_implementation(attention)
    mixers.quiet_fallback_warnings()  # the start line says which path the mixers take, once

    if facts is not None and isinstance(source, str):
        config, name, pretrained = copy.deepcopy(facts.config), source, from_checkpoint(source)
    else:
        config, name, pretrained = _config(source, trust_remote_code, vocab_size)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    config.use_cache = False
    if facts is None or config_overrides or not isinstance(source, str):
        facts = describe(config, trust_remote_code)

    packed = impl in attn.BACKEND_OF
    zero3 = is_deepspeed_zero3_enabled()
    if pretrained and _on_meta():
        # FSDP2's ranks > 0 (torch_engine.building): the structure alone, which rank 0's weights
        # fill after sharding; transformers refuses from_pretrained under a meta device
        pretrained, source = False, config
    if facts.vlm:
        if quantization is not None:
            raise InputError(f"model.name {name!r}: QLoRA on a vision-language model is not supported yet")
        model = vision.load_vlm(source if pretrained else config, attention, torch_dtype, trust_remote_code,
                                name=name, check=packed)  # fmt: skip
        return _ready(model, gradient_checkpointing, facts)
    if packed and not zero3:
        # refuse before building or reading a checkpoint; under ZeRO-3 a meta build would fight
        # zero.Init, so the built model is checked instead (the driver's check_model ran already)
        check_packable(facts.meta_model(), name, attn.candidate_backends(attention, _device_type()))
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_cls is not None and impl == "sdpa" and not getattr(model_cls, "_supports_sdpa", False):
        impl = "eager"  # older architectures (Bloom, ...): padded batches still train
    common = dict(attn_implementation=impl, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if quantization is not None:
        if not pretrained:
            raise InputError(f"model.name {name!r}: quantized (QLoRA) base weights need a checkpoint to quantize, "
                             "not a model built from a config")
        # bitsandbytes quantizes as the weights reach the GPU: load them straight onto this rank's device
        common.update(quantization_config=quantization, device_map={"": torch.cuda.current_device()})
    # A class that doesn't declare `_supports_attention_backend` gets the name after it is built
    # (transformers refuses it at build); only hybrids whose attention layers all route through
    # the interface pass check_packable (traits.late_attention), before or, under ZeRO-3, after.
    late = packed and model_cls is not None and not getattr(model_cls, "_supports_attention_backend", False)
    if late:
        common["attn_implementation"] = "eager"
    if pretrained:
        # packed: the layers raypack checks, not hub kernels transformers would swap in (mixer_kernels)
        model = AutoModelForCausalLM.from_pretrained(source, config=config, **common,
                                                     **(mixers.HUB_KERNELS_OFF if packed else {}))
    else:
        model = AutoModelForCausalLM.from_config(config, **common)
    if late:
        model.config._attn_implementation = impl  # sets the sub-configs' too; layers read it per call
    mixers.refuse_gpu_only_kernels(model, name, _device_type())
    if packed and zero3:
        check_packable(model, name, attn.candidate_backends(attention, _device_type()))
    if packed:
        attn.refuse_padding_masks(model)
        # convolutions and recurrences keep a packed row's examples apart (mixers.py)
        mixers.install(decoder(model))
    # output_router_logits changes nothing here: the training loop reads the routers' scores with
    # its own hooks and adds their load-balancing loss itself, exact per example
    # (train.router_aux_loss_coef, raypack/train/objectives/router_loss.py).
    model = _ready(model, gradient_checkpointing, facts)
    if packed:
        mixers.check_kept(model, name)  # after train(), at which transformers would kernelize again
    return model


def _ready(model, gradient_checkpointing: str | bool, facts: ModelFacts):
    """Cache off, train mode, checkpointing as asked, its description kept: how every loaded
    model leaves load_model."""
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False
    # from_pretrained returns a model in eval mode: dropout off, and transformers skips gradient
    # checkpointing unless `training`; nothing else would switch it back before the first eval.
    model.train()
    if isinstance(gradient_checkpointing, bool):
        gradient_checkpointing = "full" if gradient_checkpointing else "none"
    checkpointing.enable(model, gradient_checkpointing)
    remember(model.config, facts)
    return model
