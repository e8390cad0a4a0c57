"""Stopping a run, the parts that need no Ray (raypack/train/stop.py): what each rank votes, what
the ranks agree, and the driver's signal handling; Ray's KV is a dict here. A real run stopped by
SIGTERM and resumed: tests/ray/commands/test_train.py; a node preempted: tests/ray/test_job_submit.py."""

from __future__ import annotations

import os
import signal
import time
import types

import pytest

from raypack import raycompat
from raypack.train import stop
from raypack.train.stop import ASKED, PREEMPTED, DriverStop, StopWatch, Terminated


@pytest.fixture
def kv(monkeypatch):
    """Ray's internal KV as a dict."""
    from ray.experimental import internal_kv

    store: dict[bytes, bytes] = {}

    def key(k):
        return k.encode() if isinstance(k, str) else k

    monkeypatch.setattr(internal_kv, "_internal_kv_put",
                        lambda k, v, namespace=None: store.__setitem__(key(k), v.encode() if isinstance(v, str) else v))
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k, namespace=None: store.get(key(k)))
    monkeypatch.setattr(internal_kv, "_internal_kv_del", lambda k, namespace=None: store.pop(key(k), None))
    return store


def asked(kv, watch: StopWatch, seconds_left: float) -> None:
    import json

    kv[watch.key.encode()] = json.dumps({"signal": "SIGTERM", "deadline": time.time() + seconds_left}).encode()


def test_a_rank_votes_to_stop_and_checkpoint_only_when_the_checkpoint_is_stale_and_fits(kv, monkeypatch):
    watch = StopWatch("stop:k", rank=0, checkpoint_after_s=0.0)
    assert watch.vote(step=5) == 0  # nobody asked
    watch._polled = 0.0
    asked(kv, watch, seconds_left=20)
    assert watch.vote(step=5) == 2 * ASKED + 1  # asked, and a checkpoint fits in 20 s
    assert watch.vote(step=0) == 2 * ASKED  # the step it would resume from anyway (restored, or just saved)
    watch.checkpointed(30.0, step=3)  # a checkpoint costs 30 s: it would not fit
    assert watch.vote(step=5) == 2 * ASKED
    fresh = StopWatch("stop:k", rank=0, checkpoint_after_s=3600.0)  # the last one is recent
    assert fresh.vote(step=5) == 2 * ASKED
    other = StopWatch("stop:k", rank=1, checkpoint_after_s=0.0)
    assert other.vote(step=5) == 0  # only rank 0 reads the driver's key; the ranks' vote tells the rest
    # A node's preemption notice reaches every rank; no deadline means time enough.
    monkeypatch.setattr(raycompat, "preemption_info", lambda: types.SimpleNamespace(deadline_ms=None))
    assert other.vote(step=5) == 2 * PREEMPTED + 1


class Ranks:
    """What the loop's HostCounts.gather returns: this rank's values, then each other rank's row."""

    def __init__(self, *others: tuple[float, ...]):
        self.others = others
        self.gathers = 0

    def gather(self, values):
        import numpy as np

        self.gathers += 1
        return np.asarray([values, *self.others], dtype=np.float64)


def test_every_rank_follows_the_largest_vote_riding_the_steps_own_gather():
    """The votes travel in the step's host gather of its label tokens and tokens: the sums come
    back as without them, and the largest vote decides (the driver's ask over a preemption)."""
    watch = StopWatch()
    ranks = Ranks((4.0, 40.0, 0.0), (2.0, 20.0, 0.0))
    assert watch.sums(ranks, [1.0, 10.0], step=3) == [7.0, 70.0] and not watch.agreed and not watch.checkpoint
    ranks = Ranks((4.0, 40.0, 2.0 * PREEMPTED + 1), (2.0, 20.0, 2.0 * ASKED))
    assert watch.sums(ranks, [1.0, 10.0], step=3) is None  # stop: no step is taken on these sums
    assert ranks.gathers == 1, "the vote has a collective of its own"
    assert watch.reason == ASKED and not watch.checkpoint


def test_finish_tells_the_driver_where_the_workers_stopped(kv):
    from raypack.train.stop import resumes

    assert resumes(17, 17) == "a checkpoint saved there"
    assert resumes(17, 12).startswith("it goes on from its checkpoint at step 12")
    import json

    watch = StopWatch("stop:k", rank=0)
    assert watch.sums(Ranks((0.0, 2.0 * ASKED + 1)), [5.0], step=17) is None and watch.agreed
    watch.finish(step=17)
    assert json.loads(kv[b"stop:k:done"]) == {"step": 17, "checkpoint": True, "resume_from": 0}  # checkpointed by the loop


def test_the_driver_asks_once_then_a_second_signal_or_the_deadline_stops_at_once(kv, capsys):
    driver = DriverStop(grace_s=30.0)
    before = driver.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in this (main) thread between bytecodes
        assert driver.signum == signal.SIGTERM and kv[driver.key.encode()]
        assert "[raypack] SIGTERM: stopping after this step, with a checkpoint, within 30 s" in capsys.readouterr().err
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert e.value.exit_code == 143  # the first signal names the stop
        kv[f"{driver.key}:done".encode()] = b'{"step": 5, "checkpoint": true}'
        assert driver.stopped_at() == {"step": 5, "checkpoint": True}
        assert not kv, "the keys were left in Ray's KV"
    finally:
        driver.close()
        for signum, handler in before.items():
            signal.signal(signum, handler)

    late = DriverStop(grace_s=0.2)
    before = late.install()
    try:
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the workers never answer: the deadline stops it
        assert e.value.exit_code == 130
    finally:
        late.close()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_sigterm_before_training_stops_the_command_with_one_line_and_143(tmp_path, capsys, monkeypatch):
    """SIGTERM while the data is prepared: what Ctrl-C does there, with status 143, and the run's name stays free."""
    import raypack.commands.train as command
    from raypack.cli import main

    def start(cfg, **kwargs):
        (tmp_path / "r" / "packed").mkdir(parents=True)  # what preparing had written
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(command, "start", start)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", f"run.storage_path={tmp_path}", "run.name=r"]) == 143
    assert capsys.readouterr().err == ("\n[raypack] stopped by SIGTERM; no checkpoint was registered; run the same "
                                       "command again\n")
    assert not (tmp_path / "r").exists()
    assert signal.getsignal(signal.SIGTERM) is before, "the command left its SIGTERM handler behind"
