"""Image+text examples: read their images and tokenize them with the model's image processor.

Two layouts, the ones the field uses:

    chat parts   {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                           {"type": "text", "text": "What is it?"}]},
                               {"role": "assistant", "content": "A cat."}]}
    placeholders {"messages": [{"role": "user", "content": "<image>What is it?"},
                               {"role": "assistant", "content": "A cat."}],
                  "images": ["cat.png"]}                  (LLaMA-Factory's and ShareGPT's layout)

An image is a path (relative to the data file's folder, or absolute), a URI (file://, s3://,
gs://, ... through pyarrow's filesystems, as Ray Data reads), a `data:image/...;base64,` URI or
bare base64. A missing or undecodable image, one of more pixels than `data.max_image_pixels`
(read from its header, before anything is decoded: PIL's own limit, a traceback, is left out), or
placeholders that don't match the images, raise ImageError naming the file and line.

Tokenizing (`ImageTokenizer`): the chat template renders each image as one image token (the
processor's `image_token`, Qwen's <|image_pad|> where it names none; a special token, so it never
merges with its neighbours); the image processor gives the tower's pixels, and each image token
becomes what the model's own processor expands it to: grid.prod() / merge_size**2 copies for
grid processors (Qwen2/2.5/3-VL, within their pixel budget), a fixed count for whole pictures
(LLaVA's CLIP/SigLIP), the processor's prompt string for tiles (Idefics3/SmolVLM), by the
processor's traits (raypack/data/image_layouts.py). Labels are the assistant's tokens only (the
template's {% generation %} marks them): prompt and image tokens carry none. EOS ends every example, with a label after an assistant turn, as in the text
pipeline (raypack/data/encode.py). An example's `length` counts its image tokens, and
`vision_patches` the tower's work, for the plan and the balance to count.

What a prepared example holds: its tokens, and the image bytes as read (`images`), not the
processed pixels, which are 51x the bundled sample's PNGs and 102-130x photo-like JPEGs under
Qwen2.5-VL's processor (benchmarks/vision_bytes.py). `example_pixels` processes them again where
they are used (tens to hundreds of ms an image on one CPU core), checking the grids and the
image-token counts still match.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.data.formats import IGNORE_INDEX
from raypack.data.image_layouts import MODEL_INPUTS, image_layout
from raypack.errors import InputError

PLACEHOLDER = "<image>"
"""The image placeholder of the `messages` + `images` layout."""


class ImageError(InputError):
    """An image example that can't be read: names the file and line."""


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ImageError(f"{where}: a message's content must be text or a list of parts, got {type(content).__name__}")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image":
            source = part.get("image", part.get("url", part.get("path")))
            if not isinstance(source, str) or not source:
                raise ImageError(f"{where}: an image part needs an 'image' path, URI or base64 string")
            out.append({"type": "image", "image": source})
        else:
            raise ImageError(f"{where}: unknown content part {part!r}; expected type 'text' or 'image'")
    return out


