"""The sweep's sections (`tune:` in YAML): what `raypack sweep` searches and how it ranks and stops trials."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from raypack.typed import check as _check


@dataclass(frozen=True, kw_only=True, slots=True)
class AshaConfig:
    SWITCHED_ON_BY: ClassVar = ("tune.scheduler", ("asha",))
    """These settings do something only with tune.scheduler: asha (raypack.typed.unused)."""

    time_attr: Literal["step", "tokens_seen", "training_iteration"] = "step"
    """What ASHA measures progress in: optimizer steps, real tokens trained, or Tune reports."""
    grace_period: int = 10
    """Progress (in `time_attr` units) every trial makes before it can be stopped."""
    reduction_factor: float = 2.0
    """At each rung a trial goes on only if it is in the best 1/reduction_factor so far."""
    max_t: int | None = None
    """Progress at which every trial stops; None: the sweep's longest planned trial."""
    brackets: int = 1
    """ASHA brackets; 1 is plain asynchronous successive halving."""

    def __post_init__(self) -> None:
        _check(self.grace_period > 0, "tune.asha.grace_period", "a positive int", self.grace_period)
        _check(self.reduction_factor > 1, "tune.asha.reduction_factor", "a number > 1", self.reduction_factor)
        _check(self.max_t is None or self.max_t > self.grace_period, "tune.asha.max_t",
               f"null or an int > grace_period ({self.grace_period})", self.max_t)
        _check(self.brackets > 0, "tune.asha.brackets", "a positive int", self.brackets)


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneConfig:
    strategies: tuple[str, ...] = ("pad", "flatten", "bfd", "balanced")
    """Packing strategies to sweep (names of raypack.data.strategies.STRATEGIES)."""
    strategy_space: Literal["grid", "choice"] = "grid"
    """`grid`: every strategy, once per sample; `choice`: each sample draws one."""
    budgets: tuple[int, ...] = ()
    """Pack budgets to sweep; empty keeps `pack.budget`."""
    budget_space: Literal["grid", "choice"] = "grid"
    """`grid` or `choice` over `budgets`, as for strategies."""
    lrs: tuple[float, ...] = ()
    """Learning rates: the values for `grid` / `choice`, or [low, high] for `loguniform`; empty keeps `train.lr`."""
    lr_space: Literal["grid", "choice", "loguniform"] = "grid"
    """How `lrs` is searched; `loguniform` draws from [low, high] on a log scale."""
    lora_ranks: tuple[int, ...] = ()
    """Adapter ranks (`model.peft.r`) to sweep, with `model.peft.method` lora or qlora; empty keeps `model.peft.r`."""
    lora_rank_space: Literal["grid", "choice"] = "grid"
    """`grid` or `choice` over `lora_ranks`, as for strategies."""
    dpo_betas: tuple[float, ...] = ()
    """DPO's beta (`dpo.beta`) to sweep, with `train.objective: dpo`; empty keeps `dpo.beta`. Rank
    such trials by eval_rewards/accuracies: their losses scale with beta and don't compare."""
    dpo_beta_space: Literal["grid", "choice"] = "grid"
    """`grid` or `choice` over `dpo_betas`, as for strategies."""
    router_aux_loss_coefs: tuple[float, ...] = ()
    """Router load-balancing loss coefficients (`train.router_aux_loss_coef`, numbers >= 0, 0: off)
    to sweep on a mixture-of-experts model, e.g. [0, 0.001, 0.01]; empty keeps `train.router_aux_loss_coef`.
    A dense model (no router) refuses a number > 0 before training, as `raypack train` does."""
    router_aux_loss_coef_space: Literal["grid", "choice"] = "grid"
    """`grid` or `choice` over `router_aux_loss_coefs`, as for strategies."""
    num_samples: int = 1
    """Tune's num_samples: the grid runs this many times, and random dimensions are drawn this many
    times. Repeats of one grid point give the run-to-run spread (median and range in the table)."""
    metric: str = "loss"
    """Reported metric that the scheduler and search algorithm rank trials by (e.g. loss, eval_loss)."""
    mode: Literal["min", "max"] = "min"
    """Whether lower or higher `metric` is better."""
    scheduler: Literal["none", "asha"] = "none"
    """`asha` stops weak trials early (asynchronous successive halving, options under `asha`)."""
    asha: AshaConfig = field(default_factory=AshaConfig)
    """Options of `scheduler: asha`."""
    search_alg: Literal["basic", "optuna"] = "basic"
    """`basic`: grid plus seeded random draws (Ray's BasicVariantGenerator); `optuna`: Optuna's TPE
    (pip install 'raypack[optuna]'; every swept dimension must then be `choice` or `loguniform`)."""
    seed: int = 0
    """Seed of the random draws, so a sweep (and its resume) draws the same trials."""
    equal_work: Literal["tokens_per_step", "none"] = "tokens_per_step"
    """`tokens_per_step`: pad / pad_sorted / flatten take budget / mean example length examples per
    micro-batch, so every trial's optimizer step holds about budget x ranks x grad_accum real
    tokens and the trials take about as many steps; `none`: `pack.batch_size` as configured."""
    target_eval_loss: float | None = None
    """Eval loss that "time to target" counts to; None: the worst final eval loss of the trials that ran to the end."""
    max_concurrent_trials: int = 1
    """Trials run at once; each is a full Ray Train run."""

    def __post_init__(self) -> None:
        _check(len(self.strategies) > 0, "tune.strategies", "at least one strategy", self.strategies)
        _check(self.max_concurrent_trials > 0, "tune.max_concurrent_trials", "a positive int", self.max_concurrent_trials)
        _check(self.num_samples > 0, "tune.num_samples", "a positive int", self.num_samples)
        _check(all(b > 0 for b in self.budgets), "tune.budgets", "positive ints", self.budgets)
        _check(all(lr > 0 for lr in self.lrs), "tune.lrs", "positive numbers", self.lrs)
        _check(all(r > 0 for r in self.lora_ranks), "tune.lora_ranks", "positive ints", self.lora_ranks)
        _check(all(b > 0 for b in self.dpo_betas), "tune.dpo_betas", "positive numbers", self.dpo_betas)
        _check(all(c >= 0 for c in self.router_aux_loss_coefs), "tune.router_aux_loss_coefs", "numbers >= 0",
               self.router_aux_loss_coefs)
        if self.lr_space == "loguniform":
            _check(len(self.lrs) == 2 and self.lrs[0] < self.lrs[1], "tune.lrs",
                   "[low, high] with low < high for lr_space: loguniform", self.lrs)
        _check(self.target_eval_loss is None or self.target_eval_loss > 0, "tune.target_eval_loss",
               "null or a positive number", self.target_eval_loss)
        if self.search_alg == "optuna":
            # Optuna samples every dimension itself; Tune's grid_search is not one it can take.
            for name, values, space in (("strategy", self.strategies, self.strategy_space),
                                        ("budget", self.budgets, self.budget_space), ("lr", self.lrs, self.lr_space),
                                        ("lora_rank", self.lora_ranks, self.lora_rank_space),
                                        ("dpo_beta", self.dpo_betas, self.dpo_beta_space),
                                        ("router_aux_loss_coef", self.router_aux_loss_coefs,
                                         self.router_aux_loss_coef_space)):
                _check(len(values) <= 1 or space != "grid", f"tune.{name}_space",
                       "choice (or loguniform for lr) with search_alg: optuna, which cannot search a grid", space)
