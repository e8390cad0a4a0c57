"""The sweep's report: one row per trial (with its reported history), then a Markdown table, a
CSV and three plots (raypack/tune/plots.py). Pure functions of row dicts, tested without Ray.

A row holds the trial's parameters, its status and what its Train run reported:

    status       OK (ran to the end), STOPPED (by the scheduler, before its last step),
                 ERROR, or UNFINISHED (the sweep was interrupted; `raypack sweep --resume`)
    tokens_per_s real tokens / training wall time, over the whole run (not one report window)
    tokens_per_step       real tokens per optimizer step, mean over the run
    epoch_time_s          training wall time per epoch (extrapolated when max_steps cuts one)
    time_to_target_s      training wall time until the first eval at or below the target
    history               every report: step, tokens_seen, train_time_s, loss, eval_loss, ...

Training wall time counts steps, data reads, reports and checkpoints, not start-up or evaluation
(raypack/train/metrics.py).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raypack.config.swept import OPTIONAL, PARAMS
from raypack.config.swept import label as params_label

COLUMNS = (
    "strategy", "budget", "lr", "trial", "status", "steps", "tokens_per_step", "tokens_per_s",
    "epoch_time_s", "time_to_target_s", "loss", "eval_loss", "packing_efficiency", "peak_memory_gb",
)
HISTORY_KEYS = ("step", "tokens_seen", "train_time_s", "eval_time_s", "loss", "eval_loss", "tokens_per_s",
                "total_steps", "steps_per_epoch", "packing_efficiency", "peak_memory_gb", "eval_rewards/accuracies")
"""What a row keeps of each report (every one a number or None)."""
SPREAD_KEYS = ("tokens_per_s", "epoch_time_s", "time_to_target_s", "eval_loss")


@dataclass
class Context:
    """What the report says above the table."""

    title: str = "Packing sweep"
    on_cpu: bool = False
    notes: list[str] = field(default_factory=list)
    """Lines under the title: the equal-work rule, the data, the scheduler."""
    target_eval_loss: float | None = None
    """The configured target; None: the worst final eval loss of the trials that ran to the end."""
    not_started: int = 0
    """Planned trials that Tune had not created when the sweep was interrupted."""


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def result_row(params: dict[str, Any], history: Sequence[dict[str, Any]], error: BaseException | str | None,
               status: str | None = None, trial: str = "") -> dict[str, Any]:
    """One row from a trial's parameters, its reports in order and its error. `status` is Tune's
    saved trial status (RUNNING or PENDING mean the sweep was interrupted before it ended)."""
    history = [{k: _number(h.get(k)) for k in HISTORY_KEYS} for h in history if _number(h.get("step")) is not None]
    last = history[-1] if history else {}
    row: dict[str, Any] = {"strategy": params["strategy"], "budget": params["budget"], "lr": params["lr"],
                           **{p.name: params.get(p.name) for p in OPTIONAL}, "trial": trial, "history": history}
    if params.get("batch_size") is not None:
        row["batch_size"] = params["batch_size"]
    steps, total = last.get("step"), last.get("total_steps")
    row["steps"] = int(steps) if steps is not None else None
    row["total_steps"] = int(total) if total is not None else None
    if error is not None:
        row["status"] = "ERROR"
        text = str(error)
        # A trial's error is a RayTaskError whose last line is the exception that ended the run.
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        name = type(error).__name__ if isinstance(error, BaseException) else "Error"
        row["error"] = (lines[-1] if len(lines) > 1 else f"{name}: {''.join(lines)}")[:300]
    elif status in ("RUNNING", "PENDING", "PAUSED"):
        row["status"] = "UNFINISHED"
    elif steps is not None and total is not None and steps < total:
        row["status"] = "STOPPED"
    else:
        row["status"] = "OK"
    seen, secs = last.get("tokens_seen"), last.get("train_time_s")
    row["tokens_seen"], row["train_time_s"] = seen, secs
    row["tokens_per_s"] = seen / secs if seen and secs else None
    row["tokens_per_step"] = seen / steps if seen and steps else None
    per_epoch = last.get("steps_per_epoch")
    row["epoch_time_s"] = secs / (steps / per_epoch) if secs and steps and per_epoch else None
    row["loss"] = last.get("loss")
    evals = [h["eval_loss"] for h in history if h["eval_loss"] is not None]
    row["eval_loss"] = evals[-1] if evals else None
    accuracies = [h["eval_rewards/accuracies"] for h in history if h["eval_rewards/accuracies"] is not None]
    row["eval_rewards/accuracies"] = accuracies[-1] if accuracies else None  # DPO
    row["packing_efficiency"] = last.get("packing_efficiency")
    row["peak_memory_gb"] = last.get("peak_memory_gb")
    return row


def label(row: dict[str, Any]) -> str:
    """The trial's run name without its suffix (runs.trial_name), then its Tune trial id."""
    return params_label(row) + (f" ({row['trial']})" if row.get("trial") else "")