def image_messages(record: dict[str, Any], where: str) -> tuple[list[dict], list[str]]:
    """The record's messages with content as parts ({"type": "image"} where an image goes, in
    order) and the image sources, for either layout."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ImageError(f"{where}: an image example needs a non-empty 'messages' list")
    given = record.get("images")
    if given is not None and not isinstance(given, list):
        raise ImageError(f"{where}: 'images' must be a list of paths, URIs or base64 strings")
    out, sources = [], []
    for m in messages:
        parts = []
        for part in _parts(m.get("content", ""), where):
            if part["type"] == "image":
                if given is not None:
                    raise ImageError(f"{where}: image parts in messages and an 'images' list; use one layout")
                sources.append(part["image"])
                parts.append({"type": "image"})
                continue
            if given is None or PLACEHOLDER not in part["text"]:
                parts.append(part)
                continue
            pieces = part["text"].split(PLACEHOLDER)
            for i, piece in enumerate(pieces):
                if i:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
        out.append({"role": m.get("role"), "content": parts})
    if given is not None:
        found = sum(p["type"] == "image" for m in out for p in m["content"])
        if found != len(given):
            raise ImageError(f"{where}: {found} {PLACEHOLDER} placeholder(s) in messages but {len(given)} image(s) in 'images'")
        sources = [str(s) for s in given]
    return out, sources


_B64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")


def read_image_bytes(source: str, base_dir: str | Path | None, where: str) -> bytes:
    """The encoded bytes of one image source (path, URI, data URI or base64)."""
    short = source if len(source) < 80 else source[:60] + "..."
    try:
        if source.startswith("data:"):
            return base64.b64decode(source.split(",", 1)[1], validate=True)
        if "://" in source:
            from pyarrow import fs

            filesystem, path = fs.FileSystem.from_uri(source)
            with filesystem.open_input_file(path) as f:
                return f.read()
        if base_dir is not None and "://" in str(base_dir) and not source.startswith("/"):
            return read_image_bytes(f"{str(base_dir).rstrip('/')}/{source}", None, where)  # beside a data URI
        path = Path(source)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if path.is_file():
            return path.read_bytes()
        if len(source) > 64 and _B64.match(source):  # bare base64, not a path that happens to be missing
            return base64.b64decode(source, validate=True)
        raise FileNotFoundError(f"no such file {str(path)!r}")
    except (OSError, ValueError, IndexError, binascii.Error) as e:
        raise ImageError(f"{where}: image {short!r} can't be read: {e}") from None


def decode_image(data: bytes, source: str, where: str, max_pixels: int | None = None,
                 setting: str = "data.max_image_pixels"):
    """A PIL image in RGB from encoded bytes, or ImageError naming the example. `max_pixels`: the
    most pixels it may have (`setting` names where that is set), checked from its header before
    anything is decoded; None: no limit (images the read already checked)."""
    from PIL import Image, UnidentifiedImageError

    short = source if len(source) < 80 else source[:60] + "..."
    try:
        with _own_pixel_limit(Image):
            im = Image.open(io.BytesIO(data))
        with im:
            width, height = im.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(f"{where}: image {short!r} is {width}x{height}, {width * height:,} pixels, over "
                                 f"{setting} ({max_pixels:,}); make it smaller, or raise {setting}")
            im.load()
            return im.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        why = f"{len(data)} bytes in no image format PIL reads" if isinstance(e, UnidentifiedImageError) else str(e)
        raise ImageError(f"{where}: image {short!r} is not a decodable image: {why}") from None


_PIL_LIMIT = threading.Lock()


@contextlib.contextmanager
def _own_pixel_limit(Image):
    """PIL's own limit (Image.MAX_IMAGE_PIXELS, a module global: a warning above it, an error
    with a traceback above twice it) off while an image is opened: raypack's, checked from the
    same header, names the file, the line and the setting."""
    with _PIL_LIMIT:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


MESSAGE_KEYS = ("messages", "prompt", "chosen", "rejected")
"""Where a record's messages are: a chat's, or a preference pair's (raypack/data/vision_pairs.py)."""


def has_images(record: Any) -> bool:
    """Whether a chat or preference record carries images, in either layout: what makes it a
    `vision` row (a chat) or a `vision_preference` row (a pair)."""
    if not isinstance(record, dict):
        return False
    if record.get("images"):
        return True
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
               for key in MESSAGE_KEYS if isinstance(record.get(key), list) for m in record[key])  # fmt: skip


def read_record(record: dict[str, Any], base_dir: str | None, where: str,
                max_pixels: int | None = MAX_IMAGE_PIXELS) -> dict[str, Any]:
    """A vision row for the source stage (raypack/data/sources.py), read where the text is read:
    its messages in parts (as JSON) and its images' encoded bytes, each checked to decode, so a
    missing or undecodable image, one over `max_pixels` (data.max_image_pixels), or placeholders
    that don't match, is a bad row naming `where`."""
    messages, sources = image_messages(record, where)
    check_roles(messages, where)
    return {"vision_messages": json.dumps(messages), "images": read_images(sources, base_dir, where, max_pixels)}


