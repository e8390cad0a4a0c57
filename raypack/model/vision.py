"""Vision-language models on packed rows: what makes a packed row of image+text examples exact.

A packed VLM row is the text of several examples, one after another, with each image's
placeholder tokens in its example's text; the images themselves travel beside the row in
example order (`raypack.data.vision_collate`):

    input_ids      t t S I I I I E t t | t S I I I I I I E t      S/E: vision start/end, I: image tokens
    position_ids   0 1 2 3 4 5 6 7 8 9 | 0 1 2 3 4 5 6 7 8 9      row 0: text position, restarts per example
    (mRoPE row 1)  0 1 2 3 3 3 3 5 6 7 | 0 1 2 2 2 2 2 2 5 6      rows 1-3: each example's own get_rope_index
    images         [img a]               [img b]                     concatenated in example order

Three things keep it exact, each checked in tests/unit/model/test_vision.py against every
example run alone through the model's own forward (which builds its own positions):

- Language side: raypack's varlen attention keeps examples apart through `cu_seq_lens_q`, found
  from row 0. For mRoPE models (Qwen2/2.5/3-VL, GLM-4.1V) rows 1-3 are what the model's own
  `get_rope_index` gives for the example alone (`example_positions`); transformers reads a
  4-row `position_ids` as exactly that (row 0 for the boundaries, rows 1-3 for the rotary).
- Vision side: the tower attends within one image. Qwen's grid towers (Qwen2/2.5/3-VL) run from
  a host plan (`vision_tower`): what they derive from the grid is computed in the collate by
  transformers' own helpers, and each block's attention is one bidirectional varlen call over
  the tower's own per-image (or per-window) offsets, never the row's `cu_seq_lens_q`, which
  transformers keeps out of the tower. A tower the plan doesn't fit (GLM-4.1V) keeps
  transformers' own `sdpa`, split per image; CLIP/SigLIP towers take images as a batch.
- Features to placeholders: the model scatters image features onto placeholder tokens in order,
  and images are concatenated in the order their examples are, so each lands on its own example.

Refused (`check_vlm_packable`), naming the trait: a model whose forward takes `token_type_ids`
(Gemma 3, PaliGemma), which it uses to let image tokens attend to each other bidirectionally, a
mask a causal varlen kernel can't apply; and every trait `traits.check_packable` refuses in the
language model. The padded strategies still train both.
"""

from __future__ import annotations

import copy
import inspect
import logging

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig

from raypack.model import attention as attn
from raypack.model.facts import TOWERS, is_vlm, trains_as_vlm, vlm_class  # noqa: F401 (their old home)
from raypack.model.facts import inner as _inner
from raypack.model.traits import PADDED, UnsupportedModelError, check_packable

VISION_ATTENTION = "sdpa"
"""The vision tower's attention as transformers loads it: its own, per image; a grid tower that
takes a host plan is switched to raypack's tower attention after loading (`install_tower`)."""


def training_refusal(config: PretrainedConfig) -> str:
    """What to add to the refusal of a model raypack train can't load, where it is a VLM that
    transformers has no image-text-to-text class for (those raypack trains: `vlm_class`)."""
    if not is_vlm(config):
        return ""
    return (": it is a vision-language model without an AutoModelForImageTextToText class, the kind raypack "
            "trains images with (docs/guides/vision.md)")


TINY_VLMS = {"tiny-qwen2_5_vl": "vlm_processor", "tiny-llava": "llava_processor", "tiny-idefics3": "idefics3_processor"}
"""`model.name`s of tiny VLMs built from a config (random init), each sized by its bundled
processor (raypack/assets/<folder>, which `tokenize.tokenizer` must then name): a Qwen2.5-VL
(grid processor, mRoPE), a LLaVA (a CLIP tower and projector on a Llama, whole pictures) and an
Idefics3 (a SigLIP-like tower, pixel shuffle and connector on a Llama, tiles)."""


