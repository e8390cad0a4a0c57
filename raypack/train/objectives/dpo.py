"""DPO on packed rows: each pair's loss from its two sequences' summed log-probabilities, the
step's loss the mean over the pairs of the whole optimizer step (`train.objective: dpo`).

    loss = DPOLoss(make_loss(engine, ...), cfg.dpo, reference)  # once at setup (raypack/train/objectives/dpo_reference.py)
    step = loss.prepare_step(rows)                              # the prefetcher's: pairs, their reference
    pending = train_step(engine, step, loss, counts)            # raypack/train/step.py, SFT's step too
    values = pending.resolve()                                  #   read a step late; TRL's metrics
    extra = loss.evaluate(engine, data, group)                  # eval_loss, eval_rewards/accuracies, ...

The loss is TRL's DPOTrainer's (trl/trainer/dpo_trainer.py), per pair, from S = Σ log p over a
completion's tokens for the policy and R for the reference:

    margin   = (S_chosen - R_chosen) - (S_rejected - R_rejected)
    sigmoid  = -(1 - eps) log σ(beta margin) - eps log σ(-beta margin)       (eps: dpo.label_smoothing)
    ipo      = ((S_c - R_c) / n_c - (S_r - R_r) / n_r - 1 / (2 beta))²       (n: completion tokens)
    + sft_weight x Σ chosen-token NLL / chosen tokens                       (dpo.sft_weight: RPO, TRL's `sft`)

Exact over micro-batches, ranks and accumulation, as the SFT loss is (raypack/train/step.py): a
pair's two sequences sit in one row (raypack/data/pairs.py), so each micro-batch's loss is a sum
of whole pairs' losses, and the step divides by the pair count P of the whole step (all its
micro-batches on all ranks), which every rank reads before its first backward, as it reads the
label count for SFT. The NLL term is a token mean over the step's chosen tokens, so its tokens
are weighted P / (chosen tokens of the step) inside the sum. Smoothing follows conservative DPO
(the DPO paper's cDPO and TRL 0.x's `sigmoid`; TRL 1.x moved it to `robust`).

The sums come from the final hidden states a chunk of tokens at a time (raypack/train/objectives/chunked_ce.py,
`chunked_sequence_objective`): the [T, V] logits never exist at once here either. `train.loss:
full` takes the model's logits instead.

Metrics, as TRL names them, means over the step's pairs: rewards/chosen and rewards/rejected
(beta x (S - R)), rewards/accuracies (the share with rewards/chosen > rewards/rejected),
rewards/margins, logps/chosen and logps/rejected (S); eval_ the same over the held-out pairs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from raypack.config import DpoConfig
from raypack.data.collate import collate_packed, example_starts
from raypack.data.formats import IGNORE_INDEX, row_labels
from raypack.data.pairs import CHOSEN, PIECE_MASK, REJECTED
from raypack.data.shards import Prepared, iter_rank_packs
from raypack.train.objectives.chunked_ce import chunked_sequence_objective
from raypack.train.objectives.loss import TARGET_KEYS, CausalLMLoss, label_targets
from raypack.train.prefetch import StepBatch, to_device
from raypack.train.objectives.router_loss import UNIT_KEYS

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""Per-step metrics, as TRL names them: means over the step's pairs (eval_ prefixed for the eval set)."""
SEQUENCE_KEYS = ("sequence", "ref_logps", "completion_tokens")
"""Batch keys prepare_step adds (host tensors): each loss position's sequence in the micro-batch,
each sequence's reference log-probability sum (absent: computed on the fly) and completion tokens."""


@dataclass
class PairStep(StepBatch):
    """One optimizer step's micro-batches of whole pairs."""

    pairs: int = 0
    """Pairs of this rank's micro-batches: this step's share of the loss normalizer."""
    chosen_tokens: int = 0
    """Chosen-completion label tokens (the NLL term's normalizer, dpo.sft_weight)."""


