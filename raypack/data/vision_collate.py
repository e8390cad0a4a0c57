"""Image+text examples -> the keyword arguments of a packed vision-language forward.

Like `collate.collate_packed`, every example goes into one [1, T] row, and the example offsets
(`cu_seq_lens_q/k`, from the text positions) are computed once here. Beside the row travel the
examples' images, concatenated in example order, so the model's in-order scatter of image
features onto placeholder tokens puts each image on its own example (raypack/model/vision.py):

    example a: ids [t S I I E t], positions (4, 6), pixel_values (4 patches, D), grid [[1, 2, 2]]
    example b: ids [t S I E t t], positions (4, 6), pixel_values (4 patches, D), grid [[1, 2, 2]]
                                    |
                                    v
    input_ids       [1, 12]        position_ids  [4, 1, 12] (mRoPE) or [1, 12]
    pixel_values    (8, D)         image_grid_thw [[1, 2, 2], [1, 2, 2]]
    labels          [1, 12], -100 at each example's first token     cu_seq_lens [0, 6, 12]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raypack.data.formats import IGNORE_INDEX

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
"""Per-example image tensors, concatenated in example order (`_image_axis`)."""


def _image_axis(key: str, value: torch.Tensor) -> int:
    """Where the images (or patches) of `value` run: dimension 1 for the Idefics3/SmolVLM layout,
    whose pixel_values are (batch, images, C, H, W) and pixel_attention_mask (batch, images, H, W);
    dimension 0 everywhere else (Qwen's patches and grids, CLIP/SigLIP towers' pictures)."""
    batched = {"pixel_values": 5, "pixel_attention_mask": 4}
    return 1 if value.dim() == batched.get(key) else 0


def collate_vision_packed(examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One packed row of `examples` (dicts of input_ids, labels, position_ids (n,) or (4, n), and
    optionally the IMAGE_KEYS). Examples without images add none."""
    if not examples:
        raise ValueError("collate_vision_packed got no examples")
    ids = [torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples]
    positions = [torch.as_tensor(e["position_ids"], dtype=torch.long) for e in examples]
    rows = {p.dim() for p in positions}
    if len(rows) != 1:
        raise ValueError("collate_vision_packed got text positions and mRoPE positions in one batch")
    labels = []
    for e, i, p in zip(examples, ids, positions):
        lab = torch.as_tensor(e["labels"], dtype=torch.long).clone()
        if not (len(lab) == len(i) == p.shape[-1]):
            raise ValueError(f"example has input_ids/labels/position_ids of lengths {len(i)}/{len(lab)}/{p.shape[-1]}")
        lab[0] = IGNORE_INDEX  # the previous example's last token must not predict this one's first
        labels.append(lab)
    lengths = torch.tensor([len(i) for i in ids])
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    position_ids = torch.cat(positions, -1)
    batch: dict[str, Any] = {
        "input_ids": torch.cat(ids)[None],
        # (4, T) -> (4, 1, T): transformers reads row 0 as the text position, rows 1-3 as mRoPE
        "position_ids": position_ids[:, None] if position_ids.dim() == 2 else position_ids[None],
        "labels": torch.cat(labels)[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }
    for key in IMAGE_KEYS:
        parts = [torch.as_tensor(e[key]) for e in examples if e.get(key) is not None]
        parts = [p for p in parts if p.numel()]
        if parts:
            axis = _image_axis(key, parts[0])
            shapes = {p.shape[:axis] + p.shape[axis + 1:] for p in parts}
            if len(shapes) > 1:  # pictures of different sizes would need padding, which alone they don't get
                raise ValueError(f"collate_vision_packed: {key} of different shapes {sorted(shapes)} in one packed row; "
                                 "packing is exact here for one picture size per tower input (Qwen's patches have any)")
            batch[key] = torch.cat(parts, axis)
    return batch


def collate_vision_padded(examples: Sequence[Mapping[str, Any]], image_token_id: int,
                          pad_token_id: int = 0) -> dict[str, Any]:
    """One example a row, right-padded, with the images in example order and, for grid models,
    the grids and token types the model's own get_rope_index reads (`mm_token_type_ids`: 1 on
    `image_token_id`); no position_ids: the model builds its own, as for any padded batch."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.as_tensor(e["input_ids"]), torch.as_tensor(e["labels"]), 1
        labels[i, 0] = IGNORE_INDEX  # as packed rows mask every example start
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    pixels = [e for e in examples if e.get("pixel_values") is not None]
    if pixels:
        if all(e.get("pixel_attention_mask") is not None for e in pixels):  # tiles: a row of them an example
            batch["pixel_values"] = _pad_images([e["pixel_values"] for e in pixels])
            batch["pixel_attention_mask"] = _pad_images([e["pixel_attention_mask"] for e in pixels])
            return batch
        batch["pixel_values"] = torch.cat([torch.as_tensor(e["pixel_values"]) for e in pixels])
        if all(e.get("image_grid_thw") is not None for e in pixels):
            batch["image_grid_thw"] = torch.cat([torch.as_tensor(e["image_grid_thw"]) for e in pixels])
            batch["mm_token_type_ids"] = (ids == image_token_id).to(torch.int32)
    return batch


def _pad_images(parts: Sequence[Any]) -> torch.Tensor:
    """Examples' (1, n, ...) tiles as one (examples, max n, ...) batch, padded with all-zero tiles,
    as the Idefics3/SmolVLM processor pads a batch (the model drops all-zero tiles)."""
    parts = [torch.as_tensor(p) for p in parts]
    n = max(p.shape[1] for p in parts)
    out = parts[0].new_zeros((len(parts), n, *parts[0].shape[2:]))
    for i, p in enumerate(parts):
        out[i, : p.shape[1]] = p[0]
    return out