def tiny_config(name: str) -> PretrainedConfig:
    """The config of a TINY_VLMS name, sized by its bundled processor (LlavaProcessor and
    Idefics3Processor load without torchvision; Qwen's folder as its image processor and tokenizer)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from raypack.config import ASSETS

    if name not in TINY_VLMS:
        raise ValueError(f"unknown tiny VLM {name!r}; expected one of {', '.join(TINY_VLMS)}")
    folder = ASSETS / TINY_VLMS[name]
    if name == "tiny-llava":
        return tiny_llava_config(AutoProcessor.from_pretrained(folder))
    if name == "tiny-idefics3":
        return tiny_idefics3_config(AutoProcessor.from_pretrained(folder))
    return tiny_vlm_config(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))


def load_vlm(source, attention: str, dtype: torch.dtype, trust_remote_code: bool = False, name: str = "",
             check: bool = True):
    """A VLM for training (`build.load_model`'s VLM branch): built from a config (`source` a
    PretrainedConfig) or loaded from a checkpoint (a name or folder), raypack's attention in the
    language model unless `attention` is sdpa/eager (padded batches), refused where packing it
    isn't exact (`check`), with padding masks refused and token mixers kept exact as for text models."""
    from raypack.model import mixers
    from raypack.model.traits import decoder

    packed = attention not in ("sdpa", "eager")
    if isinstance(source, PretrainedConfig):
        model = build_vlm(source, attention, dtype, check=False)
    else:
        # packed: the layers raypack checks, not hub kernels transformers would swap in (mixer_kernels)
        model = AutoModelForImageTextToText.from_pretrained(
            source, attn_implementation=attn_implementation(AutoConfig.from_pretrained(source), attention),
            dtype=dtype, trust_remote_code=trust_remote_code, **(mixers.HUB_KERNELS_OFF if packed else {}))  # fmt: skip
    if packed and check:
        check_vlm_packable(model, name or type(model.config).__name__, attention)
    if packed:
        attn.refuse_padding_masks(model)
        mixers.install(decoder(model))
        install_tower(model)
    return model


def attn_implementation(config: PretrainedConfig, attention: str) -> dict[str, str]:
    """transformers' per-sub-config attention: raypack's (or `sdpa`/`eager`, padded) for the
    language model, the tower's own for the vision tower."""
    text = attention if attention in ("sdpa", "eager") else attn.attn_implementation_name(attention)
    vision = "eager" if attention == "eager" else VISION_ATTENTION
    return {"": text, "text_config": text, "vision_config": vision}


def build_vlm(config: PretrainedConfig, attention: str = "sdpa_varlen", dtype: torch.dtype = torch.float32,
              check: bool = True):
    """A VLM from `config` (random init): raypack's attention in the language model when
    `attention` is one of its backends (refusing what can't pack unless `check` is False, for
    tests that show a refusal is needed), `sdpa`/`eager` otherwise."""
    config = copy.deepcopy(config)  # from_config writes the attention choice into it
    config.use_cache = False
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation(config, attention),
                                                    dtype=dtype)  # fmt: skip
    if check and attention not in ("sdpa", "eager"):
        check_vlm_packable(model, type(config).__name__, attention)
    if attention not in ("sdpa", "eager"):
        install_tower(model)
    model.config.use_cache = False
    return model


def install_tower(model: torch.nn.Module) -> None:
    """A packed run's grid tower from host plans and one varlen call a block, where it can
    (raypack/model/vision_tower.py); else transformers' sdpa per image, said once."""
    from raypack.model import vision_tower

    refusal = vision_tower.install(model)
    if refusal is not None:
        logging.getLogger(__name__).info("vision tower on transformers' sdpa, one call an image: %s", refusal)


def check_vlm_packable(model: torch.nn.Module, name: str, attention: str = "sdpa_varlen",
                       backends: tuple[str, ...] | None = None) -> None:
    """Raise UnsupportedModelError unless a packed row of image+text examples trains `model`
    exactly: no bidirectional image-token mask, and a language model `check_packable` accepts
    (with `backends`, the attention backends it may run; default: `attention`'s on the CPU)."""
    params = inspect.signature(type(model).forward).parameters
    if "token_type_ids" in params:
        raise UnsupportedModelError(
            f"{name} ({type(model).__name__}) can't train on packed rows: its forward takes token_type_ids, which it "
            "uses to let an image's tokens attend to each other bidirectionally, a mask raypack's causal varlen "
            f"attention can't apply. Use a padded strategy instead ({PADDED}), which trains it with its own mask."
        )
    check_packable(model, name, attn.candidate_backends(attention, "cpu") if backends is None else backends)


