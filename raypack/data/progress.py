"""Progress of data preparation's long stages: one `[raypack]` line every INTERVAL_S seconds.

    with Progress("tokenize", poll):       # poll() -> (what, done, total or None)
        ds.materialize()

    [raypack] tokenize: 1,230,000 of 3,000,000 examples read (41%), 52,300/s, about 34s left
    [raypack] pack: 3,000 of 12,000 rows written (25%), 1,200/s, about 8s left

A thread on the driver asks `poll` (which reads counters that the stage's tasks add to, a `Tally`
actor or the tokenizer's own) and prints; a stage shorter than the interval prints nothing. The
rate is measured from when the current `what` was first seen, so a stage of two phases (pack:
examples routed, then rows written) gives each its own. These lines replace Ray Data's progress
bars, which raypack.runtime turns off.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import ray

INTERVAL_S = 15.0
"""Seconds between lines: often enough to see a stage move, rarely enough to read."""

Poll = Callable[[], "tuple[str, int, int | None]"]


@ray.remote(num_cpus=0)
class Tally:
    """Work done, by kind, added to by tasks; keyed, so that a retried task counts once."""

    def __init__(self):
        self.done: dict[tuple, int] = {}

    def add(self, key: tuple, n: int) -> None:
        self.done[key] = n

    def totals(self) -> dict[str, int]:
        """{kind: units done}, a key's kind being its first item."""
        out: dict[str, int] = {}
        for key, n in self.done.items():
            out[key[0]] = out.get(key[0], 0) + n
        return out


def on_driver_node(actor_class):
    """`actor_class` placed on the driver's node: a counter that a stage's tasks report to must
    outlive any worker node lost mid-stage (Ray restarts no actor by default), or every retried
    task would fail on it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h04m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def line(stage: str, what: str, done: int, total: int | None, rate: float | None) -> str:
    """One progress line (see the module doc)."""
    text = f"[raypack] {stage}: {done:,}" + (f" of {total:,}" if total else "") + f" {what}"
    if total:
        text += f" ({min(done / total, 1):.0%})"
    if rate:
        text += f", {rate:,.0f}/s"
        if total and done < total:
            text += f", about {duration((total - done) / rate)} left"
    return text


class Progress:
    """Prints `stage`'s progress every INTERVAL_S seconds while the `with` block runs."""

    def __init__(self, stage: str, poll: Poll, interval: float | None = None):
        self.stage, self.poll = stage, poll
        self.interval = INTERVAL_S if interval is None else interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"raypack-progress-{stage}", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)  # a poll stuck on a dead counter must not hold up Ctrl-C

    def _run(self) -> None:
        phase, t0, done0 = None, time.perf_counter(), 0
        while not self._stop.wait(self.interval):
            try:
                what, done, total = self.poll()
            except Exception:  # a counter gone with a failed stage: the stage reports that
                continue
            now = time.perf_counter()
            if what != phase:  # a new phase: its rate counts from its first sight (the first phase's from the start)
                if phase is not None:
                    t0, done0 = now, done
                phase = what
            rate = (done - done0) / (now - t0) if now > t0 and done > done0 else None
            if not self._stop.is_set():
                print(line(self.stage, what, done, total, rate), flush=True)
