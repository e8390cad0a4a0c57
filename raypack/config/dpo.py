"""The `dpo:` section (preference tuning, `train.objective: dpo`) and what it needs of the others.

    train: {objective: dpo}
    dpo: {beta: 0.1, loss: sigmoid, sft_weight: 0.0, label_smoothing: 0.0, reference: auto}

The loss and what each field means are in raypack/train/objectives/dpo.py; the data (preference rows, pairs
packed whole) in raypack/data/pairs.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from raypack.typed import check as _check


@dataclass(frozen=True, kw_only=True, slots=True)
class DpoConfig:
    SWITCHED_ON_BY: ClassVar = ("train.objective", ("dpo",))
    """These settings do something only with train.objective: dpo (raypack.typed.unused)."""

    beta: float = 0.1
    """How far the policy may move from the reference: the reward is beta x (policy - reference
    log-probability of a completion). For `ipo`, the regularization strength (tau in the IPO paper)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid`: DPO's -log sigmoid(beta x margin); `ipo`: (margin / completion tokens - 1 / (2 beta))^2
    with each completion's log-ratio divided by its token count, as TRL normalizes it."""
    sft_weight: float = 0.0
    """Weight of an NLL term on the chosen completions (RPO; TRL's `sft` loss added to the DPO one):
    Σ chosen-token NLL / chosen tokens over the optimizer step. 0: none."""
    label_smoothing: float = 0.0
    """Conservative DPO (`sigmoid` only): the share of pairs assumed mislabelled, which adds
    -eps x log sigmoid(-beta x margin) to each pair's (1 - eps) x DPO loss."""
    reference: Literal["auto", "precomputed", "on_the_fly"] = "auto"
    """The reference log-probabilities: `precomputed` once before training by a pass over the
    packed rows with the frozen starting model, stored beside them and reused on resume;
    `on_the_fly` (LoRA only: the base with the adapters off) a no-grad forward per micro-batch.
    `auto`: precomputed, which costs what on the fly costs over one epoch and saves a forward a
    row in every later epoch and evaluation (benchmarks/dpo.py measures both: docs/guides/dpo.md)."""

    def __post_init__(self) -> None:
        _check(self.beta > 0, "dpo.beta", "a positive float", self.beta)
        _check(self.sft_weight >= 0, "dpo.sft_weight", "a float >= 0", self.sft_weight)
        _check(0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", "a float in [0, 0.5)", self.label_smoothing)
        _check(self.label_smoothing == 0 or self.loss == "sigmoid", "dpo.label_smoothing",
               "0 with dpo.loss: ipo (conservative DPO smooths the sigmoid loss)", self.label_smoothing)


def check_objective(cfg: Any) -> None:
    """What train.objective: dpo needs of the other sections of `cfg` (a `Config`, which imports
    this module); the strategy's trait is checked with the strategies (raypack/data/strategies.py,
    `check_pairs`)."""
    if cfg.train.objective != "dpo":
        _check(cfg.data.format != "preference", "data.format",
               "not preference with train.objective: sft (preference pairs train with train.objective: dpo)",
               cfg.data.format)
        return
    t = cfg.train
    # A pair's loss is a function of whole-sequence sums; a split row leaves each rank a part of them.
    _check(t.sequence_parallel == 1, "train.sequence_parallel",
           "1 with train.objective: dpo (a pair's loss needs its sequences' whole log-probability sums, which "
           "sequence parallelism would split over ranks)", t.sequence_parallel)
    _check(t.loss != "liger", "train.loss", "chunked or full with train.objective: dpo (Liger's fused "
           "cross-entropy returns one sum, not each sequence's log-probability)", t.loss)
    _check(cfg.data.format in ("auto", "preference"), "data.format",
           "auto or preference with train.objective: dpo", cfg.data.format)
    _check(cfg.tokenize.overlength != "split", "tokenize.overlength",
           "drop or truncate with train.objective: dpo (a pair split into pieces is no pair)", cfg.tokenize.overlength)
    _check(cfg.tokenize.label_mask in ("auto", "completion"), "tokenize.label_mask",
           "auto or completion with train.objective: dpo (the loss is on the chosen and rejected completions)",
           cfg.tokenize.label_mask)
    _check(not cfg.pack.repack_each_epoch, "pack.repack_each_epoch",
           "false with train.objective: dpo (the reference log-probabilities are computed per rank's rows)",
           cfg.pack.repack_each_epoch)
    _check(cfg.dpo.reference != "on_the_fly" or cfg.model.peft.enabled, "dpo.reference",
           "precomputed or auto without model.peft (on the fly needs the reference in memory: the base with "
           "adapters off under LoRA; a full fine-tune would need a second model)", cfg.dpo.reference)
