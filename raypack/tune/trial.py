"""One sweep trial: a Tune Trainable that runs one Ray Train run and hands Tune each of its reports.

    Tune trial actor (TrainRun)                          Ray Train run (outside the trial's
      step() ──> next report from the queue ──> Tune       placement group)
      cleanup() ──> controller.abort() on a stop           _fit_task ──> TrainController
                        ▲                                      └─ ForwardReports.after_report:
                        └──── Queue (unbounded actor) <────────── rank 0's metrics of every report

Why not Ray's `TuneReportCallback` with a function trainable. The callback puts each Train report
into a one-slot queue that the trial actor's *main* thread drains inside
`_TrainSession._get_result_from_queues`, forwarding the item into the session's one-slot
`result_queue` with a blocking put, from the very thread that is the only one to take from that
queue. The function's own thread fills `result_queue` when the function returns: Tune's wrapper
always reports `RESULT_DUPLICATE` then (as does any report of the function's own). So when the
Train run's last report is still in the inter-actor queue as the function returns, the main
thread takes it, blocks on the full `result_queue`, and the trial hangs for good (py-spy:
MainThread in `Queue.put` under `_get_result_from_queues`). Ray 2.60; reproduced without Train
at all, see tests/ray/tune/test_trial.py. A class Trainable has no session queues: Tune calls
`step()` for each result, and it returns the next report, so there is one thread and one queue.

Stopping. Each report waits in the callback until Tune asks the trial for the next result, so a
run is never more than one report interval past the result a scheduler stops it on. A scheduler
(or the sweep's end or interruption) stops a trial by calling the actor's `stop()`, whose
`cleanup()` here lets the waiting callback return, then aborts the Train run through its controller (whose handle the
callback sends along with the first report) and waits for it: the controller shuts the workers
down and removes their placement group. Then the actor exits. Killing the run instead would leave
the placement group to Train's PlacementGroupCleaner, which asks the State API whether the
controller is alive and so never acts without a dashboard (raypack's local Ray has none, and
starts no cleaner: raypack/train/trainer.py, RunTrainer): a stopped trial's workers' CPUs would
stay reserved until the sweep ends (ray-project/ray#54305).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import ray
import ray.tune
from ray.train import UserCallback
from ray.tune.result import RESULT_DUPLICATE
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypack.config import Config
from raypack.runs import trial_config
from raypack.train.trainer import start
from raypack.config.swept import PARAMS

POLL_S = 0.5
"""How long a step waits on the queue before checking whether the Train run ended."""
ABORT_TIMEOUT_S = 120.0
"""How long a stopped trial waits for its Train run's abort (workers shut down, group removed)."""


class ForwardReports(UserCallback):
    """Ray Train callback, run by the Train controller: ("report", rank 0's metrics) for every
    `ray.train.report`, after ("controller", its own handle) once.

    With `acks`, each report then waits until Tune asks the trial for the next result (or stops
    it), as a function trainable's report would: the workers can then run at most one report
    interval past the one a scheduler stops on (each worker's result queue holds one report, and
    the controller takes the next only after this returns). Without it, a run stopped by ASHA
    could finish its remaining steps before the stop reached it."""

    def __init__(self, queue: Queue, acks: Queue | None = None):
        self.queue = queue
        self.acks = acks
        self._sent_controller = False

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not self._sent_controller:
            self.queue.put(("controller", self.controller()))
            self._sent_controller = True
        out = dict(metrics[0])
        if checkpoint is not None:
            out["checkpoint_path"] = checkpoint.path
        self.queue.put(("report", out))
        while self.acks is not None:
            try:
                self.acks.get(timeout=POLL_S)
                return
            except Empty:
                continue
            except ray.exceptions.RayError:
                return  # the trial ended and took its queues with it

    @staticmethod
    def controller():
        """The actor running this callback: the Train controller."""
        return ray.get_runtime_context().current_actor