def uses_mrope(model: torch.nn.Module) -> bool:
    """Positions with temporal/height/width rows for image tokens (Qwen2/2.5/3-VL): `get_rope_index`.
    A config with an mrope_section whose model shows no get_rope_index is refused: text positions
    would train it silently wrong."""
    found = callable(getattr(_inner(model), "get_rope_index", None))
    text = model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not found and isinstance(rope, dict) and rope.get("mrope_section"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config has multimodal rotary positions (mrope_section) but raypack finds no "
            f"get_rope_index to build them per example; use a padded strategy ({PADDED})"
        )
    return found


def image_token_id(config: PretrainedConfig) -> int:
    """The id of the token each image's features replace."""
    image = getattr(config, "image_token_id", None)
    return config.image_token_index if image is None else image


def token_types(config: PretrainedConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image tokens (what `get_rope_index` reads as mm_token_type_ids)."""
    return (input_ids == image_token_id(config)).to(torch.int32)


def example_positions(model: torch.nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None):
    """Positions for one example alone (`input_ids` 1-D): (4, n) for mRoPE models, row 0 the text
    position 0..n-1 and rows 1-3 the model's own `get_rope_index`; else (n,) text positions."""
    n = input_ids.shape[0]
    text = torch.arange(n, dtype=torch.long)
    if not uses_mrope(model):
        return text
    if image_grid_thw is None or len(image_grid_thw) == 0:
        rope = text.expand(3, -1)  # what get_rope_index gives text alone: the text position thrice
    else:
        ids = input_ids[None].cpu()
        with torch.no_grad():
            rope, _ = _inner(model).get_rope_index(ids, mm_token_type_ids=token_types(model.config, ids),
                                                   image_grid_thw=image_grid_thw.cpu())  # fmt: skip
        rope = rope[:, 0].long()
    return torch.cat([text[None], rope], 0)


TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=0.1,
                 rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})  # fmt: skip
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, in_channels=3,
                   window_size=16, fullatt_block_indexes=[1], initializer_range=0.1)  # fmt: skip