def pair_losses(sums: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor, cfg: DpoConfig) -> torch.Tensor:
    """Each pair's loss from its sequences' log-prob sums (chosen, rejected alternating), the
    reference's, and their completion token counts (see the module docstring)."""
    chosen = sums[0::2] - ref[0::2]
    rejected = sums[1::2] - ref[1::2]
    if cfg.loss == "ipo":
        delta = chosen / tokens[0::2].clamp_min(1) - rejected / tokens[1::2].clamp_min(1)
        return (delta - 1 / (2 * cfg.beta)) ** 2
    z = cfg.beta * (chosen - rejected)
    eps = cfg.label_smoothing
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z) if eps else -F.logsigmoid(z)


def pair_stats(sums: torch.Tensor, ref: torch.Tensor, cfg: DpoConfig) -> torch.Tensor:
    """Σ over the pairs of each METRICS value (divided by the pair count later), fp64."""
    sums, ref = sums.detach().double(), ref.double()
    chosen, rejected = cfg.beta * (sums[0::2] - ref[0::2]), cfg.beta * (sums[1::2] - ref[1::2])
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).double().sum(), (chosen - rejected).sum(),
                        sums[0::2].sum(), sums[1::2].sum()])


class DPOLoss:
    """The DPO objective over a CausalLMLoss's hidden-state capture (chunked or full)."""

    def __init__(self, base: CausalLMLoss, cfg: DpoConfig, gather, reference: dict[int, float] | None = None,
                 adapters_off=None, collate=None):
        """`gather`: loop.global_count (every rank's values, one all_gather). `reference`: example
        id -> reference log-prob sum (precomputed); None computes it on the fly, per micro-batch,
        with the model under `adapters_off()` (LoRA's base). `collate`: a VLM's VisionRows (the
        pairs' images and positions: `pair_batch`); None for a text model."""
        if base.kind == "liger":
            raise ValueError("train.objective: dpo takes train.loss chunked or full")
        self.base, self.cfg, self.gather = base, cfg, gather
        self.ids = self.values = None
        if reference is not None:
            self.ids = np.fromiter(reference.keys(), np.int64, len(reference))
            order = np.argsort(self.ids)
            self.ids, self.values = self.ids[order], np.fromiter(reference.values(), np.float64, len(reference))[order]
        self.adapters_off, self.collate = adapters_off, collate
        self.router = None
        """The policy's router loss (an MoE model: raypack/train/objectives/router_loss.py), set by the loop."""

    # --- host side: pairs of a step ---------------------------------------------------------------

    def prepare_step(self, group: list[dict[str, Any]], padded: bool = False, pad_token_id: int = 0,
                     pin: bool = False) -> PairStep:
        """Collate each packed row of `group` into a micro-batch of whole pairs (prefetch.prepare_step's
        work, plus which sequence every loss position belongs to and the sequences' reference sums)."""
        batches, pairs, chosen_tokens, label_tokens = [], 0, 0, 0
        for row in group:
            batch = pair_batch(row, padded, pad_token_id, self.collate)
            if self.router is not None:  # each sequence (chosen, rejected) a unit of its own, as SFT's examples
                batch.update(self.router.units(batch))
            if self.ids is not None:
                batch["ref_logps"] = torch.from_numpy(self.lookup(row["example_ids"])).float()
            pairs += len(row["example_ids"]) // 2
            chosen_tokens += int(batch["completion_tokens"][0::2].sum())
            label_tokens += len(batch["loss_targets"])
            if pin:
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) and k != "cu_seq_lens_k" else v
                         for k, v in batch.items()}
                if "cu_seq_lens_k" in batch:
                    batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]  # one tensor (collate.move_batch)
            batches.append(batch)
        return PairStep(batches=batches, label_tokens=label_tokens, tokens=sum(int(r["num_tokens"]) for r in group),
                        example_ids=[i for r in group for i in r["example_ids"]], pairs=pairs,
                        chosen_tokens=chosen_tokens,
                        router_units=sum(int(b.get("router_unit_count", 0)) for b in batches))

    def lookup(self, example_ids) -> np.ndarray:
        ids = np.asarray(example_ids, dtype=np.int64)
        at = np.searchsorted(self.ids, ids)
        found = at < len(self.ids)
        found[found] = self.ids[at[found]] == ids[found]
        if not found.all():
            raise RuntimeError(f"no reference log-probability for example {ids[~found][0]}: the reference pass "
                               "did not cover these rows (delete the run's packed/reference folder to compute it again)")
        return self.values[at]

    # --- the loss of one micro-batch ----------------------------------------------------------------

    def __call__(self, forward, batch: dict[str, Any], stats: list | None = None) -> torch.Tensor:
        """Σ over the micro-batch's pairs of their loss (+ the NLL term's share), fp32; `stats`,
        when given, receives the pairs' METRICS sums."""
        batch = {k: v for k, v in batch.items() if k not in UNIT_KEYS}
        sequence, tokens = batch.pop("sequence"), batch.pop("completion_tokens")
        ref = batch.pop("ref_logps", None)
        sft_scale = batch.pop("sft_scale", 0.0)
        if ref is None:
            ref = self.reference_sums(forward, batch, sequence, len(tokens))
        ref = ref.float()

        def objective(sums: torch.Tensor) -> torch.Tensor:
            loss = pair_losses(sums, ref, tokens, self.cfg).sum()
            return loss - sft_scale * sums[0::2].sum() if sft_scale else loss

        loss, sums = self.objective(forward, batch, sequence, len(tokens), objective)
        if stats is not None:
            stats.append(pair_stats(sums, ref, self.cfg))
        return loss

    def objective(self, forward, batch: dict[str, Any], sequence: torch.Tensor, num: int, objective):
        """(objective(S), S): S[k] = Σ log p over sequence k's loss positions, from the model's
        forward on `batch`. Chunked: S found and the objective's gradients taken a chunk of tokens
        at a time (chunked_ce.chunked_sequence_objective); full: from the model's logits."""
        batch = dict(batch)
        labels = batch.pop("labels")
        targets = {k: batch.pop(k) for k in TARGET_KEYS if k in batch}
        if len(targets) != len(TARGET_KEYS):
            targets = label_targets(labels)
        base = self.base
        if base.kind == "full":
            logits = forward(**batch).logits
            flat = logits.reshape(-1, logits.shape[-1]).index_select(0, targets["loss_positions"])
            logps = torch.log_softmax(flat.float(), -1).gather(1, targets["loss_targets"][:, None])[:, 0]
            sums = torch.zeros(num, dtype=torch.float32, device=logps.device).index_add(0, sequence, logps)
            return objective(sums), sums.detach()
        hidden = base.hidden_states(forward, batch)
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets["loss_positions"])
        out: list = []

        def head(h: torch.Tensor) -> torch.Tensor:
            return chunked_sequence_objective(h, base.head.weight, base.head.bias, targets["loss_targets"], sequence,
                                              num, base.chunk, base.transform, objective, out,
                                              dtype=base.dtype)

        return base.through_head(selected, head), out[0]

    @torch.no_grad()
    def reference_sums(self, forward, batch: dict[str, Any], sequence: torch.Tensor, num: int) -> torch.Tensor:
        """The reference's sums for a micro-batch, now: LoRA's base, with the adapters off."""
        if self.adapters_off is None:
            raise RuntimeError("no reference log-probabilities: precomputed ones were not loaded")
        # the router loss is the policy's: the step's capture of its calls is paused here
        paused = self.router.routers.paused() if self.router is not None else contextlib.nullcontext()
        with self.adapters_off(), paused:
            return self.objective(forward, batch, sequence, num, lambda sums: sums.sum())[1]

    # --- as an optimizer step's objective (raypack/train/step.py): the mean over pairs --------------

    names = METRICS
    per = "pairs"

    def counts(self, step: PairStep) -> list[float]:
        return [step.pairs, step.chosen_tokens, step.label_tokens, step.tokens]

    def host(self, sums: list[float]) -> tuple[dict[str, float], float]:
        """The step's host values, and the NLL term's weight on each chosen token's log-prob: P
        over the step's chosen tokens, so that, once the step divides by P, the term is their mean."""
        pairs, chosen_tokens, labels, tokens = sums
        return {"pairs": pairs, "label_tokens": labels, "tokens": tokens}, self.cfg.sft_weight * pairs / max(chosen_tokens, 1.0)

    def micro(self, forward, batch: dict[str, Any], sft_scale: float, stats: list) -> torch.Tensor:
        return self(forward, {**batch, "sft_scale": sft_scale}, stats)

    @torch.no_grad()
    def evaluate(self, engine, data: Prepared, rank: int) -> dict[str, float]:
        """eval_loss (the same objective, mean over the held-out pairs) and eval_ METRICS."""
        global_count = self.gather
        if not data.eval_dir:
            return {}
        engine.eval()
        losses, nll, stats = [], [], []
        pairs = chosen = 0
        for row in iter_rank_packs(data.eval_dir, rank):
            step = self.prepare_step([row], data.padded, data.pad_token_id)
            batch = to_device(step.batches[0], engine.device)
            pairs, chosen = pairs + step.pairs, chosen + step.chosen_tokens
            kept: list = []  # an empty pack runs its forward too: ZeRO-3's gathers are collective
            losses.append(self(engine, {**batch, "sft_scale": 0.0}, kept))
            stats.append(kept[0])
            nll.append(-kept[0][4])  # Σ chosen log-probs, for the NLL term
        engine.train()
        local = [float(sum(losses)) if losses else 0.0, float(sum(nll)) if nll else 0.0, pairs, chosen]
        local += (torch.stack(stats).sum(0).tolist() if stats else [0.0] * len(METRICS))
        summed = global_count(local, engine.device).sum(0).cpu()
        n = float(summed[2])
        if n == 0:
            return {}
        out = {"eval_loss": float(summed[0]) / n + self.cfg.sft_weight * float(summed[1]) / max(float(summed[3]), 1.0)}
        out.update({f"eval_{name}": float(summed[4 + k]) / n for k, name in enumerate(METRICS)})
        return out


