"""Preference pairs whose prompt carries images (DPO with image prompts): read, then tokenized with
the model's processor, then packed whole as text pairs are (raypack/data/pairs.py).

The prompt's messages hold the images in either chat layout raypack reads (raypack/data/images.py);
chosen and rejected are text answers, as chat messages (TRL's conversational preference format):

    {"prompt":   [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                               {"type": "text", "text": "What is it?"}]}],
     "chosen":   [{"role": "assistant", "content": "A cat."}],
     "rejected": [{"role": "assistant", "content": "A dog."}]}
    {"prompt": [{"role": "user", "content": "<image>What is it?"}], "chosen": [...], "rejected": [...],
     "images": ["cat.png"]}

Without `prompt`, the shared start of chosen and rejected is the prompt (TRL's `extract_prompt`,
whole messages). An image in chosen or rejected, a string (standard-format) pair with images,
and everything images.py refuses (a missing or undecodable image, placeholders that don't match
`images`) are a bad row naming the file and line.

Each side carries its own copy of the prompt, image tokens included, as text DPO repeats the
prompt per side and TRL's vision collator repeats the images for chosen and rejected: in a packed
row each sequence attends only within itself (its own `cu_seq_lens` span), so a completion sees
the prompt's image tokens only in its own sequence, and sharing one prompt between two
completions would take a mask a causal varlen kernel can't apply. So each sequence's length
counts its image tokens, the plan sees both, and the vision tower runs on each side's copy of the
pixels (what TRL's batch of the pair computes too). The encoded images are stored once a pair,
on its chosen row (piece 0), where both sides look them up (raypack/train/vision_rows.py).

    input_ids    p S I I I E q A c0 c1 | p S I I I E q A r0        S/E: vision start/end, I: image
    labels       - - - - - - - - c0 c1 | - - - - - - - - r0        tokens, A: the generation prompt
    example_ids  [pair | 0, pair | 1]; images: the pair's, once, under pair | 0

Tokenized as text pairs are (pairs.tokenize_pairs, TRL's DPOTrainer on conversations): the chat
template over the prompt (with the generation prompt), prompt + chosen and prompt + rejected,
each image's pad expanded to its tokens as the SFT image rows expand it (ImageTokenizer), the
completion from where the tokenized prompt and the full sequence first differ. A pair is kept
whole or dropped under every tokenize.overlength policy: a cut prompt would lose image tokens
its pixels still count, as for SFT image rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.data.formats import PREFERENCE_KEYS, extract_prompt
from raypack.data.image_layouts import GridImages
from raypack.data.images import (PLACEHOLDER, ImageError, ImageTokenizer, check_roles, decode_image, image_messages,
                                 read_images)
from raypack.data.pairs import CHOSEN, PIECE_MASK, Pair, pair_from
from raypack.errors import InputError

KIND = "vision_preference"
"""The source stage's format name of a preference row with images (sources.read_unit)."""


def read_pair_record(record: dict[str, Any], base_dir: str | Path | None, where: str,
                     max_pixels: int | None = MAX_IMAGE_PIXELS) -> dict[str, Any]:
    """A `vision_preference` row for the source stage: the pair's prompt, chosen and rejected
    messages in parts (JSON, `vision_messages`) and the prompt's images' encoded bytes (`images`),
    each read and checked to decode here, so a bad image is a bad row naming `where`."""
    values = {k: record.get(k) for k in PREFERENCE_KEYS}
    for key, value in values.items():
        if (value is not None or key != "prompt") and not isinstance(value, list):
            raise ImageError(f"{where}: a preference pair with images takes `{key}` as a list of chat messages "
                             "(TRL's conversational format), its images in the prompt's messages")
    if values["prompt"] is None:
        values = extract_prompt(values["chosen"], values["rejected"])
    if not values["prompt"]:
        raise ImageError(f"{where}: the pair has no prompt (chosen and rejected share no first message) to hold "
                         "its images")
    prompt, sources = image_messages({"messages": values["prompt"], "images": record.get("images")}, where)
    answers = {}
    for key in ("chosen", "rejected"):
        if not values[key]:
            raise ImageError(f"{where}: `{key}` holds no message after the prompt")
        answers[key], inside = image_messages({"messages": values[key]}, where)
        placeholders = record.get("images") and any(PLACEHOLDER in p.get("text", "") for m in answers[key]
                                                     for p in m["content"])  # fmt: skip
        if inside or placeholders:
            raise ImageError(f"{where}: an image in `{key}`: a preference pair's images belong to its prompt, and "
                             "chosen and rejected are text answers")
    if answers["chosen"] == answers["rejected"]:
        raise ImageError(f"{where}: `chosen` and `rejected` are the same completion: the pair prefers nothing")
    for messages in (prompt, *answers.values()):
        check_roles(messages, where)
    text = json.dumps({"prompt": prompt, **answers})
    return {"vision_messages": text, "images": read_images(sources, base_dir, where, max_pixels)}


