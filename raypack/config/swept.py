"""A sweep trial's optional parameters, in one table: what the search space, every trial's config
and name, the report's rows, labels and columns, and the sweep's sort order read.

Every trial has a strategy, a budget and an lr; an optional parameter is swept (or kept at the
base config's value) only where it applies, e.g. the adapter rank in a sweep with adapters. A new
one is an entry of OPTIONAL plus its two `tune:` fields (raypack/config/sweep.py). In the config
layer, so that raypack/runs.py (trial names and configs) and the report read it without Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raypack.config import Config


@dataclass(frozen=True)
class OptionalParam:
    name: str
    """Its key in Tune's param space, a trial's params and a report row (and the report's column)."""
    values: str
    """The `tune:` field listing its values."""
    space: str
    """The `tune:` field saying how they are searched (grid or choice)."""
    sets: str
    """The dotted config field each trial sets to its value."""
    prefix: str
    """A trial's name and label carry `-<prefix><value>`."""
    fmt: str
    """Format spec of the value there."""
    applies: Callable[[Config], bool]
    """Whether the sweep has this dimension; where it applies and `values` is empty, every trial
    carries the base config's value."""
    needs: str
    """Why listed values that don't apply are refused (space.check: `tune.<values>: <needs>`)."""

    def part(self, params: dict[str, Any]) -> str:
        value = params.get(self.name)
        return "" if value is None else f"-{self.prefix}{value:{self.fmt}}"


OPTIONAL = (
    OptionalParam("lora_r", "lora_ranks", "lora_rank_space", "model.peft.r", "r", "",
                  lambda c: c.model.peft.enabled,
                  "sweeps adapter ranks, so it needs model.peft.method: lora (or qlora)"),
    OptionalParam("beta", "dpo_betas", "dpo_beta_space", "dpo.beta", "beta", ".3g",
                  lambda c: c.train.objective == "dpo",
                  "sweeps DPO's beta, so it needs train.objective: dpo"),
    # Only where listed: whether a model has MoE layers is known once it is built, and the base
    # config's `auto` is no value to name a trial by. A dense model refuses a number > 0 at the
    # driver's preflight (space.preflight_sweep), as at a run's (router_loss.check_router_setting).
    OptionalParam("router_aux_loss_coef", "router_aux_loss_coefs", "router_aux_loss_coef_space",
                  "train.router_aux_loss_coef", "aux", ".3g",
                  lambda c: bool(c.tune.router_aux_loss_coefs), ""),
)
"""The optional trial parameters, in the order of a trial's name, the report's columns and its sort."""
PARAMS = ("strategy", "budget", "lr", *(p.name for p in OPTIONAL))
"""A trial's parameters: what space.dimensions sweeps, every trial's config and report row carry."""


def get(cfg: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return cfg


def set_field(cfg: Any, dotted: str, value: Any) -> Any:
    """`cfg` (frozen dataclasses) with the field at `dotted` set to `value`."""
    key, _, rest = dotted.partition(".")
    return dataclasses.replace(cfg, **{key: set_field(getattr(cfg, key), rest, value) if rest else value})


def label(params: dict[str, Any]) -> str:
    """A trial's name from its parameters: `bfd-b512-lr0.001`, then each optional one it has."""
    return (f"{params['strategy']}-b{params['budget']}-lr{params['lr']:.3g}"
            + "".join(p.part(params) for p in OPTIONAL))
