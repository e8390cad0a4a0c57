"""Plan statistics: how full the packs are and how evenly the ranks of each step are loaded.

Definitions (the same for every strategy, so a sweep compares like with like):

- `efficiency`: real tokens / capacity tokens. Capacity is the padded size for pad / pad_sorted
  (each minibatch padded to its longest example) and `budget` per pack for every other strategy
  (a flatten row longer than the budget counts its own length, so efficiency stays <= 1). Empty
  packs count a full budget: they are a wasted micro-batch.
- `lower_bound_ratio`: ceil(total / budget) / packs, the share of the least possible pack count.
- `padding_fraction`: padding tokens / tokens in the materialized rows. Only pad / pad_sorted pad;
  an empty pack is a 1-token padding row.
- `token_imbalance` / `attention_imbalance`: for each step, max over ranks / mean over ranks of
  the real tokens (resp. attention cost, sum of squared piece lengths) of the rank's pack; the
  reported value is the mean over steps weighted by the step's total (tokens, resp. attention),
  i.e. the share of extra time the slowest rank adds on average. `*_worst` is the worst single step.
  Steps whose ranks are all empty count as 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _imbalance(per_pack: np.ndarray, num_ranks: int) -> tuple[float, float]:
    grid = per_pack.reshape(-1, num_ranks)
    total = grid.sum(axis=1)
    mean = total / num_ranks
    ratio = np.divide(grid.max(axis=1), mean, out=np.ones(len(grid)), where=mean > 0)
    if len(grid) == 0 or total.sum() == 0:
        return 1.0, 1.0
    return float((ratio * total).sum() / total.sum()), float(ratio.max())


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
    tok, tok_worst = _imbalance(tokens.astype(np.float64), plan.num_ranks)
    att, att_worst = _imbalance(plan.pack_attention(), plan.num_ranks)
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
