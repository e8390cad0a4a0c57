"""A mixture-of-experts router's load-balancing loss, exact per example on packed rows
(`train.router_aux_loss_coef`, `train.router_aux_loss`): the third training objective beside
SFT's token loss (raypack/train/objectives/loss.py) and DPO's pair loss (raypack/train/objectives/dpo.py), in their
shape: the host finds each micro-batch's units, the step sums on the device, and its mean is
read a step late with the loss.

    router = make_router_loss(model, cfg.train, name)    # once at setup; None: off (dense, or 0)
    batch.update(router.units(batch))                    # host: which example owns each token
    with router.routers.capture() as calls:
        loss_sum = loss(engine, batch)
    aux_sum, load = router.sums(calls, batch)            # device: Σ over the units, [layers, E] load
    engine.backward(loss_sum * scale + coef * aux_sum * world * accum / U)

Scopes. `example` (default): a unit is one example, the tokens between two of the packed row's
boundaries (cu_seq_lens, from collate on the host; a padded batch's rows), so

    row:      a0 a1 a2 a3 | b0 b1 b2          units  0  0  0  0  1  1  1
    loss    = ( L(a) + L(b) + ... ) / U       U: the examples of the whole step, every rank

where L(x) is what the example gives alone: packing, strategy, micro-batches and ranks change
nothing. `micro_batch`: a unit is a micro-batch, all its real tokens pooled, which is transformers'
value on that micro-batch (and TRL's, Axolotl's and LLaMA-Factory's, which call it): it depends on
which examples share a row. Pad tokens of a padded batch belong to no unit (transformers masks them
with the attention mask).

L over a unit's n tokens, with the router calls of every MoE layer l (1..Λ), E experts, top k:

    softmax (transformers' load_balancing_loss_func, pooled over the layers as it pools them):
        f_e = Σ_l Σ_t [e in top-k of softmax(z_lt)] / (Λ n),  P_e = Σ_l Σ_t softmax(z_lt)_e / (Λ n)
        L   = E Σ_e f_e P_e                                     (k when balanced)
    sigmoid (DeepSeek-V3's sequence-wise balance loss, per layer, summed over the layers):
        s'_lt = σ(z_lt) / Σ_e σ(z_lt)_e,  f_le = E / (k n) Σ_t [e chosen by the router],  P_le = Σ_t s'_lte / n
        L   = Σ_l Σ_e f_le P_le                                 (Λ when balanced)

Computed with one scatter per layer over the unit ids, on the device; nothing is read. No model
raypack packs has a router z-loss in transformers 5.24, so there is none here.

Expert load. Each step also sums, per MoE layer, the tokens routed to each expert (the router's own
choice), [Λ, E], over its micro-batches and ranks in the loss's all_reduce: the reports' busiest
expert's share over the mean per layer, and the heatmap (raypack/train/objectives/expert_load.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from raypack.config.sections import TrainConfig
from raypack.errors import InputError
from raypack.model.facts import describe
from raypack.model.routers import RouterCall, RouterNotFoundError, Routers, find_routers

DEFAULT_COEF = 0.001
"""`auto` for an MoE model whose config names no router_aux_loss_coef: TRL's default."""
UNIT_KEYS = ("router_units", "router_unit_count", "router_unit_tokens")
"""Batch keys `units` fills on the host; popped before the model's forward."""


def resolve_coef(setting: str | float, config: Any, moe: bool) -> float:
    """train.router_aux_loss_coef: a number as set; `auto`: the model config's, 0.001 for an MoE
    model whose config names none, 0 for a dense one."""
    if setting != "auto":
        return float(setting)
    if not moe:
        return 0.0
    named = describe(config).router_coef
    return DEFAULT_COEF if named is None else named


def batch_units(batch: dict[str, Any], scope: str) -> dict[str, Any]:
    """Host tensors: each token's unit (the pad tokens' is `count`, dropped), the unit count and
    each unit's tokens. Packed batches from cu_seq_lens, padded ones from the attention mask."""
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].long()
        lengths = cu[1:] - cu[:-1]
        units = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        real = torch.ones(int(cu[-1]), dtype=torch.bool)
    else:
        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(batch["input_ids"])
        real = mask.reshape(-1).bool()
        lengths = mask.sum(1)
        units = torch.arange(mask.shape[0]).repeat_interleave(mask.shape[1])
    if scope == "micro_batch":
        units, lengths = torch.zeros_like(units), lengths.sum().reshape(1)
    count = len(lengths)
    units = torch.where(real, units, count)
    return {"router_units": units, "router_unit_count": count, "router_unit_tokens": lengths.double()}