def next_item(ref: ray.ObjectRef, queue: Queue) -> Any | None:
    """The queue's next item, or None once the task behind `ref` has ended and the queue is empty.
    The callback's put returns only once the queue holds the item, and the controller calls it
    before the run ends, so nothing the run reported can arrive after that."""
    while True:
        try:
            return queue.get(timeout=POLL_S)
        except Empty:
            pass
        if ray.wait([ref], timeout=0)[0]:
            try:
                return queue.get_nowait()
            except Empty:
                return None


class TrainRun(ray.tune.Trainable):
    """The Tune trainable of a sweep: one Ray Train run, one Tune result per Train report."""

    def setup(self, config: dict[str, Any], base: Config, runs_dir: str, batch_sizes: dict[str, float]) -> None:
        params = {k: config.get(k) for k in PARAMS}
        batch_size = batch_sizes.get(f"{params['strategy']}/{params['budget']}")
        self.begin(trial_config(base, params, runs_dir, self.trial_id, batch_size))

    def begin(self, cfg: Config | None) -> None:
        """Start the Train run of `cfg` with a queue for its reports."""
        # Tune puts every task a trial starts into the trial's (tiny) placement group; the Train
        # run would not fit there. The run and the queue go outside it.
        outside = PlacementGroupSchedulingStrategy(placement_group=None)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": outside})
        self.acks = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": outside})
        self.controller = None
        self.ended = False
        self.unacked = False  # a report went to Tune, and the run waits to hear that Tune wants more
        self.run_ref = self.start_run(cfg, ForwardReports(self.queue, self.acks), outside)

    def start_run(self, cfg: Config, callback: ForwardReports, strategy) -> ray.ObjectRef:
        """Start the Train run; returns the ref of a task that ends with it (an error text or None)."""
        task = ray.remote(num_cpus=0, max_retries=0)(_fit_task).options(scheduling_strategy=strategy)
        return task.remote(cfg, callback)

    def release(self) -> None:
        """Let the Train run go on past its last report (Tune asked for more, or is stopping it)."""
        if self.unacked:
            self.acks.put(True)
            self.unacked = False

    def step(self) -> dict[str, Any]:
        self.release()
        while True:
            item = next_item(self.run_ref, self.queue)
            if item is None:
                self.ended = True
                error = ray.get(self.run_ref)
                if error:
                    raise RuntimeError(error)  # Tune records it as the trial's error
                return {RESULT_DUPLICATE: True}  # Tune: the last result was the final one
            kind, payload = item
            if kind == "controller":
                self.controller = payload
                continue
            self.unacked = True
            return payload

    # The Train run checkpoints itself under its own run dir, and a trial that Tune restarts (say
    # after `raypack sweep --resume`) starts a run of the same name, which resumes from there.
    # Tune's own checkpoint of a trial (it takes one at the end of a class trainable) holds nothing.
    def save_checkpoint(self, checkpoint_dir: str) -> dict:
        return {}

    def load_checkpoint(self, checkpoint: dict) -> None:
        pass

    def cleanup(self) -> None:
        if not self.ended:
            self.release()  # the controller may be waiting in the callback: abort() runs after it
            self.abort_run()
        ray.kill(self.queue.actor)
        ray.kill(self.acks.actor)

    def abort_run(self) -> None:
        """Stop the Train run and release its workers before this actor exits (module docstring)."""
        while self.controller is None:  # stopped before its first report was taken: the handle may be queued
            try:
                kind, payload = self.queue.get_nowait()
            except Empty:
                break
            if kind == "controller":
                self.controller = payload
        if self.controller is not None:
            try:
                # abort() ends with the controller exiting, which is what the get then reports.
                ray.get(self.controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        ray.cancel(self.run_ref, force=True)


def _fit_task(cfg: Config, callback: ForwardReports) -> str | None:
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        outcome = start(cfg, callbacks=[callback], trial=True)
    except Exception as e:  # Train V2 raises a failed run's error from fit()
        return f"{type(e).__name__}: {e}"
    finally:
        # TorchTrainer.fit installs a SIGINT handler that holds its controller's handle; in a
        # pooled worker it would keep the finished controller actor alive.
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    error = outcome.result.error if outcome.result is not None else None
    return f"{type(error).__name__}: {error}" if error is not None else None
