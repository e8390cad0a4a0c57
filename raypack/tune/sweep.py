"""Ray Tune sweep over packing strategies (and budgets, learning rates): one Ray Train run per
trial, live metrics into Tune, early stopping, resume, then a report.

    raypack sweep --config jobs/configs/sweeps/packing_cpu.yaml run.storage_path=/tmp/sweeps
    raypack sweep --resume /tmp/sweeps/sweep-packing-cpu        # continue an interrupted sweep

    driver: check config ──> prepare data once (raypack/tune/data.py) ──> Tuner.fit / Tuner.restore
              trial (raypack/tune/trial.py: a Trainable with ~no resources of its own)
                └─> its own Ray Train run (train.num_workers workers)
                      every ray.train.report ──> Tune (scheduler: ASHA may stop the trial)
            ──> report (raypack/tune/report.py, plots.py)

The search space, scheduler and search algorithm come from the `tune:` section
(raypack/tune/space.py). Ray Train V2 refuses `Tuner(trainer)`, hence the driver function. A
failed trial is a row with status ERROR, never the end of the sweep.

Everything lands in the experiment directory `<run.storage_path>/<run.name>/`: the sweep's
config (`raypack_sweep.yaml`, what `--resume` reads), the shared data cache (`cache/`), Tune's
trial folders and experiment state, each trial's Train run under `runs/`, and the report:
`sweep_results.md`, `sweep_results.csv`, `sweep_throughput_vs_loss.png`,
`sweep_learning_curves.png`, `sweep_eval_vs_time.png`.

Resume. Tune keeps its experiment state in the experiment directory; `Tuner.restore` runs the
trials that had not ended (an interrupted trial starts again, and its Train run, which has the
same name, continues from its last checkpoint) and leaves finished ones alone. The data cache is
reused, so nothing is tokenized or packed again, and the report covers every trial.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import ray.tune

from raypack import storage
from raypack.config import Config
from raypack.data.strategies import STRATEGIES
from raypack.errors import ConfigError
from raypack.runs import SWEEP_CONFIG, run_dir, save_config, storage_path
from raypack.runtime import init_ray
from raypack.tune import plots
from raypack.tune.data import SweepData, prepare_sweep_data
from raypack.config.swept import OPTIONAL, PARAMS
from raypack.tune.report import Context, format_csv, format_table, result_row, with_targets
from raypack.tune.space import check, dimensions, param_space, planned_trials, preflight_sweep, tune_config
from raypack.tune.trial import TrainRun

TABLE = "sweep_results.md"
CSV = "sweep_results.csv"
PLOT = "sweep_throughput_vs_loss.png"
CURVES = "sweep_learning_curves.png"
EVAL_PLOT = "sweep_eval_vs_time.png"
OUTPUTS = (TABLE, CSV, PLOT, CURVES, EVAL_PLOT)


@dataclass
class Outcome:
    rows: list[dict[str, Any]]
    context: Context
    directory: str
    files: dict[str, str]
    data: SweepData

    @property
    def interrupted(self) -> bool:
        return self.context.not_started > 0 or any(r["status"] == "UNFINISHED" for r in self.rows)


def sweep(cfg: Config, resume: bool = False) -> Outcome:
    """Run (or with `resume`, continue) the sweep `cfg` describes (with `resume`, the config the
    sweep saved: `runs.saved_config(DIR, file=SWEEP_CONFIG)`); returns its rows and report."""
    check(cfg)  # the tune: section, before any Ray work
    checked = preflight_sweep(cfg)  # the base config's data, tokenizer and model, before Ray starts
    base = checked.cfg  # absolute paths: trials run in actors whose working dir is not ours
    experiment = run_dir(base)
    started = ray.tune.Tuner.can_restore(experiment)
    if resume and not started:
        raise ConfigError(f"{experiment}: no Tune experiment state to resume (the sweep stopped before its first trial?)")
    if not resume and started:
        raise ConfigError(f"{experiment}: a sweep already ran there; resume it with --resume {experiment} "
                          "or pick another run.name")
    init_ray()
    if not resume:
        save_config(base, SWEEP_CONFIG)  # with absolute paths: --resume works from any folder
    cache = f"{experiment}/cache"
    data = prepare_sweep_data(base, checked.sources, cache)
    trial_base = dataclasses.replace(base, data=dataclasses.replace(base.data, cache_path=cache))
    trainable = ray.tune.with_parameters(TrainRun, base=trial_base, runs_dir=f"{experiment}/runs",
                                         batch_sizes=data.batch_sizes)
    # The trial only waits on its Train run; the run's workers hold the real resources.
    trainable = ray.tune.with_resources(trainable, {"CPU": 0.01})
    if resume:
        tuner = ray.tune.Tuner.restore(experiment, trainable, resume_unfinished=True, resume_errored=False)
    else:
        tuner = ray.tune.Tuner(
            trainable,
            param_space=param_space(cfg),
            tune_config=tune_config(cfg, data.max_t(cfg.tune.asha.time_attr)),
            run_config=ray.tune.RunConfig(
                name=base.run.name,
                storage_path=storage_path(base),
                failure_config=ray.tune.FailureConfig(max_failures=0, fail_fast=False),
                verbose=1,
            ),
        )
    results = tuner.fit()
    rows = collect_rows(results, experiment, cfg, data)
    context = report_context(cfg, data)
    # Tune creates trials as it starts them; those an interruption kept from starting have no row.
    context.not_started = max(planned_trials(cfg) - len(rows), 0) if cfg.tune.search_alg == "basic" else 0
    return Outcome(rows, context, experiment, write_report(rows, experiment, context), data)


def collect_rows(results, experiment: str, cfg: Config, data: SweepData) -> list[dict[str, Any]]:
    """One row per trial of a ResultGrid, in the order of the config's lists."""
    # Tune's state on disk, written before it stopped the trials: a trial an interruption cut
    # short is RUNNING (or PENDING) there, while in memory every stopped trial looks TERMINATED.
    saved = {t.path: t.status for t in ray.tune.ExperimentAnalysis(experiment).trials}
    rows = []
    for r in results:
        params = {k: r.config.get(k) for k in PARAMS}
        params["batch_size"] = data.batch_sizes.get(f"{params['strategy']}/{params['budget']}")
        frame = r.metrics_dataframe
        history = frame.to_dict("records") if frame is not None and len(frame) else ([r.metrics] if r.metrics else [])
        trial = (r.metrics or {}).get("trial_id") or r.path.rstrip("/").rsplit("/", 1)[-1]
        rows.append(result_row(params, history, r.error, saved.get(r.path), trial))
    order = {name: {v: i for i, v in enumerate(values)} for name, values in dimensions(cfg).items()}
    rows.sort(key=lambda row: (order["strategy"].get(row["strategy"], 99), row["budget"], row["lr"],
                               *(row.get(p.name) or 0 for p in OPTIONAL), row["trial"]))
    return rows


