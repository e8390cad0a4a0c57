"""A trial's report callback, without Ray (the stream itself: tests/ray/tune/test_trial.py; its
config and name: tests/unit/test_runs.py)."""

from __future__ import annotations

from raypack.tune.trial import ForwardReports


class _Queue:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


class _Checkpoint:
    path = "/runs/x/checkpoint_1"


def test_callback_sends_its_controller_once_then_rank_zero_reports(monkeypatch):
    monkeypatch.setattr(ForwardReports, "controller", staticmethod(lambda: "the-controller"))
    q = _Queue()
    cb = ForwardReports(q)
    cb.after_report(None, [{"step": 2, "loss": 1.0}, {"step": 2, "loss": 9.0}], None)
    cb.after_report(None, [{"step": 4, "loss": 0.5}], _Checkpoint())
    assert q.items == [("controller", "the-controller"), ("report", {"step": 2, "loss": 1.0}),
                       ("report", {"step": 4, "loss": 0.5, "checkpoint_path": "/runs/x/checkpoint_1"})]


class _Acks:
    def __init__(self, outcomes):
        self.outcomes, self.gets = list(outcomes), 0

    def get(self, timeout=None):
        self.gets += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_each_report_waits_until_tune_asks_for_more(monkeypatch):
    from ray.exceptions import RayActorError
    from ray.util.queue import Empty

    monkeypatch.setattr(ForwardReports, "controller", staticmethod(lambda: "c"))
    acks = _Acks([Empty(), Empty(), True, RayActorError()])
    cb = ForwardReports(_Queue(), acks)
    cb.after_report(None, [{"step": 2}], None)  # waits through two empty polls, returns on the ack
    assert acks.gets == 3
    cb.after_report(None, [{"step": 4}], None)  # the trial is gone: returns instead of waiting forever
    assert acks.gets == 4 and not acks.outcomes
