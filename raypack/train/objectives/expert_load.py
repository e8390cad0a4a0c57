"""Expert load in view: what each report says about how an MoE model's routers spread tokens.

    load = ExpertLoad(layers=48, experts=128)
    metrics, per_layer, image = load.summary(window)   # window: the steps' values since the last report

Each step's values carry `router_load`, [layers, E] tokens routed to each expert (summed over its
micro-batches and ranks on the device, read a step late with the loss: raypack/train/objectives/router_loss.py).
A report sums its window's and gives:

- `router_aux_loss`: the window's mean router loss (each step's weighted by its units);
- `expert_load/layer_<l>` per MoE layer: the busiest expert's share of the layer's tokens over the
  mean share (1 when even; with top-k routing each token counts for k experts, so at most E/k,
  when one expert takes every token); to TensorBoard, W&B and MLflow;
- `expert_load_max` and `expert_load_worst_layer`: the worst layer's value and its index (printed
  in the run's summary);
- a layers-by-experts heatmap of token shares (an RGB image, one row of cells a layer), logged at
  each report to TensorBoard and W&B as `train/expert_load`: a collapsing router is a bright cell in
  a dark row. Colour is the share over the even share, from dark (no tokens) through the middle
  (even) to bright yellow (twice the even share or more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CELL = 8
"""Pixels a side of one (layer, expert) cell; fewer for wide models (the image stays under ~2k px)."""
# viridis at 0, 0.25, 0.5, 0.75, 1 (matplotlib's), interpolated linearly
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


def shares(load: np.ndarray) -> np.ndarray:
    """[layers, E] token counts -> each layer's shares (a row of none stays 0)."""
    total = load.sum(-1, keepdims=True)
    return np.divide(load, total, out=np.zeros_like(load, dtype=np.float64), where=total > 0)


def busiest_over_mean(load: np.ndarray) -> np.ndarray:
    """Per layer: the busiest expert's tokens over the mean expert's (1: even)."""
    mean = load.mean(-1)
    return np.divide(load.max(-1), mean, out=np.ones_like(mean, dtype=np.float64), where=mean > 0)


def heatmap(load: np.ndarray) -> np.ndarray:
    """[layers * cell, E * cell, 3] uint8: each cell coloured by its share over the even share, /2, clipped."""
    layers, experts = load.shape
    x = np.clip(shares(load) * experts / 2.0, 0.0, 1.0) * (len(_ANCHORS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_ANCHORS) - 2)
    rgb = _ANCHORS[lo] + (x - lo)[..., None] * (_ANCHORS[lo + 1] - _ANCHORS[lo])
    cell = max(1, min(CELL, 2048 // max(experts, 1)))
    return np.repeat(np.repeat(rgb.round().astype(np.uint8), cell, 0), cell, 1)


@dataclass(frozen=True)
class ExpertLoad:
    """The run's MoE layers and experts (RouterLoss.layers, .experts)."""

    layers: int
    experts: int

    def summary(self, window: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float], np.ndarray | None]:
        """(report metrics, per-layer scalars, heatmap) over the steps of `window` that trained."""
        steps = [w for w in window if "router_load" in w]
        if not steps:
            return {"router_aux_loss": None, "expert_load_max": None, "expert_load_worst_layer": None}, {}, None
        load = np.sum([w["router_load"] for w in steps], axis=0)
        units = sum(w["router_units"] for w in steps)
        aux = sum(w["router_aux_loss"] * w["router_units"] for w in steps) / units if units else None
        ratio = busiest_over_mean(load)
        worst = int(ratio.argmax())
        metrics = {"router_aux_loss": aux, "expert_load_max": float(ratio[worst]), "expert_load_worst_layer": worst}
        per_layer = {f"expert_load/layer_{layer}": float(r) for layer, r in enumerate(ratio)}
        return metrics, per_layer, heatmap(load)
