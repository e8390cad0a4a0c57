"""One sweep trial: a Tune function that runs one Ray Train run and streams its reports to Tune.

    Tune trial actor
      main thread:   FunctionTrainable.train() ──> session.get_next() ──> Tune (scheduler, files)
      trial thread:  run_trial ──> ray.tune.report(m) for every m from the queue, in order
                        │                 ▲
                        │                 └─ Queue (unbounded actor) <── ForwardReports.after_report
                        └─> _fit_task (outside the trial's placement group)        (Train controller,
                              └─> raypack.train.trainer.fit(cfg) ─> Train workers   rank 0's metrics)

Why not Ray's `TuneReportCallback`. It puts each Train report into a one-slot queue that the
trial actor's *main* thread drains inside `_TrainSession._get_result_from_queues`, forwarding the
item into the session's one-slot `result_queue` with a blocking put, from the very thread that
is the only one to take from that queue. The trial thread fills `result_queue` itself when the
trial function returns: Tune's function wrapper always reports `RESULT_DUPLICATE` then (and any
report of the function's own does the same). So when the Train run's last report is still in the
inter-actor queue as the function returns, the main thread takes it, blocks on the full
`result_queue`, and the trial hangs for good (py-spy: MainThread in `Queue.put` under
`_get_result_from_queues`; the trial thread gone). Ray 2.60, reproduced without Train at all:
tests/ray/tune/test_trial.py has the recipe. Here every report reaches Tune from one thread, the
trial function's own, through Tune's ordinary `ray.tune.report`; nothing forwards on the main thread.

Stopping. When a scheduler stops the trial, Tune's `stop` releases the trial thread inside
`ray.tune.report`, which raises SystemExit there. The trial then cancels the fit task with
force, which kills its process; the Train controller it owns dies with it, Train's own
PlacementGroupCleaner (the fix of ray-project/ray#54305) removes the workers' placement group,
and the workers, owned by the controller, go too. The trial actor's own exit would do the same
a moment later; cancelling first does not depend on that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
import ray.tune
from ray.train.v2.api.callback import UserCallback
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypack.config import Config
from raypack.train.trainer import fit

POLL_S = 0.5
"""How long the trial thread waits on the queue before checking whether the Train run ended."""


def trial_name(params: dict[str, Any]) -> str:
    return f"{params['strategy']}-b{params['budget']}-lr{params['lr']:.3g}"


def trial_config(base: Config, params: dict[str, Any], runs_dir: str, suffix: str = "",
                 batch_size: float | None = None) -> Config:
    """The base config with the trial's strategy, budget, lr (and equal-work `batch_size`), its
    Train run under `runs_dir` with a name no other trial (or earlier sweep) uses: a reused name
    would resume that run."""
    name = trial_name(params) + (f"-{suffix}" if suffix else "")
    pack = dataclasses.replace(base.pack, strategy=params["strategy"], budget=params["budget"])
    if batch_size is not None:
        pack = dataclasses.replace(pack, batch_size=batch_size)
    return dataclasses.replace(
        base,
        pack=pack,
        train=dataclasses.replace(base.train, lr=params["lr"]),
        run=dataclasses.replace(base.run, name=name, storage_path=runs_dir),
    )


class ForwardReports(UserCallback):
    """Ray Train callback: rank 0's metrics of every `ray.train.report` into `queue`.

    The queue is unbounded, so the Train controller never waits on Tune."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        out = dict(metrics[0])
        if checkpoint is not None:
            out["checkpoint_path"] = checkpoint.path
        self.queue.put(out)


def stream_reports(ref: ray.ObjectRef, queue: Queue, report=None) -> Any:
    """Pass every item of `queue` to `report` (default `ray.tune.report`) in order, until the
    task behind `ref` has finished and the queue is empty; returns the task's value."""
    report = report or ray.tune.report
    while True:
        try:
            report(queue.get(timeout=POLL_S))
            continue
        except Empty:
            pass
        if ray.wait([ref], timeout=0)[0]:
            break
    # The callback's put returns only once the queue holds the item, and the controller calls
    # it before the run ends, so everything the run reported is in the queue by now.
    while True:
        try:
            report(queue.get_nowait())
        except Empty:
            return ray.get(ref)


def run_trial(config: dict[str, Any], base: Config, runs_dir: str, batch_sizes: dict[str, float]) -> None:
    """The Tune trainable. `batch_sizes` maps `strategy/budget` to the equal-work batch size."""
    params = {k: config[k] for k in ("strategy", "budget", "lr")}
    batch_size = batch_sizes.get(f"{params['strategy']}/{params['budget']}")
    cfg = trial_config(base, params, runs_dir, ray.tune.get_context().get_trial_id(), batch_size)
    # Tune puts every task a trial starts into the trial's (tiny) placement group; the Train run
    # (and any data preparation) would not fit there. The fit and the queue run outside it.
    outside = PlacementGroupSchedulingStrategy(placement_group=None)
    queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": outside})
    fit_task = ray.remote(num_cpus=0, max_retries=0)(_fit_task).options(scheduling_strategy=outside)
    ref = fit_task.remote(cfg, ForwardReports(queue))
    try:
        error = stream_reports(ref, queue)
    except BaseException:
        # SystemExit: Tune stopped the trial (a scheduler's decision, or the sweep's end or
        # interruption). Release the Train run now; see the module docstring.
        ray.cancel(ref, force=True)
        raise
    finally:
        ray.kill(queue.actor)
    if error:
        raise RuntimeError(error)  # Tune records it as the trial's error


def _fit_task(cfg: Config, callback: ForwardReports) -> str | None:
    try:
        result = fit(cfg, callbacks=[callback])
    except Exception as e:  # Train V2 raises a failed run's error from fit()
        return f"{type(e).__name__}: {e}"
    if result.error is not None:
        return f"{type(result.error).__name__}: {result.error}"
    return None
