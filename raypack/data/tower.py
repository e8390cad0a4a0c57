"""The vision tower's work in the plan: what each image example costs the tower, in the language
model's units, so that the `balanced` layout evens it out over the ranks with the rest.

A rank's step costs the language model's work on its tokens (linear in tokens; attention in
each example's length²) plus, for image examples, the vision tower's on their patches:

    tower per example = patch_flops x patches  +  image_flops x Σ_images patches²
                        (linear layers, windowed   (attention over a whole image, in the
                         attention: per patch)      blocks that attend over all of it)

The planner balances two figures per rank, tokens and Σ len² (raypack/data/balance.py). The
tower's cost is counted into each: an example's linear work becomes `length + w_l x patches` and
its attention `length² + w_a x Σ patches²`, where the weights are the tower's training FLOPs over
the language model's (`TowerCost`, computed from the model's config by
raypack/train/memory/vision.py), so a patch counts as the share of a token it costs. Nothing else
changes: packs are still filled to the budget in real tokens, and text-only data plans as before.

Per example the data holds `patches` and `Σ patches²` (`grid_work`, from `image_grid_thw`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa


class TowerCost(NamedTuple):
    """Training FLOPs of a VLM's vision tower and of its language model, per unit of the work the
    plan counts (raypack/train/memory/vision.py: `Tower.cost`)."""

    patch_flops: float
    """Tower, per patch: its linear layers (blocks, patch embedding, projector) and the
    attention of windowed blocks, whose windows have a fixed size."""
    image_flops: float
    """Tower, per patch² of an image: the attention of blocks that attend over the whole image."""
    token_flops: float
    """Language model, per token: its linear layers and head."""
    length_flops: float
    """Language model, per length² of an example: causal attention."""

    @property
    def linear_weight(self) -> float:
        """What a patch adds to an example's linear work, in tokens."""
        return self.patch_flops / self.token_flops

    @property
    def attention_weight(self) -> float:
        """What an image's patches² add to an example's attention cost, in length²."""
        return self.image_flops / self.length_flops

    def extra(self, work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per example (rows of `work`: patches, Σ patches²), the linear work and the attention
        cost the tower adds, in the language model's units (what the balance adds)."""
        return self.linear_weight * work[:, 0], self.attention_weight * work[:, 1]

    def flops(self, work: np.ndarray) -> np.ndarray:
        """Per example, the tower's training FLOPs."""
        return self.patch_flops * work[:, 0] + self.image_flops * work[:, 1]

    def key(self) -> list[float]:
        """What keys packed data planned with it (raypack/data/cache.py: packed_key)."""
        return [float(f"{self.linear_weight:.6g}"), float(f"{self.attention_weight:.6g}")]


def grid_work(grids: pa.Array) -> np.ndarray:
    """(rows, 2) float64: each row's patches and Σ patches² over its images, from a column of
    flattened `image_grid_thw` lists (3 ints an image: t, h, w; patches = t·h·w); 0 for text rows."""
    grids = grids.combine_chunks() if isinstance(grids, pa.ChunkedArray) else grids
    rows = len(grids)
    out = np.zeros((rows, 2))
    if rows == 0:
        return out
    filled = grids.fill_null([]) if grids.null_count else grids
    per_row = np.asarray(filled.value_lengths().to_numpy(zero_copy_only=False)) // 3
    values = np.asarray(filled.flatten().to_numpy(zero_copy_only=False), np.float64).reshape(-1, 3)
    patches = values.prod(axis=1)
    row = np.repeat(np.arange(rows), per_row)
    out[:, 0] = np.bincount(row, weights=patches, minlength=rows)
    out[:, 1] = np.bincount(row, weights=patches * patches, minlength=rows)
    return out


def tower_extra(work: np.ndarray | None, cost: TowerCost | None) -> tuple[np.ndarray, np.ndarray] | None:
    """What `make_plan` takes as `extra`: `cost.extra(work)` where the data has images (`work`) and
    the model's tower is known (`cost`); None otherwise, and the plan is the text plan."""
    return None if work is None or cost is None else cost.extra(work)


def pack_work(plan, per_example: np.ndarray) -> np.ndarray:
    """Per pack of `plan` (index = pack id), the sum of its examples' `per_example` values
    (indexed like the planner's lengths)."""
    return np.bincount(plan.pack, weights=per_example[plan.example], minlength=plan.num_packs)


def tower_stats(plan, cost: TowerCost, work: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """The tower's figures of `plan` over examples of `lengths` and `work` (rows as in `grid_work`):
    the imbalance (Σ over steps of the busiest rank's / of the mean rank's, raypack/data/stats.py)
    of the tower's training FLOPs and of all of a step's (language model and tower: what its wall
    time follows, where the plan's own figures count the language model alone) with the tower's
    worst step, and the most patches a micro-batch runs through the tower (what the memory
    estimate sizes its activations for)."""
    from raypack.data.stats import imbalance

    tower = cost.flops(work)
    tower_imbalance, worst = imbalance(pack_work(plan, tower), plan.num_ranks)
    size = np.asarray(lengths, np.float64)
    total, _ = imbalance(pack_work(plan, cost.token_flops * size + cost.length_flops * size * size + tower),
                         plan.num_ranks)  # fmt: skip
    return {"tower_imbalance": tower_imbalance, "tower_imbalance_worst": worst, "work_imbalance": total,
            "widest_patches": int(pack_work(plan, work[:, 0]).max(initial=0))}
