"""A sweep's data, prepared once on the driver before any trial starts: tokenize once, pack once
per pack config, and size the padded strategies' minibatches for equal work per optimizer step.

    <experiment>/cache/tokenized/<tokenized_key>/   one per distinct data + tokenize config
    <experiment>/cache/packed/<packed_key>/          one per distinct (strategy, budget)

Every trial's config points `data.cache_path` at that cache, so its Train run finds its packed
rows already there (raypack.data.prepare keys both entries) and neither tokenizes nor packs.
Preparing up front also keeps data preparation out of every trial's wall time, and no two trials
ever write the same entry at once.

Equal work (`tune.equal_work: tokens_per_step`). A packed strategy's micro-batch is one row of at
most `budget` tokens, so its optimizer step holds up to budget x ranks x grad_accum real tokens.
pad, pad_sorted and flatten (the strategies with a `batch_size`) take whole examples instead;
they get `batch_size = budget / mean example length` (a fraction: minibatches of the two nearest
whole sizes), so their steps hold the same number of real tokens on average, and every trial
takes about as many optimizer steps over the same examples. The mean is over the training split.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raypack.config import Config
from raypack.data.cache import packed_root, tokenized, tokenized_key
from raypack.data.listing import Sources
from raypack.data.prepare import prepare, training_examples
from raypack.data.strategies import STRATEGIES
from raypack.tune.space import pack_configs


def equal_work_batch_size(budget: int, mean_length: float) -> float:
    """Examples per micro-batch whose real tokens match a packed row of `budget` on average."""
    return max(1.0, round(budget / mean_length, 3))


@dataclass
class SweepData:
    """What the driver prepared, for the trials (batch sizes) and the report (timings, the rule)."""

    cache: str
    batch_sizes: dict[str, float] = field(default_factory=dict)
    """`strategy/budget` -> pack.batch_size for the strategies that take one (equal work)."""
    steps: dict[str, int] = field(default_factory=dict)
    """`strategy/budget` -> planned optimizer steps of one trial (epochs and max_steps applied)."""
    tokens: dict[str, float] = field(default_factory=dict)
    """`strategy/budget` -> real training tokens of one trial (all epochs; max_steps not applied)."""
    mean_length: dict[int, float] = field(default_factory=dict)
    """budget -> mean training example length (what the equal-work rule divides by)."""
    tokenizations: int = 0
    """Tokenizations this call ran (0 when every entry was already in the cache)."""
    tokenize_s: float = 0.0
    pack_s: float = 0.0
    packed_configs: int = 0
    examples: int = 0

    def max_t(self, time_attr: str) -> int:
        """The longest trial's planned progress in ASHA's units, plus one (ASHA stops at >= max_t)."""
        if time_attr == "tokens_seen":
            return int(max(self.tokens.values(), default=0)) + 1
        return max(self.steps.values(), default=0) + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prepare_sweep_data(base: Config, sources: Sources, cache: str) -> SweepData:
    """Tokenize once per distinct tokenization, then plan and pack every (strategy, budget) the
    sweep can draw, into `cache`. Returns the equal-work batch sizes and what it cost. `sources`:
    the listing of `base.data.paths` (preflight's)."""
    from raypack.model.build import model_config
    from raypack.model.facts import describe
    from raypack.train.memory.estimate import tower_cost

    out = SweepData(cache=cache)
    ranks, accum = base.train.data_parallel, base.train.grad_accum
    config = model_config(base.model.name, base.model.trust_remote_code)
    vision_model = describe(config, base.model.trust_remote_code).vlm
    tower = tower_cost(config, base.model.trust_remote_code)  # None for a text model
    tokenizations: dict[str, Any] = {}
    for strategy, budget in pack_configs(base):
        cfg = with_pack(base, cache, strategy, budget)
        key = tokenized_key(cfg)  # budgets may share one (tokenize.max_length set) or not
        if key not in tokenizations:
            t0 = time.perf_counter()
            tokenizations[key] = tok = tokenized(cfg, sources)
            out.tokenize_s += time.perf_counter() - t0
            out.tokenizations += not tok.reused
            out.examples = max(out.examples, len(tok.ids))
        tok = tokenizations[key]
        train_lengths, _ = training_examples(tok, cfg, sources)
        # a DPO pair is one item of the plan: its two rows, chosen and rejected
        out.mean_length[budget] = float(train_lengths.mean()) * (2 if base.train.objective == "dpo" else 1)
        name = f"{strategy}/{budget}"
        if base.tune.equal_work == "tokens_per_step" and STRATEGIES[strategy].takes_batch_size:
            out.batch_sizes[name] = equal_work_batch_size(budget, out.mean_length[budget])
            cfg = with_pack(base, cache, strategy, budget, out.batch_sizes[name])
        t0 = time.perf_counter()
        prepared = prepare(cfg, ranks, packed_root(cfg, ranks, ""), sources, tok=tok, vision_model=vision_model,
                           tower=tower)
        out.pack_s += time.perf_counter() - t0
        out.packed_configs += 1
        per_epoch = prepared.steps_per_rank // accum
        total = per_epoch * base.train.epochs
        out.steps[name] = min(total, base.train.max_steps or total)
        out.tokens[name] = float(np.sum(train_lengths)) * base.train.epochs
    return out


def with_pack(base: Config, cache: str, strategy: str, budget: int, batch_size: float | None = None) -> Config:
    pack = dataclasses.replace(base.pack, strategy=strategy, budget=budget)
    if batch_size is not None:
        pack = dataclasses.replace(pack, batch_size=batch_size)
    return dataclasses.replace(base, pack=pack, data=dataclasses.replace(base.data, cache_path=cache))