def image_owner(eid):
    """The example id (an int or an array of them) whose stored images an example reads: its own
    with the piece bits cleared. A pair's are stored once, under its chosen row (piece 0); an image
    example is never split, so its piece is 0 already."""
    return eid & ~PIECE_MASK


class PairSide(NamedTuple):
    """What one row of an image pair adds to the tokenized table (encode._table): the images on
    the chosen row only (None on the rejected: stored once a pair), and on both their flat grids,
    the image tokens in its length and the vision tower's patches for its copy (each side runs the
    tower: the plan's balance weighs both, data/tower.py)."""

    images: list[bytes] | None
    grid: np.ndarray | None
    image_tokens: int
    patches: int


class VisionPair(NamedTuple):
    """One tokenized image pair: the two sequences (as text pairs are) and the prompt's images."""

    pair: Pair
    images: list[bytes]
    grid: np.ndarray
    """The images' (t, h, w) grids, flat."""
    image_tokens: int
    """Image tokens in each sequence (the prompt's, in both)."""
    patches: int
    """The vision tower's patches for one copy of the images."""

    def side(self, piece: int) -> PairSide:
        if piece == CHOSEN:
            return PairSide(self.images, self.grid, self.image_tokens, self.patches)
        return PairSide(None, self.grid, self.image_tokens, self.patches)


def check_layout(tok: ImageTokenizer) -> None:
    """Refuse image prompts in pairs for a processor raypack hasn't checked them with: only grid
    processors (Qwen2-VL's kind) are (tests/unit/train/objectives/test_dpo.py)."""
    if not isinstance(tok.layout, GridImages):
        raise InputError("tokenize.tokenizer: preference pairs with image prompts are checked exact for grid "
                         "processors (Qwen2-VL's kind, which give image_grid_thw) only, and this processor gives "
                         f"{type(tok.layout).__name__.removesuffix('Images').lower()}s; use a Qwen2.5-VL-style model "
                         "for them (docs/guides/vision.md)")


def encode_pair(tok: ImageTokenizer, pair: dict[str, list[dict]], blobs: Sequence[bytes], where: str) -> VisionPair:
    """A `read_pair_record` pair (messages in parts) and its images' bytes, tokenized (module doc)."""
    check_layout(tok)
    images = [decode_image(b, "stored image", where) for b in blobs]
    pix = tok.pixels(images)
    counts = tok.layout.token_counts(pix)

    def render(conversation: list[dict], **kw) -> list[int]:
        ids = tok.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, **kw)["input_ids"]
        found = sum(t == tok.pad_id for t in ids)
        if found != len(images):
            raise ImageError(f"{where}: the chat template rendered {found} image token(s) for {len(images)} image(s)")
        return tok.expand(ids, pix)

    out = pair_from(render(pair["prompt"], add_generation_prompt=True), render(pair["prompt"] + pair["chosen"]),
                    render(pair["prompt"] + pair["rejected"]))  # fmt: skip
    if any(tok.pad_id in seq[out.prompt:] for seq in (out.chosen, out.rejected)):
        raise ImageError(f"{where}: an image token after the prompt: the chat template renders the prompt differently "
                         "alone and before an answer")
    return VisionPair(out, list(blobs), pix["image_grid_thw"].reshape(-1).astype(np.int32), sum(counts),
                      int(pix["pixel_values"].shape[0]))


def encode_pairs(tok: ImageTokenizer, messages: list[str], images: list[list[bytes]],
                 eids: list[int]) -> list[VisionPair]:
    """The source stage's `vision_preference` rows encoded (encode.Encoder)."""
    return [encode_pair(tok, json.loads(m), list(blobs), f"example {eid}")
            for m, blobs, eid in zip(messages, images, eids)]