def unit_losses(calls: list[RouterCall], units: torch.Tensor, count: int, tokens: torch.Tensor, kind: str,
                num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each unit's loss [count] fp32, the layers' expert load [layers, E] fp64): see the module
    docstring. `units` [tokens]: each token's unit in 0..count (count: none); `tokens` [count]."""
    device = calls[0].logits.device
    n = tokens.to(device=device, dtype=torch.float32).clamp_min(1)
    slots = count + 1  # the last one collects pad tokens, then is dropped
    flat = (units[:, None] * num_experts).to(device)
    load = []
    if kind == "softmax":
        chosen = torch.zeros(slots * num_experts, dtype=torch.float32, device=device)
        prob = torch.zeros(slots, num_experts, dtype=torch.float32, device=device)
        for call in calls:
            p = torch.softmax(call.logits, dim=-1)
            top = torch.topk(p, top_k, dim=-1).indices  # as transformers' function chooses
            chosen = chosen.index_add(0, (flat + top).reshape(-1), torch.ones(top.numel(), device=device))
            prob = prob.index_add(0, units.to(device), p.float())
            load.append(_load(call.selected, units, count, num_experts))
        layers = len(calls)
        f = chosen.view(slots, num_experts)[:count] / (layers * n[:, None])
        P = prob[:count] / (layers * n[:, None])
        return num_experts * (f * P).sum(-1), torch.stack(load)
    total = torch.zeros(count, dtype=torch.float32, device=device)
    for call in calls:
        s = torch.sigmoid(call.logits.float())
        s = s / s.sum(-1, keepdim=True)
        sel = call.selected.to(device)
        chosen = torch.zeros(slots * num_experts, dtype=torch.float32, device=device)
        chosen = chosen.index_add(0, (flat + sel).reshape(-1), torch.ones(sel.numel(), device=device))
        P = torch.zeros(slots, num_experts, dtype=torch.float32, device=device).index_add(0, units.to(device), s)
        f = chosen.view(slots, num_experts)[:count] * (num_experts / (top_k * n[:, None]))
        total = total + (f * P[:count] / n[:, None]).sum(-1)
        load.append(_load(sel, units, count, num_experts))
    return total, torch.stack(load)


