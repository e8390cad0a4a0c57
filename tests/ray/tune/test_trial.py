"""Train reports reach Tune from the trial's own thread, every one, in order, without a hang.

The harness is a Tune sweep whose trials stand in for a Train run: a task plays the Train
controller, calling the report callback a few times, and the trial waits for it as `fit` does.
That is exactly the shape that hung with Ray's `TuneReportCallback` (see raypack/tune/trial.py):
run this file as a script with `ray` to watch it happen,

    python tests/ray/tune/test_trial.py ray 16      # Ray's callback: some trials hang (Ray 2.60)
    python tests/ray/tune/test_trial.py raypack 16  # raypack's: every trial ends

(here, Ray's callback hung 2 of 5 runs of 8 trials; a hung trial's main thread sat in
`Queue.put` under `_TrainSession._get_result_from_queues`).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest
import ray
import ray.tune
from ray.util.queue import Queue

from raypack.tune.trial import ForwardReports, stream_reports

REPORTS = 3


def _controller(callback, n: int) -> None:
    """What Train's controller does with a callback: after_report on every report, then finish."""
    for i in range(n):
        callback.after_report(None, [{"step": i + 1, "loss": 1.0 / (i + 1)}, {"step": i + 1}], None)
        time.sleep(0.05)


def raypack_trial(config):
    queue = Queue(actor_options={"num_cpus": 0})
    ref = ray.remote(num_cpus=0)(_controller).remote(ForwardReports(queue), config["n"])
    stream_reports(ref, queue)
    ray.kill(queue.actor)


def ray_trial(config):
    from ray.tune.integration.ray_train import TuneReportCallback

    ray.get(ray.remote(num_cpus=0)(_controller).remote(TuneReportCallback(), config["n"]))


def run_harness(kind: str, trials: int, storage: str):
    trainable = raypack_trial if kind == "raypack" else ray_trial
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(trainable, {"CPU": 0.01}),
        param_space={"n": REPORTS},
        tune_config=ray.tune.TuneConfig(num_samples=trials, max_concurrent_trials=4),
        run_config=ray.tune.RunConfig(name=f"harness-{uuid.uuid4().hex[:6]}", storage_path=storage, verbose=0),
    )
    return tuner.fit()


def test_every_report_reaches_tune_in_order(ray_local, tmp_path):
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run, with tracebacks
    try:
        results = run_harness("raypack", 8, str(tmp_path))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert len(results) == 8 and not results.errors
    for r in results:
        frame = r.metrics_dataframe
        assert frame["step"].tolist() == list(range(1, REPORTS + 1))   # rank 0's, every one, in order
        assert frame["loss"].tolist() == pytest.approx([1.0, 0.5, 1 / 3])


def test_stream_reports_returns_the_task_value_after_the_last_item(ray_local):
    queue = Queue(actor_options={"num_cpus": 0})
    seen = []

    @ray.remote(num_cpus=0)
    def late(q):
        for i in range(5):
            q.put({"step": i})
        return "done"

    assert stream_reports(late.remote(queue), queue, report=seen.append) == "done"
    assert [m["step"] for m in seen] == list(range(5))
    ray.kill(queue.actor)


if __name__ == "__main__":
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    t0 = time.time()
    res = run_harness(sys.argv[1], int(sys.argv[2]), "/tmp/raypack-harness")
    print(f"{sys.argv[1]}: {len(res)} trials ended in {time.time() - t0:.0f} s")