def report_context(cfg: Config, data: SweepData) -> Context:
    t, tr = cfg.tune, cfg.train
    per_step = " x ".join(str(v) for v in (cfg.pack.budget, tr.data_parallel, tr.grad_accum))
    takes = [s for s in t.strategies if STRATEGIES[s].takes_batch_size]
    if t.equal_work == "tokens_per_step" and takes:
        sizes = "; ".join(f"budget {b}: {b} / {data.mean_length[b]:.1f} = {b / data.mean_length[b]:.3f}"
                          for b in sorted(data.mean_length))
        rule = (f"Equal work per optimizer step (tune.equal_work: tokens_per_step): a packed strategy's step holds at "
                f"most budget x ranks x grad_accum real tokens ({per_step} for pack.budget); {', '.join(takes)} "
                f"take{'s' if len(takes) == 1 else ''} "
                f"budget / mean training example length examples per micro-batch on average ({sizes}), so their "
                "steps hold as many real tokens on average and every trial takes about as many steps. "
                "tokens_per_step is what each trial measured.")
    elif takes:
        rule = (f"No equal-work rule (tune.equal_work: none): {', '.join(takes)} take pack.batch_size = "
                f"{cfg.pack.batch_size:g} examples per micro-batch, packed strategies one row of the budget; "
                "compare tokens_per_step before comparing losses.")
    else:
        rule = f"Every trial packs rows of the budget: up to budget x ranks x grad_accum ({per_step}) real tokens per step."
    search = f"{t.search_alg} search, num_samples {t.num_samples}"
    if t.num_samples > 1:
        search += " (repeats of a grid point use the same seeds: their spread is run-to-run noise)"
    if t.scheduler == "asha":
        a = t.asha
        sched = (f"ASHA on {t.metric} ({t.mode}): time_attr {a.time_attr}, grace period {a.grace_period}, "
                 f"reduction factor {a.reduction_factor:g}, max_t {a.max_t or data.max_t(a.time_attr)}")
    else:
        sched = "no scheduler: every trial runs to the end"
    notes = [
        rule,
        (f"Data: tokenized once ({data.examples} examples, {data.tokenize_s:.1f} s)" if data.tokenizations == 1 else
         f"Data: tokenized {data.tokenizations} times, once per effective tokenize.max_length ({data.tokenize_s:.1f} s)"
         if data.tokenizations else f"Data: tokenized examples reused from the cache ({data.examples} examples, read in "
         f"{data.tokenize_s:.1f} s)") + f", then {data.packed_configs} pack config(s) packed or reused ({data.pack_s:.1f} s); "
        f"the trials read them from {data.cache} and neither tokenize nor pack.",
        f"Trials: {tr.num_workers} {'GPU' if tr.use_gpu else 'CPU'} worker(s), grad_accum {tr.grad_accum}, "
        f"{tr.epochs} epoch(s){f', max_steps {tr.max_steps}' if tr.max_steps else ''}; {search}; {sched}.",
    ]
    return Context(title=f"Packing sweep {cfg.run.name}", on_cpu=not tr.use_gpu, notes=notes,
                   target_eval_loss=t.target_eval_loss)


def write_report(rows: list[dict[str, Any]], directory: str, context: Context | None = None) -> dict[str, str]:
    """Write the table, the CSV and the three plots into `directory` (a local folder or a URI)."""
    context = context or Context()
    storage.write_text(f"{directory}/{TABLE}", format_table(rows, context))
    storage.write_text(f"{directory}/{CSV}", format_csv(rows, context))
    targeted, target = with_targets(rows, context.target_eval_loss)
    plots.throughput_vs_loss(targeted, f"{directory}/{PLOT}", context.on_cpu)
    plots.learning_curves(targeted, f"{directory}/{CURVES}", context.on_cpu)
    plots.eval_vs_time(targeted, f"{directory}/{EVAL_PLOT}", target, context.on_cpu)
    storage.write_text(f"{directory}/sweep_rows.json", json.dumps(rows, indent=1, default=str))
    return {name: f"{directory}/{name}" for name in OUTPUTS}
