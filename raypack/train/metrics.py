"""Training metrics: tokens/s over real tokens, MFU (and the FLOP count behind it), memory, and
throttled reporting.

`ray.train.report` blocks: on a barrier across the workers through Ray Train's controller, then
until the controller drains its one-slot queue on a health-check poll (2 s by default; raypack
sets 0.1 s), so reporting every step costs up to seconds a step. `Reporter` therefore writes
every step to the trackers (TensorBoard, W&B: raypack/train/tracking.py) and calls
`ray.train.report` only every N steps: train.report_every_steps, or by default (null) the N that
keeps reports under 1% of the training time (`cadence`), chosen again at each report from the
last report's time and the window's time a step, the slowest rank's of each, so that every rank
picks the same next step.

Time. `train_time_s` is the run's training wall time: its steps, data reads, reports and
checkpoints, but not start-up (model build, restore) and not evaluation, which the loop times
and hands to `Reporter.exclude`. Throughput (`tokens_per_s`, per report window) is real tokens
over that time, so an eval pass in a short window no longer halves it. The running `Totals`
(`tokens_seen`, `train_time_s`, `eval_time_s`) are cumulative and survive a restart: the
Reporter adds to the one `Totals` object the loop's checkpointed state holds, which is what
learning curves and time-to-quality need.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raypack.data.progress import duration
from raypack.train.objectives.expert_load import ExpertLoad
from raypack.train.stepvalues import rank_imbalance
from raypack.train.tracking import Trackers

REPORTED = (
    "step", "epoch", "loss", "eval_loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_step", "tokens_seen",
    "train_time_s", "eval_time_s", "step_time_s", "data_wait_s", "rank_imbalance", "peak_memory_gb",
    "window_peak_memory_gb", "memory_gb", "mfu", "total_steps", "steps_per_epoch", "packing_efficiency", "padding_fraction",
    "token_imbalance", "attention_imbalance",
    "workers",  # an elastic run's (train.num_workers: [min, max]): its size at each step
    # train.objective: dpo (raypack/train/objectives/dpo.py, TRL's names)
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_rewards/margins",
    "eval_logps/chosen", "eval_logps/rejected",
    # MoE models with the router loss (raypack/train/objectives/expert_load.py)
    "router_aux_loss", "expert_load_max", "expert_load_worst_layer",
)
"""Every metric a report can carry (`Reporter.summary` and the static values the loop adds);
what a sweep may rank trials by."""

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices (and the CPU) report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def source_eval_losses(metrics: dict[str, Any]) -> dict[str, float]:
    """A mixture's per-source eval losses in `metrics` (`eval_<name>_loss`, raypack/train/loop.py
    evaluate), in their order: what each eval line and the run's summary show beside eval_loss."""
    return {k: v for k, v in metrics.items()
            if k.startswith("eval_") and k.endswith("_loss") and k != "eval_loss" and v is not None}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_gb() -> float:
    """Peak device memory on CUDA; the process's peak resident memory on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_gb() -> float | None:
    """Device memory allocated now, between steps: the weights, optimizer state and whatever else
    outlives a step (the peak adds a step's activations and gradients on top). CUDA only."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def window_peak_memory_gb() -> float:
    """`peak_memory_gb` since the last call: on CUDA the allocator's peak is reset after reading it,
    so each report's window has its own (the CPU's resident peak can't be reset)."""
    peak = peak_memory_gb()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return peak


def model_flops_per_token(model_config: Any, seq_len_sq_mean: float, seq_len_mean: float | None = None,
                          adapter_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU:

        6 * N  +  12 * L * H * D * ctx
        4 * N  +  6 * A  +  12 * L * H * D * ctx      with A adapter parameters (LoRA) on frozen weights

    N counts the non-embedding parameters (matmul weights, tied or not, plus the LM head); L is
    the number of layers, H * D the attention width, and ctx the mean causal context a token sees.
    For packed examples of lengths l_i, a token attends to (l+1)/2 keys on average, weighted by
    tokens: ctx = sum(l_i^2) / (2 * sum(l_i)) = seq_len_sq_mean / (2 * seq_len_mean). Pass
    `seq_len_mean` when you have it; without it ctx = sqrt(seq_len_sq_mean) / 2, exact for equal
    lengths. Windowed layers are not discounted (an upper bound for sliding-window models).
    Frozen weights do their forward (2N) and pass gradients back through activations (2N), but
    compute no weight gradient (the other 2N); the adapters train in full (6A). A VLM counts its
    language model's (the vision tower's work is left out: MFU counts text tokens' FLOPs).
    """
    from raypack.model.facts import describe

    f = describe(model_config)
    hidden = f.hidden
    # per layer: Gemma 4's full-attention layers are wider than its sliding ones
    attn_params = sum(hidden * d * (2 * h + 2 * kv) for h, kv, d in f.attention)  # q, o, k, v
    mlp_params = 3 * hidden * f.inter  # gate, up, down (SwiGLU families)
    n = attn_params + f.layers * mlp_params + hidden * f.vocab  # + LM head
    mean = seq_len_mean if seq_len_mean else seq_len_sq_mean**0.5
    ctx = seq_len_sq_mean / (2.0 * mean)
    weights = 6.0 * n if adapter_params is None else 4.0 * n + 6.0 * adapter_params
    return weights + 12.0 * sum(h * d for h, _, d in f.attention) * ctx


REPORT_SHARE = 0.01
"""The most of the training time that reports may take, with train.report_every_steps null."""
FIRST_REPORT = 10
"""The first report's step with train.report_every_steps null, before any report has been timed."""


def cadence(report_s: float, step_s: float, share: float = REPORT_SHARE) -> int:
    """Steps between reports so that one report of `report_s` seconds costs at most `share` of the
    steps' time (`step_s` each)."""
    if step_s <= 0:
        return FIRST_REPORT
    return max(1, math.ceil(report_s / (share * step_s)))


@dataclass
class Totals:
    """Running totals of a run, carried across restarts in its checkpoints."""

    tokens_seen: float = 0.0
    """Real tokens trained so far (all ranks)."""
    train_time_s: float = 0.0
    """Training wall time so far: steps, data reads, reports and checkpoints (not start-up, not eval)."""
    eval_time_s: float = 0.0


@dataclass
class Reporter:
    """Aggregates per-step values between reports; rank 0 also feeds the trackers and prints progress."""

    rank: int
    total_steps: int
    report_every: int | None
    """Steps between reports; None: `cadence`'s, chosen at each report."""
    static: dict[str, Any]
    """Values fixed for the run (packing efficiency, padding fraction) added to every report."""
    trackers: Trackers = field(default_factory=Trackers)
    """TensorBoard, W&B and MLflow (raypack/train/tracking.py); none by default."""
    flops_per_token: float | None = None
    totals: Totals = field(default_factory=Totals)
    """Added to at every report; the loop passes the one its checkpointed state holds."""
    epochs: int = 1
    eta: Eta | None = None
    """The time-left estimate the progress line shows; None: steps only."""
    gather: Callable[[list[float]], np.ndarray] | None = None
    """Every rank's values as a [world, n] array (HostCounts.gather): each step's device time for the
    rank imbalance, and the report and step times the cadence is chosen from; None on one rank."""
    weight_key: str = "label_tokens"
    """The per-step count a window's loss is averaged over: label tokens (SFT), pairs (DPO)."""
    means: tuple[str, ...] = ()
    """More per-step values reported as their window's mean, weighted like the loss (DPO's rewards)."""
    experts: ExpertLoad | None = None
    """An MoE run with the router loss: its aux loss, expert load and heatmap at each report."""
    _window: list[dict[str, float]] = field(default_factory=list)
    _peak_memory: float = 0.0
    _next_report: int = FIRST_REPORT
    _report_s: float = 0.0
    _last: float = field(default_factory=time.perf_counter)
    _excluded: float = 0.0

    def start_clocks(self) -> None:
        """Start the clocks now, after start-up (model build, restore)."""
        self._last, self._excluded = time.perf_counter(), 0.0

    def exclude(self, seconds: float) -> None:
        """An evaluation since the last report took `seconds`: not training time."""
        self._excluded += seconds
        if self.eta is not None:
            self.eta.evaluated(seconds)

    def checkpointed(self, seconds: float) -> None:
        """A checkpoint took `seconds` (still training time: it is part of what a run costs)."""
        if self.eta is not None:
            self.eta.checkpointed(seconds)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self._window.append(values)
        self.trackers.scalars(step, values)

    @property
    def unreported(self) -> int:
        """Steps logged since the last report (`summary`)."""
        return len(self._window)

    def due(self, step: int) -> bool:
        if step == self.total_steps:
            return True
        if self.report_every is not None:
            return step % self.report_every == 0
        return step >= self._next_report

    def reported(self, seconds: float) -> None:
        """The report just made (without a checkpoint) took `seconds`: what the next cadence pays for."""
        self._report_s = seconds

    def summary(self, step: int, epoch: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Metrics for `ray.train.report`: the window's means, token-weighted where it matters."""
        window, self._window = self._window, []
        tokens = sum(w["tokens"] for w in window)
        # Wall time since the last report, so that blocking reports, checkpoints and data reads
        # between steps count against throughput; step_time_s is the time inside train_step.
        # Evaluation does not: it is not training, and its share of a short window is large.
        now = time.perf_counter()
        seconds = max(now - self._last - self._excluded, 0.0)
        totals = self.totals
        totals.eval_time_s += self._excluded
        self._last, self._excluded = now, 0.0
        totals.tokens_seen += tokens
        totals.train_time_s += seconds
        if self.eta is not None:
            self.eta.trained(len(window), seconds)
        # Steps without a label token (skipped, see step.train_step) weigh nothing; a window of
        # only those has no loss, not a loss of 0.
        key = self.weight_key
        trained = [w for w in window if w[key] > 0]
        weight = sum(w[key] for w in trained)
        mean = lambda name: sum(w[name] * w[key] for w in trained) / weight if weight else None  # noqa: E731
        window_peak = window_peak_memory_gb()
        self._peak_memory = max(self._peak_memory, window_peak)
        # Each rank's device time a step, with the last report's time and this window's time a step
        # (every rank's, so the cadence below is the same on all of them).
        mine = [w.get("busy_s", 0.0) for w in window] + [self._report_s, seconds / max(len(window), 1)]
        every = self.gather(mine) if self.gather is not None else np.asarray([mine])
        if self.report_every is None:
            self._next_report = step + cadence(float(every[:, -2].max()), float(every[:, -1].max()))
        grad_norms = [w["grad_norm"] for w in trained if "grad_norm" in w]
        metrics: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "loss": mean("loss"),
            "skipped_steps": sum(w.get("skipped_steps", 0.0) for w in window),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tokens_per_step": tokens / max(len(window), 1),
            "tokens_seen": totals.tokens_seen,
            "train_time_s": totals.train_time_s,
            "eval_time_s": totals.eval_time_s,
            "step_time_s": sum(w["step_time_s"] for w in window) / max(len(window), 1),
            "data_wait_s": sum(w["data_wait_s"] for w in window) / max(len(window), 1),
            "rank_imbalance": rank_imbalance(every[:, :-2]),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,
            "lr": window[-1]["lr"] if window else 0.0,
            "peak_memory_gb": self._peak_memory,
            "window_peak_memory_gb": window_peak,
            "memory_gb": memory_gb(),
            "mfu": None,
            "eval_loss": None,
            **{name: mean(name) for name in self.means},
        }
        peak = peak_flops()
        if peak and self.flops_per_token:
            # tokens_per_s is summed over ranks; MFU is per device.
            world = window[-1].get("world_size", 1) if window else 1
            metrics["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (peak * world)
        metrics.update(self.static)
        metrics.update(extra or {})
        per_layer: dict[str, float] = {}
        if self.experts is not None:
            routed, per_layer, image = self.experts.summary(window)
            metrics.update(routed)
            if image is not None:
                self.trackers.image(step, "expert_load", image)
        # The step's own values (loss, lr, times, rank imbalance) went to the trackers every step.
        self.trackers.scalars(step, {**{k: v for k, v in metrics.items() if k not in window_keys(window) and k != "step"},
                                     **per_layer})
        self.trackers.report(step, {**metrics, **per_layer})
        if self.rank == 0:
            self._progress(metrics)
        return metrics

    def _progress(self, m: dict[str, Any]) -> None:
        eval_part = f" eval_loss {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else ""
        if per := source_eval_losses(m):  # a mixture's sources: "(chat 1.2345, code 0.9876)"
            eval_part += " (" + ", ".join(f"{k[5:-5]} {v:.4f}" for k, v in per.items()) + ")"
        for key, name in (("rewards/accuracies", "acc"), ("eval_rewards/accuracies", "eval_acc")):  # DPO
            if m.get(key) is not None:
                eval_part += f" {name} {m[key]:.2f}"
        if m.get("router_aux_loss") is not None:  # MoE: the router loss, and the worst layer's busiest expert
            eval_part += (f" aux {m['router_aux_loss']:.4f} experts {m['expert_load_max']:.2f}x mean "
                          f"(layer {m['expert_load_worst_layer']})")
        loss = f"{m['loss']:.4f}" if m["loss"] is not None else "-"
        left = f" left {duration(self.eta.left(m['step']))}" if self.eta is not None else ""
        print(
            f"[raypack] step {m['step']}/{self.total_steps} epoch {m['epoch'] + 1}/{self.epochs} loss {loss}{eval_part} "
            f"tok/s {m['tokens_per_s']:,.0f} data-wait {m['data_wait_s'] * 1e3:.0f}ms "
            f"mem {m['peak_memory_gb']:.2f}GiB{left}",
            flush=True,
        )

    def close(self) -> None:
        self.trackers.close()


def window_keys(window: list[dict[str, float]]) -> set[str]:
    return set().union(*window) if window else set()


@dataclass
class Eta:
    """Time left: the steps left at the measured time a step (evaluation and checkpoints left out),
    plus each evaluation and checkpoint still due at the measured time of one. Before the first of
    either has run its cost is unknown and left out; a mean over every step taken so far would
    instead stretch one pause over all the steps, or hide the pauses still to come."""

    total_steps: int
    eval_every: int
    checkpoint_every: int
    _steps: int = 0
    _step_s: float = 0.0
    _evals: list[float] = field(default_factory=list)
    _checkpoints: list[float] = field(default_factory=list)
    _unbilled: float = 0.0
    """Checkpoint time not yet in a window: the next window's wall time holds it."""

    def trained(self, steps: int, seconds: float) -> None:
        """`steps` took `seconds`, a checkpoint taken since the last window included (taken out here)."""
        self._steps += steps
        self._step_s += max(seconds - self._unbilled, 0.0)
        self._unbilled = 0.0

    def evaluated(self, seconds: float) -> None:
        self._evals.append(seconds)

    def checkpointed(self, seconds: float) -> None:
        self._checkpoints.append(seconds)
        self._unbilled += seconds

    def left(self, step: int) -> float:
        if not self._steps:
            return 0.0
        left = self._step_s / self._steps * (self.total_steps - step)
        for every, taken in ((self.eval_every, self._evals), (self.checkpoint_every, self._checkpoints)):
            if taken:
                left += sum(taken) / len(taken) * due_between(step, self.total_steps, every)
        return left


def due_between(step: int, total: int, every: int) -> int:
    """Events due after `step` up to `total`, at every `every` steps (0: none) and at the last step."""
    if step >= total:
        return 0
    periodic = total // every - step // every if every > 0 else 0
    return periodic + (0 if every > 0 and total % every == 0 else 1)