def pair_batch(row: dict[str, Any], padded: bool = False, pad_token_id: int = 0, collate=None) -> dict[str, Any]:
    """One packed row of pairs as a micro-batch: collate's keys, the loss targets, and for every
    loss position its sequence (0, 1, ... in row order: chosen, rejected, chosen, ...) and every
    sequence's completion tokens (its labels, before collate masks each sequence's first token).
    `collate`: a VLM's VisionRows, whose batch adds each sequence's images and mRoPE positions
    (one sequence a row when padded, as collate_packed's); None: collate.collate_packed."""
    ids = np.asarray(row["example_ids"], dtype=np.int64)
    if len(ids) % 2 or ((ids[0::2] & PIECE_MASK) != CHOSEN).any() or (ids[1::2] != ids[0::2] + REJECTED).any():
        raise RuntimeError(f"packed row of step {row.get('step')} holds example ids {ids[:6].tolist()}..., not whole "
                           "(chosen, rejected) pairs: this data was packed for another objective")
    batch = (collate_packed if collate is None else collate)([row], padded=padded, pad_token_id=pad_token_id)
    batch.update(label_targets(batch["labels"]))
    positions = batch["loss_positions"].numpy()
    if len(ids) == 0:  # an empty pack (the plan's filler): no pair, no loss position
        sequence, tokens = np.zeros(0, np.int64), np.zeros(0, np.int64)
    else:
        labels = np.asarray(row_labels(row))
        starts = example_starts(row["position_ids"])
        if len(starts) != len(ids):
            raise RuntimeError(f"packed row of step {row.get('step')}: {len(starts)} sequences for {len(ids)} ids")
        tokens = np.add.reduceat((labels != IGNORE_INDEX).astype(np.int64), starts)
        if padded:  # one sequence a row of the [B, L] batch
            sequence = positions // batch["labels"].shape[1]
        else:
            sequence = np.searchsorted(batch["cu_seq_lens_q"].numpy()[1:], positions, side="right")
    batch["sequence"] = torch.from_numpy(np.ascontiguousarray(sequence, dtype=np.int64))
    batch["completion_tokens"] = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).float()
    return batch


def reporter_fields() -> dict[str, Any]:
    """What the Reporter averages differently for DPO: windows weighted by pairs, and the METRICS."""
    return {"weight_key": "pairs", "means": METRICS}
