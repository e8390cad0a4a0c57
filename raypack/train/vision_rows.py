"""A VLM run's micro-batches on the worker: packed rows and their examples' images -> model kwargs.

The packed rows are the text pipeline's (raypack/data/pack.py), naming their examples in
`example_ids`; the images wait beside them by example id (`shards.rank_images`). `VisionRows`
is the collate `prefetch.prepare_step` runs for a VLM (raypack/train/loop.py: `vision_rows`), and
DPO's for a VLM's preference pairs (raypack/train/objectives/dpo.py: `pair_batch`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from raypack.data.collate import example_starts
from raypack.data.encode import load_image_tokenizer, load_tokenizer
from raypack.data.formats import row_labels
from raypack.data.image_layouts import MODEL_INPUTS
from raypack.data.vision_pairs import image_owner
from raypack.data.vision_collate import collate_vision_packed, collate_vision_padded
from raypack.errors import InputError
from raypack.model import vision_tower
from raypack.model.vision import example_positions, image_token_id


def check_processor_fits(model_class: type, config: PretrainedConfig, inputs: tuple[str, ...], image_token: int,
                         processor: str) -> None:
    """Refuse a processor whose images `model_class` can't take: the processor's layout gives
    `inputs` beside pixel_values (raypack/data/image_layouts.py), which the model's forward must
    take, and it must take no other of them (grids for LLaVA, whole pictures for Qwen, ...); and
    its image token must be the model's."""
    params = inspect.signature(model_class.forward).parameters
    takes = tuple(k for k in MODEL_INPUTS if k != "pixel_values" and k in params)
    if takes != tuple(inputs):
        gives = f"gives {', '.join(inputs)} beside pixel_values" if inputs else "gives pixel_values alone"
        raise InputError(f"tokenize.tokenizer {processor!r}: its image processor {gives}, but {model_class.__name__} "
                         f"takes {', '.join(takes) or 'neither image_grid_thw nor pixel_attention_mask'}: name the "
                         "model's own processor folder")
    if image_token != image_token_id(config):
        raise InputError(f"tokenize.tokenizer {processor!r} renders images as token {image_token}, but the model's "
                         f"image token is {image_token_id(config)}: name the model's own processor folder")


DECODE_WORKERS = 8
"""At most this many threads decode a micro-batch's images (VisionRows), fewer where the worker
has fewer CPUs: a 16k-token row of ~30 photo-sized images is over a second on one thread."""


def decode_workers() -> int:
    """Threads for a worker's image decoding: its CPUs (torch's thread count, which Ray Train sets
    from the worker's CPU share), up to DECODE_WORKERS."""
    return max(1, min(DECODE_WORKERS, torch.get_num_threads(), os.cpu_count() or 1))


class VisionRows:
    """The worker's collate for a VLM run: packed rows (their `example_ids`) -> one micro-batch,
    each example's images looked up by id (`shards.rank_images`) and processed again from their
    encoded bytes, its positions the model's own for it alone (`vision.example_positions`):

        packed   collate_vision_packed: one [1, T] row, positions per example (4-row for mRoPE
                 models, the text position for the others: LLaVA, Idefics3), cu_seq_lens; and
                 for a grid tower that takes one, its host plan (`vision_tower.plan`: what the
                 tower derives from the grid, computed here in the prefetch thread)
        padded   one example a row, right-padded, with an attention_mask and no position_ids:
                 the model builds its own positions (get_rope_index) as for any padded batch

    Examples are found as `collate.collate_packed` finds them (positions restart at 0), one per
    id in `example_ids`: vision rows are never split (prepare refuses strategies that split).
    Images are looked up by `image_owner`: a preference pair's two sequences share the pair's
    (raypack/data/vision_pairs.py)."""

    def __init__(self, model, images: Mapping[int, tuple[list[bytes], list[int]]], processor: str,
                 workers: int | None = None):
        self.model, self.images = model, images
        self.tokenize = load_image_tokenizer(processor, load_tokenizer(processor))
        base = getattr(model, "get_base_model", lambda: model)()  # through a peft wrapper
        check_processor_fits(type(base), model.config, self.tokenize.layout.inputs, self.tokenize.pad_id, processor)
        self.workers = workers if workers is not None else decode_workers()
        self._pool: ThreadPoolExecutor | None = None
        # a grid tower that runs from host plans gets its plan with every packed row
        self.tower = vision_tower.tower_of(model) if vision_tower.installed(model) else None

    def examples(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        found = []  # (example id, its tokens, its labels)
        for row in rows:
            ids, labels = torch.as_tensor(row["input_ids"]).long(), torch.as_tensor(row_labels(row)).long()
            bounds = [*example_starts(row["position_ids"]).tolist(), len(ids)]
            names = list(row["example_ids"]) or [None]  # an empty pack: one pad token, no example
            if len(names) != len(bounds) - 1:
                raise ValueError(f"a packed row holds {len(names)} example ids but {len(bounds) - 1} examples")
            found += [(eid, ids[lo:hi], labels[lo:hi]) for eid, lo, hi in zip(names, bounds[:-1], bounds[1:])]
        pixels = self._pixels(found)
        out = []
        for (eid, ids, labels), pix in zip(found, pixels):
            inputs = {k: torch.as_tensor(pix.get(k)) if k in pix else None for k in MODEL_INPUTS}
            out.append({"input_ids": ids, "labels": labels, **inputs,
                        "position_ids": example_positions(self.model, ids, inputs["image_grid_thw"])})
        return out

    def _pixels(self, found: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[dict[str, Any]]:
        """Each example's pixels: its images decoded and processed from their bytes once per call
        (a preference pair's two sequences share their owner's), the images of different
        examples on `workers` threads. Decoding (PIL) and the processor's numpy work release the
        GIL: on the dev machine 2 threads took a 640x480 JPEG from 44 to 27 ms
        (benchmarks/vision_host.py)."""
        def one(item):
            eid, ids = item
            blobs, grid = self.images[owner(eid)]
            return self.tokenize.example_pixels({"images": blobs, "image_grid_thw": np.asarray(grid).reshape(-1, 3).tolist(),
                                                 "input_ids": ids.numpy()}, f"example {eid}")  # fmt: skip

        def owner(eid):
            return None if eid is None else image_owner(eid)

        first: dict[Any, tuple[Any, torch.Tensor]] = {}  # each owner's first example: its tokens are checked
        for eid, ids, _ in found:
            if self.images.get(owner(eid), ([], []))[0]:
                first.setdefault(owner(eid), (eid, ids))
        if self.workers > 1 and len(first) > 1:
            self._pool = self._pool or ThreadPoolExecutor(self.workers, thread_name_prefix="raypack-images")
            done = dict(zip(first, self._pool.map(one, first.values())))
        else:
            done = {o: one(item) for o, item in first.items()}
        return [done.get(owner(eid), {}) for eid, _, _ in found]

    def __call__(self, rows: Sequence[Mapping[str, Any]], padded: bool = False, pad_token_id: int = 0) -> dict[str, Any]:
        examples = self.examples(rows)
        if not padded:
            batch = collate_vision_packed(examples)
            if self.tower is not None and "image_grid_thw" in batch:
                batch.update(vision_tower.plan_batch(self.tower, batch, image_token_id(self.model.config)))
            return batch
        return collate_vision_padded(examples, image_token_id(self.model.config), pad_token_id)
