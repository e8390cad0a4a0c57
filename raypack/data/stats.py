"""Plan statistics: how full the packs are and how evenly the ranks of each step are loaded.

Definitions (the same for every strategy, so a sweep compares like with like):

- `efficiency`: real tokens / capacity tokens. Capacity is the padded size for pad / pad_sorted
  (each minibatch padded to its longest example) and `budget` per pack for every other strategy
  (a flatten row longer than the budget counts its own length, so efficiency stays <= 1). Empty
  packs count a full budget: they are a wasted micro-batch.
- `lower_bound_ratio`: ceil(total / budget) / packs, the share of the least possible pack count.
- `padding_fraction`: padding tokens / tokens in the materialized rows. Only pad / pad_sorted pad;
  an empty pack is a 1-token padding row.
- `token_imbalance` / `attention_imbalance`: the wall-time overhead of imbalance. A step lasts as
  long as its busiest rank, so the figure is Σ over steps of the busiest rank's cost / Σ over
  steps of the mean rank's cost, where a rank's cost is the real tokens (resp. the attention cost,
  Σ squared piece lengths) of its pack at that step; 1.0 means no rank ever waits. (It equals the
  mean over steps of max/mean weighted by each step's total.) A step is one micro-step: with
  gradient accumulation the plan is folded (plan.fold_accumulation) before its stats are taken.
  `*_worst` is the worst single step's max/mean; steps whose ranks are all empty count as 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def imbalance(per_pack: np.ndarray, num_ranks: int) -> tuple[float, float]:
    """(Σ_steps max / Σ_steps mean, worst step's max / mean) of per-pack costs in grid order."""
    grid = per_pack.reshape(-1, num_ranks)
    busiest, mean = grid.max(axis=1), grid.mean(axis=1)
    if len(grid) == 0 or mean.sum() == 0:
        return 1.0, 1.0
    ratio = np.divide(busiest, mean, out=np.ones(len(grid)), where=mean > 0)
    return float(busiest.sum() / mean.sum()), float(ratio.max())


def plan_stats(plan) -> dict[str, Any]:
    """Statistics of a `plan.Plan` (see the module docstring)."""
    tokens = plan.pack_tokens()
    real = int(tokens.sum())
    empty = int((np.bincount(plan.pack, minlength=plan.num_packs) == 0).sum())
    if plan.padded:
        sizes = np.bincount(plan.pack, minlength=plan.num_packs)
        capacity = int((plan.pack_max_piece() * sizes).sum()) + empty * plan.budget
        materialized = int((plan.pack_max_piece() * sizes).sum()) + empty
    else:
        capacity = int(np.maximum(tokens, plan.budget).sum())
        materialized = real + empty
    tok, tok_worst = imbalance(tokens.astype(np.float64), plan.num_ranks)
    att, att_worst = imbalance(plan.pack_attention(), plan.num_ranks)
    return {
        "strategy": plan.strategy,
        "packs": plan.num_packs,
        "steps": plan.num_steps,
        "efficiency": real / capacity if capacity else 1.0,
        "lower_bound_ratio": (-(-real // plan.budget)) / plan.num_packs if plan.num_packs else 1.0,
        "padding_fraction": (materialized - real) / materialized if materialized else 0.0,
        "token_imbalance": tok,
        "attention_imbalance": att,
        "token_imbalance_worst": tok_worst,
        "attention_imbalance_worst": att_worst,
        "empty_packs": empty,
        "seconds": plan.seconds,
    }
