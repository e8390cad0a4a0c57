"""What an image becomes for the model: the tower's pixels and the image tokens in the text, by
the image processor's traits (what it gives), never by the model's name.

    grid      gives image_grid_thw (Qwen2/2.5/3-VL, GLM-4.1V): dynamic resolution, flat patches;
              an image is t*h*w / merge_size² tokens, as Qwen2VLProcessor expands it
    pictures  gives pixel_values alone (CLIP, SigLIP, LLaVA's image processors): one picture of
              the processor's fixed size, (C, H, W), each its own batch element in the tower;
              an image is (H/patch)*(W/patch) tokens, plus the tower's extra ones (CLS) and less
              the one the model drops (vision_feature_select_strategy `default`), as
              LlavaProcessor counts them from its settings (processor_config.json)
    tiles     gives pixel_attention_mask and splits images (Idefics3, SmolVLM): an image is
              rows x cols tiles and the whole picture, each tile of the processor's one size and
              its own batch element in the tower, (1, tiles, C, S, S) an example; its text is
              transformers' own prompt string (get_image_prompt_string): a fake token around each
              tile, its <row_i_col_j>, and image_seq_len image tokens a tile

Anything else is refused when the data is tokenized, naming what the processor gives beyond
pixels: image_sizes (LLaVA-NeXT's any-resolution crops, Pixtral's own sizes), num_crops,
spatial_shapes (Siglip2), tiles without do_image_splitting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transformers.utils import PROCESSOR_NAME as SETTINGS_FILE  # processor_config.json: the processor's own settings

from raypack.errors import InputError

MODEL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask")
"""What a layout's pixels hold that the model takes (tiles' rows and cols are for the text)."""
SPLITS = ("do_image_splitting", "crop_to_patches", "do_pan_and_scan", "image_grid_pinpoints", "max_image_tiles")
"""Image-processor settings that cut one image into several tower inputs when set."""


def processor_settings(name: str) -> dict[str, Any]:
    """The processor's settings (processor_config.json) of a processor folder or hub name; {}
    where it has none (Qwen's folders need none: their counts come from the grids)."""
    from transformers.utils import cached_file

    try:
        path = cached_file(os.path.expanduser(str(name)), SETTINGS_FILE, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)  # fmt: skip
    except OSError:
        return {}
    if path is None:
        return {}
    with open(path) as f:
        return json.load(f)


class GridImages:
    """Qwen-style processors: patches (n_patches, D) and a (t, h, w) grid per image."""

    inputs = ("image_grid_thw",)
    """The model inputs beside pixel_values (what the model's forward must take)."""
    token = "<|image_pad|>"
    """The image token where the processor names none (Qwen2VLProcessor's)."""

    def __init__(self, image_processor):
        self.image_processor = image_processor

    def pixels(self, images: Sequence) -> dict[str, np.ndarray]:
        out = self.image_processor(images=list(images), return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"], np.float32),
                "image_grid_thw": np.asarray(out["image_grid_thw"], np.int64)}  # fmt: skip

    def token_counts(self, pixels: Mapping[str, np.ndarray]) -> list[int]:
        """Each image's patches (t * h * w) merged merge_size² to one."""
        return [int(np.prod(g)) // self.image_processor.merge_size**2 for g in pixels["image_grid_thw"]]

    def patches(self, pixels: Mapping[str, np.ndarray]) -> int:
        return int(pixels["pixel_values"].shape[0])

    def stored(self, pixels: Mapping[str, np.ndarray]) -> list[list[int]]:
        """What the prepared data keeps to check the pixels against later (`image_grid_thw`)."""
        return pixels["image_grid_thw"].tolist()


class PictureImages:
    """CLIP/SigLIP-style processors: one (C, H, W) picture per image, a fixed token count."""

    inputs = ()
    token = "<image>"  # LlavaProcessor's

    def __init__(self, image_processor, settings: Mapping[str, Any]):
        self.image_processor = image_processor
        self.patch_size = int(settings["patch_size"])
        self.extra = int(settings.get("num_additional_image_tokens") or 0)
        self.drops_cls = settings.get("vision_feature_select_strategy") == "default"

    def pixels(self, images: Sequence) -> dict[str, np.ndarray]:
        out = self.image_processor(images=list(images), return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"], np.float32)}

    def token_counts(self, pixels: Mapping[str, np.ndarray]) -> list[int]:
        """LlavaProcessor's count: the picture's patches, + the tower's extra tokens, - the CLS the
        model drops under `default` feature selection."""
        h, w = pixels["pixel_values"].shape[-2:]
        n = (h // self.patch_size) * (w // self.patch_size) + self.extra - self.drops_cls
        return [n] * len(pixels["pixel_values"])

    def patches(self, pixels: Mapping[str, np.ndarray]) -> int:
        h, w = pixels["pixel_values"].shape[-2:]
        return len(pixels["pixel_values"]) * (h // self.patch_size) * (w // self.patch_size)

    def stored(self, pixels: Mapping[str, np.ndarray]) -> list[list[int]]:
        return []  # no grids: every picture is the processor's one size


class TileImages:
    """Idefics3/SmolVLM-style processors: each image cut into rows x cols tiles plus the whole
    picture, all of one size; one example's tiles (1, n, C, S, S) with their pixel_attention_mask."""

    inputs = ("pixel_attention_mask",)
    token = "<image>"  # Idefics3Processor's

    def __init__(self, image_processor, settings: Mapping[str, Any]):
        self.image_processor = image_processor
        self.seq_len = int(settings["image_seq_len"])

    def pixels(self, images: Sequence) -> dict[str, np.ndarray]:
        """One example's images as one sample: tiles along dimension 1, and each image's rows
        and cols (for its prompt string; not a model input)."""
        out = self.image_processor(images=[list(images)], return_tensors="np", return_row_col_info=True)
        return {"pixel_values": np.asarray(out["pixel_values"], np.float32),
                "pixel_attention_mask": np.asarray(out["pixel_attention_mask"], bool),
                "rows": np.asarray(out["rows"]).reshape(-1), "cols": np.asarray(out["cols"]).reshape(-1)}  # fmt: skip

    def token_counts(self, pixels: Mapping[str, np.ndarray]) -> list[int]:
        """Image tokens an image: image_seq_len for each tile and for the whole picture."""
        return [(int(r) * int(c) + 1) * self.seq_len for r, c in zip(pixels["rows"], pixels["cols"])]

    def prompts(self, pixels: Mapping[str, np.ndarray], image_token: str, tokenizer) -> list[str]:
        """Each image's text, as the model's processor writes it (transformers' own function, with
        the tokens SmolVLMProcessor takes from the tokenizer; Idefics3Processor's are the defaults)."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        fake = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
        tag = getattr(tokenizer, "global_image_token", None) or "<global-img>"
        return [get_image_prompt_string(int(r), int(c), self.seq_len, fake, image_token, tag)
                for r, c in zip(pixels["rows"], pixels["cols"])]  # fmt: skip

    def patches(self, pixels: Mapping[str, np.ndarray]) -> int:
        # the tower's patches aren't known to the processor (its patch size is the model's): the
        # tiles' image tokens stand for them, a scale_factor² of the tower's work
        return int(pixels["pixel_values"].shape[1]) * self.seq_len

    def stored(self, pixels: Mapping[str, np.ndarray]) -> list[list[int]]:
        return []


def _square(size) -> bool:
    """A size setting that names both sides (a dict or transformers' SizeDict)."""
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    return size is not None and bool(get("height")) and bool(get("width"))


def fixed_size(image_processor) -> bool:
    """Whether every picture comes out one size: center-cropped, or resized to height x width.
    Pictures of their own sizes would need padding in a packed row, which alone they don't get."""
    ip = image_processor
    return bool((getattr(ip, "do_center_crop", None) and _square(getattr(ip, "crop_size", None)))
                or (getattr(ip, "do_resize", None) and _square(getattr(ip, "size", None))))  # fmt: skip


def image_layout(image_processor, settings: Mapping[str, Any]) -> GridImages | PictureImages | TileImages:
    """The layout of `image_processor` (see the module doc), or InputError naming the trait raypack
    has no exact data path for."""
    kind = type(image_processor).__name__
    inputs = list(getattr(image_processor, "model_input_names", None) or ["pixel_values"])
    if "image_grid_thw" in inputs and hasattr(image_processor, "merge_size"):
        return GridImages(image_processor)
    extra = [i for i in inputs if i != "pixel_values"]
    splits = [s for s in SPLITS if getattr(image_processor, s, None)]
    if extra == ["pixel_attention_mask"] and set(splits) <= {"do_image_splitting"} and settings.get("image_seq_len"):
        return TileImages(image_processor, settings)
    if extra or splits:
        raise InputError(
            f"{kind} gives {', '.join(extra or ['pixel_values'])}{' and splits images (' + ', '.join(splits) + ')' if splits else ''}: "
            "raypack's image data path takes grid processors (image_grid_thw: Qwen2/2.5/3-VL), whole fixed-size "
            "pictures (CLIP/SigLIP: LLaVA) and Idefics3/SmolVLM's tiles (with image_seq_len in processor_config.json) "
            "so far; LLaVA-NeXT and Pixtral pack exactly at the model level only (docs/guides/vision.md)")  # fmt: skip
    if not fixed_size(image_processor):
        raise InputError(f"{kind} gives pictures of each image's own size (no center crop, no height x width resize): "
                         "raypack packs whole pictures of one size only (docs/guides/vision.md)")
    if not settings.get("patch_size"):
        raise InputError(
            f"{kind} gives whole pictures, but the processor folder's {SETTINGS_FILE} has no patch_size (with "
            "num_additional_image_tokens and vision_feature_select_strategy, as LlavaProcessor saves them) to count "
            "each image's tokens")  # fmt: skip
    return PictureImages(image_processor, settings)