def tiny_vlm_config(image_processor, tokenizer) -> PretrainedConfig:
    """A tiny Qwen2.5-VL config that fits `image_processor` (patch, temporal patch and merge sizes)
    and `tokenizer` (vocabulary, image and vision start/end tokens): the bundled processor's
    model (raypack/assets/vlm_processor), random weights, for tests and the CPU quickstart."""
    from transformers import Qwen2_5_VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}  # fmt: skip
    missing = [k for k, v in ids.items() if v is None or v == tokenizer.unk_token_id]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens for {', '.join(missing)}")
    text = {**TINY_TEXT, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    vision = {**TINY_VISION, "patch_size": image_processor.patch_size, "spatial_merge_size": image_processor.merge_size,
              "temporal_patch_size": image_processor.temporal_patch_size}  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def tiny_llava_config(processor) -> PretrainedConfig:
    """A tiny LLaVA config (a CLIP tower, a 2-layer GELU projector, a Llama) that fits a
    LlavaProcessor: its picture size (crop), patch size, feature selection, image token and
    tokenizer; the bundled LLaVA processor's model (raypack/assets/llava_processor)."""
    from transformers import LlavaConfig

    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    image = tokenizer.convert_tokens_to_ids(processor.image_token)
    text = {key: v for key, v in TINY_TEXT.items() if key != "rope_parameters"}
    text.update(model_type="llama", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    side = image_processor.crop_size["height"]
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=side, patch_size=processor.patch_size, projection_dim=32,
                  initializer_range=0.1)  # fmt: skip
    # the last layer's features, so every tower weight but the unused post-layernorm trains
    return LlavaConfig(text_config=text, vision_config=vision, image_token_id=image, vision_feature_layer=-1,
                       vision_feature_select_strategy=processor.vision_feature_select_strategy,
                       projector_hidden_act="gelu")  # fmt: skip


def tiny_idefics3_config(processor) -> PretrainedConfig:
    """A tiny Idefics3 config whose tiles (the image processor's max_image_size, 4-pixel patches,
    pixel shuffle by 2) give an Idefics3Processor's image_seq_len tokens: the bundled Idefics3
    processor's model (raypack/assets/idefics3_processor)."""
    from transformers import Idefics3Config

    tokenizer = processor.tokenizer
    side, patch, scale = processor.image_processor.max_image_size["longest_edge"], 4, 2
    if (side // patch) ** 2 // scale**2 != processor.image_seq_len:
        raise ValueError(f"image_seq_len {processor.image_seq_len} doesn't fit {side}-pixel tiles of {patch}-pixel "
                         f"patches shuffled by {scale}")
    text = {key: v for key, v in TINY_TEXT.items() if key != "rope_parameters"}
    text.update(model_type="llama", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=side, patch_size=patch, initializer_range=0.1)  # fmt: skip
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=scale,
                          image_token_id=processor.image_token_id)  # fmt: skip


def vlm_model_class(config: PretrainedConfig) -> type:
    """The class AutoModelForImageTextToText builds for `config` (no weights, no model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


PROJECTORS = ("merger", "multi_modal_projector", "connector")
"""Where they keep the projector: inside the tower (Qwen's merger) or beside it."""
FREEZABLE = ("vision", "projector")
"""The parts `freeze` takes (model.freeze's values)."""


def parts(model: torch.nn.Module) -> dict[str, list[str]]:
    """Parameter names of the vision tower (without the projector) and of the projector."""
    inner = _inner(model)
    prefix = "" if inner is model else "model."
    out: dict[str, list[str]] = {"vision": [], "projector": []}
    found = [t for t in TOWERS if isinstance(getattr(inner, t, None), torch.nn.Module)]
    for name, _ in model.named_parameters():
        bare = name.removeprefix("base_model.model.").removeprefix(prefix)
        if any(bare.startswith(f"{t}.merger.") or bare.startswith(f"{p}.") for t in found for p in PROJECTORS):
            out["projector"].append(name)
        elif any(bare.startswith(f"{t}.") for t in found):
            out["vision"].append(name)
    if not found or not out["projector"]:
        raise UnsupportedModelError(f"{type(model).__name__}: no vision tower ({', '.join(TOWERS)}) or projector "
                                    f"({', '.join(PROJECTORS)}) found to freeze")  # fmt: skip
    return out


def freeze(model: torch.nn.Module, what: tuple[str, ...]) -> list[str]:
    """Stop training the vision tower and/or the projector (`what` from FREEZABLE); returns the
    names frozen. A frozen part still runs in the forward and passes gradients through to
    what is before it; its own weights get none."""
    unknown = sorted(set(what) - set(FREEZABLE))
    if unknown:
        raise ValueError(f"model.freeze: unknown part(s) {unknown}; expected some of {', '.join(FREEZABLE)}")
    found = parts(model)
    names = {n for w in what for n in found[w]}
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return sorted(names)


class ProcessorParts:
    """A VLM's tokenizer, image processor and the processor's own settings (processor_config.json:
    LLaVA's patch size and image token), saved together where a trained model's folder is written
    (the training loop's final `model/`), so AutoTokenizer and AutoImageProcessor load it (and
    AutoProcessor where transformers builds the processor without torchvision: LLaVA's)."""

    def __init__(self, tokenizer, image_processor, settings: dict | None = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        # the image processor is saved on its own (preprocessor_config.json), not nested here
        self.settings = {k: v for k, v in (settings or {}).items() if k != "image_processor"}

    def __len__(self) -> int:  # the vocabulary, as a tokenizer's (what sizes the embeddings)
        return len(self.tokenizer)

    def save_pretrained(self, folder) -> None:
        import json
        from pathlib import Path

        from transformers.utils import PROCESSOR_NAME

        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)
        if self.settings:
            (Path(folder) / PROCESSOR_NAME).write_text(json.dumps(self.settings, indent=2, sort_keys=True) + "\n")


def save_vlm(model: torch.nn.Module, folder, image_processor, tokenizer, settings: dict | None = None) -> None:
    """Write a trained VLM where transformers loads it back: the weights (LoRA merged into them;
    transformers doesn't save the attention choice, so raypack's never leaks into the folder) and
    the processor's parts: tokenizer, chat template, image processor and the processor's settings
    (`ProcessorParts`). AutoModelForImageTextToText, AutoTokenizer and AutoImageProcessor load the
    folder (AutoProcessor too, for Qwen's processors only where torchvision is installed:
    docs/guides/vision.md)."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    ProcessorParts(tokenizer, image_processor, settings).save_pretrained(folder)