def check_roles(messages: list[dict], where: str) -> None:
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ImageError(f"{where}: unknown role {m['role']!r}; expected one of system, user, assistant")


def read_images(sources: Sequence[str], base_dir: str | Path | None, where: str,
                max_pixels: int | None = MAX_IMAGE_PIXELS) -> list[bytes]:
    """The encoded bytes of each image source, each checked to decode within `max_pixels`
    (ImageError naming `where`)."""
    blobs = [read_image_bytes(s, base_dir, where) for s in sources]
    for blob, source in zip(blobs, sources):
        decode_image(blob, source, where, max_pixels)
    return blobs


class Vision:
    """One encoded vision row, as the tokenize stage keeps it (raypack/data/encode.py): tokens with
    each image's tokens in place, labels, the images' encoded bytes, their grids (flat, 3 an
    image; none for pictures), its image tokens and the vision tower's patches."""

    def __init__(self, example: dict[str, Any]):
        self.ids = np.asarray(example["input_ids"], np.int32)
        self.labels = np.asarray(example["labels"], np.int32)
        self.images, self.grid = example["images"], np.asarray(example["image_grid_thw"], np.int32).reshape(-1)
        self.image_tokens, self.patches = int(example["image_tokens"]), int(example["vision_patches"])


class ImageTokenizer:
    """Image+text examples -> input_ids, labels, length, images (encoded bytes), image_grid_thw,
    image_tokens, vision_patches, with the model's image processor, its settings (the folder's
    processor_config.json, where it has one) and tokenizer (see the module doc). What an image
    becomes, pixels and token count, is the processor's layout (raypack/data/image_layouts.py)."""

    def __init__(self, image_processor, tokenizer, settings: Mapping[str, Any] | None = None):
        settings = settings or {}
        self.layout = image_layout(image_processor, settings)
        self.image_processor, self.tokenizer = image_processor, tokenizer
        # the processor's own choice, as LlavaProcessor and Qwen2VLProcessor make it
        self.image_token = getattr(tokenizer, "image_token", None) or settings.get("image_token") or self.layout.token
        self.pad_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.pad_id is None or self.pad_id == tokenizer.unk_token_id:
            raise InputError(f"the tokenizer has no {self.image_token} token for images")

    def pixels(self, images: Sequence) -> dict[str, np.ndarray]:
        """The tower's inputs for decoded images: pixel_values float32, and image_grid_thw (n, 3)
        for grid processors, pixel_attention_mask for tiles."""
        return self.layout.pixels(images)

    def expansions(self, pixels: dict[str, np.ndarray]) -> list[list[int]]:
        """Each image's tokens in the text: its count of image tokens, or for tiles the
        processor's prompt string, tokenized alone (it starts and ends with special tokens, so
        nothing around it merges with it, as when the processor tokenizes the whole text)."""
        if not hasattr(self.layout, "prompts"):
            return [[self.pad_id] * n for n in self.layout.token_counts(pixels)]
        texts = self.layout.prompts(pixels, self.image_token, self.tokenizer)
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def __call__(self, record: dict[str, Any], where: str, base_dir: str | Path | None = None) -> dict[str, Any]:
        messages, sources = image_messages(record, where)
        blobs = [read_image_bytes(s, base_dir, where) for s in sources]
        return self.encode(messages, blobs, where, sources)

    def encode(self, messages: list[dict], blobs: list[bytes], where: str,
               sources: Sequence[str] | None = None) -> dict[str, Any]:
        """`__call__` for messages in parts (`image_messages`) and their images' encoded bytes
        (what the source stage read: `read_record`)."""
        images = [decode_image(b, s, where) for b, s in zip(blobs, sources or ["image"] * len(blobs))]
        enc = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        pads = [i for i, t in enumerate(ids) if t == self.pad_id]
        if len(pads) != len(images):
            raise ImageError(f"{where}: the chat template rendered {len(pads)} image token(s) for {len(images)} image(s)")
        pix = self.pixels(images) if images else None
        expanded = iter(self.expansions(pix) if images else [])
        out_ids, labels = [], []
        for t, m in zip(ids, mask):
            if t == self.pad_id:
                tokens = next(expanded)
                out_ids += tokens
                labels += [IGNORE_INDEX] * len(tokens)
            else:
                out_ids.append(t)
                labels.append(t if m else IGNORE_INDEX)
        eos = self.tokenizer.eos_token_id
        if eos is not None and out_ids[-1] != eos:  # as the text pipeline ends every example (data/encode.py)
            out_ids.append(eos)
            labels.append(eos if messages[-1]["role"] == "assistant" else IGNORE_INDEX)
        return {
            "input_ids": out_ids, "labels": labels, "length": len(out_ids), "images": blobs,
            "image_grid_thw": self.layout.stored(pix) if images else [],
            "image_tokens": sum(self.layout.token_counts(pix)) if images else 0,
            "vision_patches": self.layout.patches(pix) if images else 0,
        }  # fmt: skip

    def prompt(self, messages: list[dict], images: Sequence) -> dict[str, np.ndarray]:
        """A generation prompt (`raypack chat`): the conversation's messages, content as parts
        ({"type": "image"} where each of `images`, decoded, goes), then the template's generation
        prompt; each image's pad expanded as `__call__` expands it. input_ids with a batch of one."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]  # fmt: skip
        if sum(t == self.pad_id for t in ids) != len(images):
            raise ValueError(f"the chat template rendered {sum(t == self.pad_id for t in ids)} image token(s) "
                             f"for {len(images)} image(s)")
        pix = self.pixels(images) if images else {}
        return {"input_ids": np.asarray([self.expand(ids, pix)], np.int64),
                **{k: v for k, v in pix.items() if k in MODEL_INPUTS}}

    def expand(self, ids: Sequence[int], pixels: dict[str, np.ndarray]) -> list[int]:
        """Rendered ids with the k-th image pad replaced by the k-th image of `pixels`' tokens
        (`expansions`)."""
        tokens = iter(self.expansions(pixels) if pixels else ())
        return [n for t in ids for n in (next(tokens) if t == self.pad_id else [t])]

    def rows(self, messages: list[str], images: list[list[bytes]], eids: list[int]) -> list[Vision]:
        """The source stage's vision rows (`read_record`: messages in parts as JSON, images' bytes) encoded."""
        return [Vision(self.encode(json.loads(m), list(blobs), f"example {eid}"))
                for m, blobs, eid in zip(messages, images, eids)]  # fmt: skip

    def example_pixels(self, example: dict[str, Any], where: str = "example") -> dict[str, np.ndarray]:
        """The pixels of a prepared example, processed again from its stored bytes (collate),
        checked against what was stored then (the grids) and, given its `input_ids`, against its
        image tokens: another processor since would put features on the wrong tokens."""
        images = [decode_image(b, "stored image", where) for b in example["images"]]
        if not images:
            return {}
        pix = self.pixels(images)
        if self.layout.stored(pix) != [list(g) for g in example["image_grid_thw"]]:
            raise ValueError(f"{where}: the image processor changed since the data was prepared (other grids)")
        if example.get("input_ids") is not None:
            found = int((np.asarray(example["input_ids"]) == self.pad_id).sum())
            if found != sum(self.layout.token_counts(pix)):
                raise ValueError(f"{where}: {found} image tokens in the text but the image processor makes "
                                 f"{sum(self.layout.token_counts(pix))} of its images: it changed since the data "
                                 "was prepared, or tokenize.tokenizer names another processor")
        return pix
