"""Train reports reach Tune, every one, in order, without a hang; a stopped trial aborts its run.

The harness is a Tune sweep of `TrainRun` trials whose Train run is a stand-in: an actor that
plays the Train controller, calling the report callback a few times (as the controller does on
every `ray.train.report`) and then ending. That is the shape that hung with Ray's
`TuneReportCallback` (see raypack/tune/trial.py); run this file as a script with `ray` to watch
it happen:

    python tests/ray/tune/test_trial.py ray 16      # Ray's callback: some trials hang (Ray 2.60)
    python tests/ray/tune/test_trial.py raypack 16  # raypack's TrainRun: every trial ends

(here, Ray's callback hung 2 of 5 runs of 8 trials; a hung trial's main thread sat in
`Queue.put` under `_TrainSession._get_result_from_queues`).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import ray.tune

from raypack.tune.trial import TrainRun

REPORTS = 3


@ray.remote(num_cpus=0)
class FakeController:
    """What the Train controller does with the callback, and its abort(), which leaves `marker`.
    An asyncio actor, as the controller is: abort() runs while run() is still going."""

    def __init__(self, marker: str):
        self.marker = marker
        self.step = 0

    async def run(self, callback, n: int, pause_s: float = 0.05) -> None:
        for i in range(n):
            self.step = i + 1
            callback.after_report(None, [{"step": i + 1, "loss": 1.0 / (i + 1)}, {"step": i + 1}], None)
            await asyncio.sleep(pause_s)

    async def abort(self) -> None:
        Path(self.marker).write_text(f"aborted after report {self.step}")
        ray.actor.exit_actor()


class FakeRun(TrainRun):
    """TrainRun whose Train run is the stand-in; an abort leaves `<marker_dir>/<trial id>`."""

    def setup(self, config, marker_dir: str):
        self.marker = f"{marker_dir}/{self.trial_id}"
        self.begin(None)

    def start_run(self, cfg, callback, strategy):
        fake = FakeController.options(scheduling_strategy=strategy).remote(self.marker)
        return fake.run.remote(callback, self.config["n"], self.config["pause_s"])


def run_harness(kind: str, trials: int, storage: str, marker_dir: str = "/tmp", stop=None, n: int = REPORTS,
                pause_s: float = 0.05):
    if kind == "raypack":
        trainable = ray.tune.with_parameters(FakeRun, marker_dir=marker_dir)
    else:
        trainable = ray_trial
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(trainable, {"CPU": 0.01}),
        param_space={"n": n, "pause_s": pause_s},
        tune_config=ray.tune.TuneConfig(num_samples=trials, max_concurrent_trials=4),
        run_config=ray.tune.RunConfig(name=f"harness-{uuid.uuid4().hex[:6]}", storage_path=storage, stop=stop,
                                      verbose=0),
    )
    return tuner.fit()


def ray_trial(config):
    """The old way: a function trainable with Ray's TuneReportCallback."""
    from ray.tune.integration.ray_train import TuneReportCallback

    controller = FakeController.remote("/dev/null")
    ray.get(controller.run.remote(TuneReportCallback(), config["n"], config["pause_s"]))


def test_every_report_reaches_tune_in_order(ray_local, tmp_path):
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run, with tracebacks
    try:
        # as many trials as run at once (max_concurrent_trials): a second wave of 4 doubled the test (93 s)
        results = run_harness("raypack", 4, str(tmp_path), str(tmp_path))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert len(results) == 4 and not results.errors
    for r in results:
        frame = r.metrics_dataframe
        assert frame["step"].tolist() == list(range(1, REPORTS + 1))   # rank 0's, every one, in order
        assert frame["loss"].tolist() == pytest.approx([1.0, 0.5, 1 / 3])
        assert r.metrics["done"]
    assert not list(tmp_path.glob("*_0000*"))  # runs that ended were not aborted


def test_a_stopped_trial_aborts_its_run(ray_local, tmp_path):
    results = run_harness("raypack", 2, str(tmp_path), str(tmp_path), stop={"step": 3}, n=200, pause_s=0.1)
    assert not results.errors
    for r in results:
        assert r.metrics_dataframe["step"].max() == 3   # Tune stopped it at step 3 of 200
        # ... and the run waited on Tune after each report, so it got no further than one more
        aborted_at = int((tmp_path / r.metrics["trial_id"]).read_text().removeprefix("aborted after report "))
        assert 3 <= aborted_at <= 4


if __name__ == "__main__":
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    t0 = time.time()
    res = run_harness(sys.argv[1], int(sys.argv[2]), "/tmp/raypack-harness")
    print(f"{sys.argv[1]}: {len(res)} trials ended in {time.time() - t0:.0f} s")
