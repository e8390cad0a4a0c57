"""Ray Tune sweep over packing strategies: one Ray Train run per trial, then a table and a plot.

    raypack sweep --config jobs/configs/sweeps/packing_cpu.yaml run.storage_path=/tmp/sweeps

    Tuner ──> trial (a small driver function, ~no resources)
                └─> raypack.train.trainer.fit(trial cfg)   (in a task outside the trial's reservation)
                      └─> its own Ray Train workers (train.num_workers of them)
              <── one ray.tune.report of the run's final metrics

The grid is `tune.strategies` x `tune.budgets` x `tune.lrs` (empty budgets or lrs keep the
config's `pack.budget` / `train.lr`). Ray Train V2 refuses `Tuner(trainer)`, hence the driver
function. A failed trial is a row with status ERROR, never the end of the sweep.

Each trial reports once, at the end. Ray's `TuneReportCallback` would stream every Train report
to Tune, but its results travel through a one-slot queue that Tune's main thread drains into
another one-slot queue; any report of the trial's own (needed, since the callback's last one
can arrive after the trial returns and be dropped) can then deadlock the trial. A grid sweep
needs only the final numbers; live progress is in each run's own logs and TensorBoard.

Everything lands in the experiment directory `<run.storage_path>/<run.name>/`: Tune's trial
folders, each trial's Train run under `runs/`, and `sweep_results.md`, `sweep_results.csv` and
`sweep_throughput_vs_loss.png`. The table and plot writers are pure functions of a list of row
dicts, so they are tested without Ray.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import ray.tune
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypack import storage
from raypack.config import Config
from raypack.runtime import absolute_paths, init_ray, run_dir, storage_path
from raypack.train.trainer import fit

TABLE = "sweep_results.md"
CSV = "sweep_results.csv"
PLOT = "sweep_throughput_vs_loss.png"
COLUMNS = (
    "strategy", "budget", "lr", "tokens_per_s", "peak_memory_gb", "loss", "eval_loss",
    "packing_efficiency", "steps", "status",
)


# --- the grid and each trial's config ------------------------------------------------------------


def grid(cfg: Config) -> list[dict[str, Any]]:
    """One dict per trial: strategy x budget x lr."""
    budgets = cfg.tune.budgets or (cfg.pack.budget,)
    lrs = cfg.tune.lrs or (cfg.train.lr,)
    return [
        {"strategy": s, "budget": b, "lr": lr}
        for s, b, lr in itertools.product(cfg.tune.strategies, budgets, lrs)
    ]


def trial_name(params: dict[str, Any]) -> str:
    return f"{params['strategy']}-b{params['budget']}-lr{params['lr']:g}"


def trial_config(base: Config, params: dict[str, Any], runs_dir: str, suffix: str = "") -> Config:
    """The base config with the trial's strategy, budget and lr, its Train run under `runs_dir`
    with a name no other trial (or earlier sweep) uses: a reused name would resume that run."""
    name = trial_name(params) + (f"-{suffix}" if suffix else "")
    return dataclasses.replace(
        base,
        pack=dataclasses.replace(base.pack, strategy=params["strategy"], budget=params["budget"]),
        train=dataclasses.replace(base.train, lr=params["lr"]),
        run=dataclasses.replace(base.run, name=name, storage_path=runs_dir),
    )


def _run_trial(config: dict[str, Any], base: Config, runs_dir: str) -> None:
    """The Tune trainable: a driver that fits one Ray Train run and reports its final metrics."""
    cfg = trial_config(base, config["trial"], runs_dir, ray.tune.get_context().get_trial_id())
    # Tune puts every task a trial starts into the trial's (tiny) placement group; the data
    # preparation's tasks and actors would not fit there. The fit runs outside it.
    outside = PlacementGroupSchedulingStrategy(placement_group=None)
    fit_task = ray.remote(num_cpus=0, max_retries=0)(_fit_task).options(scheduling_strategy=outside)
    metrics, error = ray.get(fit_task.remote(cfg))
    if error:
        raise RuntimeError(error)  # Tune records it as the trial's error
    ray.tune.report(metrics or {})


def _fit_task(cfg: Config) -> tuple[dict | None, str | None]:
    result = fit(cfg)
    if result.error is not None:
        return None, f"{type(result.error).__name__}: {result.error}"
    return dict(result.metrics or {}), None


# --- running the sweep ---------------------------------------------------------------------------


def sweep(cfg: Config) -> list[dict[str, Any]]:
    """Run every trial of the grid; returns the table rows (also written to the experiment dir)."""
    init_ray()
    base = absolute_paths(cfg)  # trials run in actors whose working dir is not ours
    experiment_dir = run_dir(base)
    trials = grid(cfg)
    trainable = ray.tune.with_parameters(_run_trial, base=base, runs_dir=f"{experiment_dir}/runs")
    # The driver only waits on its Train run; the run's workers hold the real resources.
    trainable = ray.tune.with_resources(trainable, {"CPU": 0.01})
    tuner = ray.tune.Tuner(
        trainable,
        param_space={"trial": ray.tune.grid_search(trials)},
        tune_config=ray.tune.TuneConfig(max_concurrent_trials=cfg.tune.max_concurrent_trials),
        run_config=ray.tune.RunConfig(
            name=cfg.run.name,
            storage_path=storage_path(base),
            failure_config=ray.tune.FailureConfig(max_failures=0, fail_fast=False),
            verbose=1,
        ),
    )
    results = tuner.fit()
    rows = [result_row(r.config["trial"], r.metrics or {}, r.error) for r in results]
    order = {trial_name(t): i for i, t in enumerate(trials)}
    rows.sort(key=lambda r: order.get(trial_name(r), len(order)))
    write_report(rows, experiment_dir)
    return rows


def result_row(params: dict[str, Any], metrics: dict[str, Any], error: BaseException | None) -> dict[str, Any]:
    """One table row from a trial's parameters and its last reported metrics."""
    row = {**params, "status": "ERROR" if error is not None else "OK"}
    for key in ("tokens_per_s", "peak_memory_gb", "loss", "eval_loss", "packing_efficiency"):
        row[key] = metrics.get(key)
    row["steps"] = metrics.get("step")
    if error is not None:
        # A trial's error is a RayTaskError whose last line is the exception that ended the run.
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        row["error"] = (lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {''.join(lines)}")[:300]
    return row


# --- the report: pure functions of rows ----------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, one line per trial, failed trials included (with their error below)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    errors = [f"- {trial_name(r)}: {r['error']}" for r in rows if r.get("error")]
    if errors:
        lines += ["", "Failed trials:", *errors]
    return "\n".join(lines) + "\n"


def format_csv(rows: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*COLUMNS, "error"], extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in writer.fieldnames})
    return out.getvalue()


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> str | Path:
    """Throughput against final train loss, one marker per trial, one colour per strategy, as a
    PNG at `path` (a local file or a URI)."""
    # Imported here: pyplot takes ~0.9 s to import, and every trial's process imports this module
    # to run `_run_trial` but never draws; only the sweep's driver does, once, at the end.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    for i, strategy in enumerate(strategies):
        points = [r for r in rows if r["strategy"] == strategy and r.get("tokens_per_s") is not None
                  and r.get("loss") is not None]
        if not points:
            continue
        ax.scatter([p["loss"] for p in points], [p["tokens_per_s"] for p in points],
                   color=f"C{i % 10}", label=strategy, s=50)
        for p in points:
            ax.annotate(f"b{p['budget']} lr{p['lr']:g}", (p["loss"], p["tokens_per_s"]),
                        fontsize=7, xytext=(4, 3), textcoords="offset points")
    failed = [trial_name(r) for r in rows if r.get("status") != "OK"]
    title = "Packing sweep: throughput vs final loss"
    ax.set_title(title + (f"\n(failed: {', '.join(failed)})" if failed else ""), fontsize=9)
    ax.set_xlabel("final train loss")
    ax.set_ylabel("tokens/s (real tokens)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title="strategy", fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    storage.write_bytes(str(path), png.getvalue())
    return path


def write_report(rows: Sequence[dict[str, Any]], directory: str) -> dict[str, str]:
    """Write the table, the CSV and the plot into `directory` (a local folder or a URI)."""
    storage.write_text(f"{directory}/{TABLE}", format_table(rows))
    storage.write_text(f"{directory}/{CSV}", format_csv(rows))
    plot(rows, f"{directory}/{PLOT}")
    return {name: f"{directory}/{name}" for name in (TABLE, CSV, PLOT)}