def _load(selected: torch.Tensor, units: torch.Tensor, count: int, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert by one router call, pad tokens left out: [E] fp64."""
    real = (units < count).to(selected.device, torch.float64)
    counts = torch.zeros(num_experts, dtype=torch.float64, device=selected.device)
    return counts.index_add(0, selected.reshape(-1), real.repeat_interleave(selected.shape[-1]))


@dataclass
class RouterLoss:
    """The router objective of a run: its routers, coefficient and scope."""

    routers: Routers
    coef: float
    scope: str = "example"

    @property
    def layers(self) -> int:
        return self.routers.layers

    @property
    def experts(self) -> int:
        return self.routers.num_experts

    def units(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch_units(batch, self.scope)

    def sums(self, calls: list[RouterCall], batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ over the micro-batch's units of their loss, fp32 scalar with grad; the expert load
        [layers, E] fp64) from the router calls of its forward."""
        tokens = batch["router_units"].numel()
        calls = self.routers.per_layer(calls)
        if len(calls) != self.layers or any(c.logits.shape[0] != tokens for c in calls):
            raise RuntimeError(f"the model's {self.layers} routers ran on {_counts(calls)} tokens in one forward of "
                               f"{tokens}; raypack expects each MoE layer's router to score every token once "
                               "(train.router_aux_loss_coef: 0 trains without it)")
        if self.coef and calls[0].logits.grad_fn is None and torch.is_grad_enabled():
            raise RuntimeError("the router scores carry no gradient (a reentrant gradient checkpoint?): the router "
                               "loss would train nothing; set train.router_aux_loss_coef: 0")
        losses, load = unit_losses(calls, batch["router_units"], int(batch["router_unit_count"]),
                                   batch["router_unit_tokens"], self.routers.kind, self.experts, self.routers.top_k)
        return losses.sum(), load

    def probe(self, forward, batch: dict[str, Any], name: str) -> None:
        """One forward of a probe batch (every rank: ZeRO-3 gathers collectively): each router must
        run once, with the kernels and wrappers the run applies (a kernel that replaced the MoE
        block's router would leave the hooks silent). Refused before training otherwise."""
        with torch.no_grad(), self.routers.capture() as calls:
            forward(**batch)
        tokens = batch["input_ids"].numel()
        calls = self.routers.per_layer(calls)
        if len(calls) != self.layers or any(c.logits.shape[0] != tokens for c in calls):
            raise RouterNotFoundError(
                f"model.name {name!r}: its {self.layers} routers ran on {_counts(calls)} tokens in a probe forward of "
                f"{tokens} (expected every token once each; a kernel or wrapper may replace them), so raypack can't "
                "read their scores; set train.router_aux_loss_coef: 0 to train it without the router loss")

    def read(self, values: dict[str, float], readings: list[float]) -> dict[str, Any]:
        """A step's values from its summed readings (Pending.more): the mean router loss over the
        step's units, and the expert load, [layers, E] tokens (raypack/train/objectives/expert_load.py)."""
        return {"router_aux_loss": readings[0] / max(values["router_units"], 1.0),
                "router_load": np.asarray(readings[1:], dtype=np.float64).reshape(self.layers, self.experts)}

    def describe(self) -> str:
        return f"coefficient {self.coef:g}, per {self.scope.replace('_', '-')}; {self.routers.describe()}"


def _counts(calls: list[RouterCall]) -> str:
    return "none of the" if not calls else ", ".join(str(c.logits.shape[0]) for c in calls)


def check_router_setting(train: TrainConfig, config: Any, name: str) -> float:
    """The coefficient this run's router loss will have (0: none), from the model's config alone
    (the driver's check before Ray starts, and the worker's); refuses a number above 0 on a dense
    model and what the router loss can't do exactly yet (sequence parallelism)."""
    moe = bool(describe(config).experts)
    coef = resolve_coef(train.router_aux_loss_coef, config, moe)
    if coef == 0:
        return 0.0
    if not moe and train.router_aux_loss_coef != "auto":
        raise RouterNotFoundError(f"model.name {name!r}: train.router_aux_loss_coef={coef:g}, but it is not a "
                                  "mixture-of-experts model (no router); set train.router_aux_loss_coef: auto or 0")
    if train.sequence_parallel > 1:
        # each rank of a group routes a share of every example's tokens: their per-example sums
        # would have to be combined across the group before the product f * P
        raise InputError(
            f"model.name {name!r}: train.router_aux_loss_coef={coef:g} with train.sequence_parallel="
            f"{train.sequence_parallel}: the router loss is not combined across a sequence-parallel group yet; set "
            "train.sequence_parallel: 1, or train.router_aux_loss_coef: 0 to train without the router loss")
    return coef


def make_router_loss(model: nn.Module, train: TrainConfig, name: str,
                     probe: dict[str, Any] | None = None) -> RouterLoss | None:
    """The run's router objective, or None: a dense model, or a coefficient of 0 (explicit, or
    `auto` on a model that has none). An MoE model whose router can't be found with a coefficient
    above 0 is refused (RouterNotFoundError, naming it)."""
    coef = check_router_setting(train, getattr(model, "config", None), name)
    if coef == 0:
        return None
    routers = find_routers(model, name, probe)
    if routers is None and train.router_aux_loss_coef != "auto":
        raise RouterNotFoundError(f"model.name {name!r}: train.router_aux_loss_coef={coef:g}, but it builds no "
                                  "mixture-of-experts layer (no router); set train.router_aux_loss_coef: auto or 0")
    return RouterLoss(routers, coef, train.router_aux_loss) if routers is not None else None


def step_units(batches: list[dict[str, Any]]) -> int:
    """This rank's units of one step (host numbers: `units` put them in the batches)."""
    return int(sum(int(b.get("router_unit_count", 0)) for b in batches))

