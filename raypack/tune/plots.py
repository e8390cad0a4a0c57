"""The sweep's plots, from the report's rows (raypack/tune/report.py), as PNG files:

    sweep_throughput_vs_loss.png   tokens/s against final eval loss, one marker per trial
    sweep_learning_curves.png      train loss against tokens seen, one line per trial; an x ends
                                   a trial the scheduler stopped early
    sweep_eval_vs_time.png         eval loss against training wall time, one line per trial,
                                   the time-to-target level as a dashed line

Curves get one colour per trial (up to ten trials), else one per strategy. A sweep that ran on
the CPU says so on every plot.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raypack import storage

CPU_NOTE = "CPU run: throughput not representative of GPU throughput"


def _pyplot():
    # Imported here: pyplot takes ~0.9 s to import, and every trial's process imports the tune
    # package but never draws; only the sweep's driver does, once, at the end.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    return {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(r["strategy"] for r in rows))}


def _line_styles(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """(colour, legend label or None) per row: per trial when they are few, else per strategy."""
    if len(rows) <= 10:
        return [(f"C{i}", f"{r['strategy']} b{r['budget']} lr{r['lr']:.3g}" + (f" {r['trial'][-5:]}" if r.get("trial") else ""))
                for i, r in enumerate(rows)]
    colours, seen, out = _colours(rows), set(), []
    for r in rows:
        out.append((colours[r["strategy"]], None if r["strategy"] in seen else r["strategy"]))
        seen.add(r["strategy"])
    return out


def _save(fig, path: str | Path) -> str | Path:
    plt = _pyplot()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    storage.write_bytes(str(path), png.getvalue())
    return path


def _finish(ax, title: str, on_cpu: bool, legend_title: str | None = "strategy") -> None:
    ax.set_title(title + (f"\n({CPU_NOTE})" if on_cpu else ""), fontsize=9)
    ax.grid(alpha=0.3)
    if legend_title and ax.get_legend_handles_labels()[0]:
        ax.legend(title=legend_title, fontsize=7)


def throughput_vs_loss(rows: Sequence[dict[str, Any]], path: str | Path, on_cpu: bool = False) -> str | Path:
    """Throughput against final eval loss (train loss where a trial has no eval), one marker per
    trial that ran to the end."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colours = _colours(rows)
    for strategy, colour in colours.items():
        points = [(r.get("eval_loss") if r.get("eval_loss") is not None else r.get("loss"), r.get("tokens_per_s"), r)
                  for r in rows if r["strategy"] == strategy and r["status"] == "OK"]
        points = [p for p in points if p[0] is not None and p[1] is not None]
        if not points:
            continue
        ax.scatter([p[0] for p in points], [p[1] for p in points], color=colour, label=strategy, s=50)
        for x, y, r in points:
            ax.annotate(f"b{r['budget']} lr{r['lr']:.3g}", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    failed = [f"{r['strategy']}-b{r['budget']}" for r in rows if r["status"] in ("ERROR", "UNFINISHED")]
    ax.set_xlabel("final eval loss")
    ax.set_ylabel("tokens/s (real tokens, training wall time)")
    _finish(ax, "Packing sweep: throughput vs final loss" + (f" (not shown: {', '.join(failed)})" if failed else ""), on_cpu)
    return _save(fig, path)


def learning_curves(rows: Sequence[dict[str, Any]], path: str | Path, on_cpu: bool = False) -> str | Path:
    """Train loss against tokens seen; a trial stopped early ends in an x."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, (colour, name) in zip(rows, _line_styles(rows)):
        points = [(h["tokens_seen"], h["loss"]) for h in r.get("history", ()) if h.get("tokens_seen") is not None
                  and h.get("loss") is not None]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], color=colour, alpha=0.8, lw=1.2,
                label=name, ls="--" if r["status"] == "STOPPED" else "-")
        if r["status"] == "STOPPED":
            ax.plot(*points[-1], marker="x", color=colour, ms=9, mew=2)
    if any(r["status"] == "STOPPED" for r in rows):
        ax.plot([], [], "kx", ms=8, mew=2, ls="--", label="stopped early")
    ax.set_xlabel("tokens seen (real tokens)")
    ax.set_ylabel("train loss")
    _finish(ax, "Learning curves", on_cpu, legend_title="trial")
    return _save(fig, path)


def eval_vs_time(rows: Sequence[dict[str, Any]], path: str | Path, target: float | None = None,
                 on_cpu: bool = False) -> str | Path:
    """Eval loss against training wall time, one line per trial, the target as a dashed line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, (colour, name) in zip(rows, _line_styles(rows)):
        points = [(h["train_time_s"], h["eval_loss"]) for h in r.get("history", ())
                  if h.get("eval_loss") is not None and h.get("train_time_s") is not None]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, color=colour,
                label=name, ls="--" if r["status"] == "STOPPED" else "-")
    if target is not None:
        ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.4g}")
    ax.set_xlabel("training wall time (s; no start-up, no evaluation)")
    ax.set_ylabel("eval loss")
    _finish(ax, "Eval loss against wall time", on_cpu, legend_title="trial")
    return _save(fig, path)