def target_loss(rows: Sequence[dict[str, Any]], configured: float | None) -> float | None:
    """The eval loss time-to-target counts to: configured, else the worst final eval loss among
    trials that ran to the end (so every one of them reaches it)."""
    if configured is not None:
        return configured
    finals = [r["eval_loss"] for r in rows if r["status"] == "OK" and r.get("eval_loss") is not None]
    return max(finals) if finals else None


def time_to_target(history: Sequence[dict[str, Any]], target: float | None) -> float | None:
    if target is None:
        return None
    for h in history:
        if h.get("eval_loss") is not None and h["eval_loss"] <= target + 1e-12:
            return h.get("train_time_s")
    return None


def with_targets(rows: Sequence[dict[str, Any]], configured: float | None) -> tuple[list[dict[str, Any]], float | None]:
    target = target_loss(rows, configured)
    return [{**r, "time_to_target_s": time_to_target(r.get("history", ()), target)} for r in rows], target


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _every_trial(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        where = f"step {_fmt(r['steps'])} of {_fmt(r['total_steps'])}"
        if r["status"] == "STOPPED":
            what = (f"stopped early by the scheduler at {where} ({_fmt(r['tokens_seen'])} tokens seen, "
                    f"{_fmt(r['train_time_s'])} s of training)")
        elif r["status"] == "ERROR":
            what = f"failed at {where}: {r.get('error', '')}"
        elif r["status"] == "UNFINISHED":
            what = f"unfinished: the sweep was interrupted at {where}; `raypack sweep --resume` runs it"
        else:
            what = f"ran to the end: {where}"
        lines.append(f"- {label(r)}: {what}")
    return lines


def spread(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and range of SPREAD_KEYS over repeats (same strategy, budget, lr and optional
    parameters; trials that ran to the end), for every group with more than one."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "OK":
            groups.setdefault(tuple(r.get(k) for k in PARAMS), []).append(r)
    out = []
    for params, members in groups.items():
        if len(members) < 2:
            continue
        entry: dict[str, Any] = {**dict(zip(PARAMS, params)), "n": len(members)}
        for key in SPREAD_KEYS:
            values = [m[key] for m in members if m.get(key) is not None]
            if values:
                med = statistics.median(values)
                entry[key] = (med, min(values), max(values))
        out.append(entry)
    return out


def format_table(rows: Sequence[dict[str, Any]], context: Context | None = None) -> str:
    """The report in Markdown: notes, one line per trial, every trial's fate, repeats' spread."""
    ctx = context or Context()
    rows, target = with_targets(rows, ctx.target_eval_loss)
    lines = [f"# {ctx.title}", ""]
    if ctx.on_cpu:
        lines += ["**Ran on the CPU: its throughput is not representative of GPU throughput** (CPU attention "
                  "and kernels scale differently with row length and padding; compare strategies on the GPU).", ""]
    lines += [f"- {note}" for note in ctx.notes]
    source = "tune.target_eval_loss" if ctx.target_eval_loss is not None else "the worst final eval loss of the trials that ran to the end"
    lines += [f"- time_to_target_s: training wall time until the first eval at or below {_fmt(target)} ({source}); "
              "training wall time counts steps, data reads, reports and checkpoints, not start-up or evaluation.",
              "- tokens_per_s: real tokens over the run's training wall time; tokens_per_step: real tokens per optimizer step.",
              ""]
    columns = _columns(rows)
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    lines += ["", "## Every trial", "", *_every_trial(rows)]
    if ctx.not_started:
        lines.append(f"- {ctx.not_started} more trial(s) had not started: the sweep was interrupted; "
                     "`raypack sweep --resume` runs them")
    groups = spread(rows)
    if groups:
        keys = [k for k in PARAMS if k in columns]
        lines += ["", "## Repeats: median [min, max]", "",
                  "| " + " | ".join([*keys, "n", *SPREAD_KEYS]) + " |", "|" + "---|" * (len(keys) + 1 + len(SPREAD_KEYS))]
        for g in groups:
            cells = [f"{_fmt(g[k][0])} [{_fmt(g[k][1])}, {_fmt(g[k][2])}]" if k in g else "-" for k in SPREAD_KEYS]
            lines.append("| " + " | ".join([*(_fmt(g[k]) for k in keys), str(g["n"]), *cells]) + " |")
    return "\n".join(lines) + "\n"


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """COLUMNS, with each optional parameter a trial has after lr (the adapter rank in a sweep with
    adapters, DPO's beta in a DPO sweep, the router loss coefficient where swept), and the eval
    reward accuracy after eval_loss in a DPO sweep."""
    i = COLUMNS.index("lr") + 1
    extra = [p.name for p in OPTIONAL if any(r.get(p.name) is not None for r in rows)]
    columns = [*COLUMNS[:i], *extra, *COLUMNS[i:]]
    if any(r.get("beta") is not None for r in rows):
        columns.insert(columns.index("eval_loss") + 1, "eval_rewards/accuracies")
    return columns


def format_csv(rows: Sequence[dict[str, Any]], context: Context | None = None) -> str:
    rows, _ = with_targets(rows, (context or Context()).target_eval_loss)
    out = io.StringIO()
    fields = [*_columns(rows), "total_steps", "tokens_seen", "train_time_s", "batch_size", "error"]
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in fields})
    return out.getvalue()
