"""Ending a run the way clusters end one: SIGTERM, Ctrl-C, and a node being preempted.

Kubernetes evicting a pod, `ray job stop`, Slurm, `timeout` and `kill` all send SIGTERM; Ctrl-C
sends SIGINT. Either, sent to the driver while it trains, stops the run at the next optimizer
step boundary with a checkpoint, within `train.stop_grace_s`:

    driver:  SIGTERM / SIGINT ──> DriverStop.request: {signal, deadline} under a key in Ray's KV,
             one line on the screen, and a timer that stops everything at the deadline
    workers: rank 0 reads the key (at most every POLL_S); every rank reads Ray Train's notice
             that its node is being preempted (a node drain: `ray start` got SIGTERM, a spot
             reclaim, an autoscaler); before each step the ranks share their votes in the step's
             own host all_gather (of its label tokens: none on one rank), so all of them stop
             after the same step
        ──> a checkpoint, if the last one is older than train.stop_checkpoint_after_s and the
            time left fits one (the last checkpoint's cost), reported and so registered
        ──> a driver's stop: the loop returns, rank 0 records where it stopped (`<key>:done`),
            `fit` ends, and the command prints how to resume and exits 128 + the signal
            (143 for SIGTERM, 130 for Ctrl-C)
            a node's preemption: the workers wait; when the node goes, Ray Train restarts the
            worker group on the nodes left from that checkpoint (FailureConfig's
            max_preemption_failures, unlimited by default), so no step is trained twice

A second signal, or the deadline passing first, stops at once (`Terminated`, a KeyboardInterrupt):
the command disconnects from Ray, which ends the workers, keeps every checkpoint Ray Train
registered and removes one it never registered. A signal before training (tokenize, pack) stops
at once the same way. Nothing half-written survives: a checkpoint counts only once registered.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.25
"""How often rank 0 asks Ray's KV whether the driver asked the run to stop (one small GCS read)."""
MARGIN_S = 2.0
"""Time kept free before a deadline: the report that registers a checkpoint, and exiting."""
NAMESPACE = "raypack"


class Terminated(KeyboardInterrupt):
    """The process was asked to stop now (a signal, or a graceful stop's deadline): what Ctrl-C
    raises, with the signal that asked for it."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The conventional status of a process ended by the signal: 128 + its number."""
        return 128 + self.signum


def signal_of(interrupt: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: a Terminated's own, SIGINT for a plain Ctrl-C."""
    return getattr(interrupt, "signum", signal.SIGINT)


def stopped_by(signum: int) -> str:
    """How a line says what stopped a command: Ctrl-C interrupts, another signal stops."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def raise_terminated(signum: int, frame: Any = None) -> None:
    """A signal handler: stop what runs now, as Ctrl-C does (`Terminated`)."""
    raise Terminated(signum)


def stop_on_sigterm() -> Any:
    """SIGTERM raises `Terminated` in the main thread, as SIGINT raises KeyboardInterrupt: the
    command ends as for Ctrl-C, with exit status 143. (`runtime.init_ray` keeps this handler,
    which ray.init would replace with one that exits from inside whatever runs.) Returns the
    handler it replaced, to put back; None off the main thread, where nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, raise_terminated)


# --- the driver -----------------------------------------------------------------------------


@dataclass
class DriverStop:
    """The driver's side of a graceful stop, for one `fit` (see the module doc)."""

    grace_s: float
    key: str = field(default_factory=lambda: f"stop:{uuid.uuid4().hex}")
    """Ray KV key (namespace "raypack") the workers read; `<key>:done` is where they stopped."""
    signum: int | None = None
    """The signal that asked for the stop, once one did."""
    _timer: threading.Timer | None = None

    def install(self) -> dict[int, Any]:
        """Handle SIGINT and SIGTERM (main thread only); returns the handlers to put back."""
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in before:
            signal.signal(s, self._on_signal)
        return before

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second signal, or the deadline: now
            raise Terminated(self.signum)
        self.signum = signum
        deadline = time.time() + self.grace_s
        try:
            told = _raycompat().kv_put(self.key, json.dumps({"signal": signal.Signals(signum).name,
                                                          "deadline": deadline}), namespace=NAMESPACE)
        except Exception:  # Ray already gone: nothing to stop gracefully
            told = False
        if not told:  # or no store to tell the workers through (raycompat)
            raise Terminated(signum) from None
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n[raypack] {name}: stopping after this step, with a checkpoint, within {self.grace_s:g} s "
              "(train.stop_grace_s); again to stop at once", file=sys.stderr, flush=True)
        # At the deadline the same handler runs again, in the main thread: a stop at once.
        self._timer = threading.Timer(self.grace_s, _interrupt_main, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """`fit` is over: no deadline to enforce any more."""
        if self._timer is not None:
            self._timer.cancel()

    def stopped_at(self) -> dict[str, Any] | None:
        """Where the workers stopped for this request ({"step", "checkpoint"}), or None when
        no stop was asked for or the run ended anyway (its last step came first)."""
        if self.signum is None:
            return None
        done = _raycompat().kv_get(f"{self.key}:done", namespace=NAMESPACE)
        for key in (self.key, f"{self.key}:done"):
            _raycompat().kv_del(key, namespace=NAMESPACE)
        return json.loads(done) if done else None


def _raycompat():
    """raypack.raycompat, imported where first used: raypack/cli.py imports this module first thing,
    and Ray's import (1 s, several on a loaded machine) would delay the config's and the hub's checks."""
    from raypack import raycompat

    return raycompat


def _interrupt_main(signum: int) -> None:
    import _thread

    _thread.interrupt_main(signum)


# --- the workers ----------------------------------------------------------------------------

PREEMPTED, ASKED = 1, 2
"""Why the workers stop, as voted (the larger wins): their node is going, or the driver asked."""


@dataclass
class StopWatch:
    """A worker's side of a stop: what it votes at every step, what all ranks agreed, and the
    checkpoint clock that decides whether a stop saves one."""

    key: str | None = None
    """The driver's KV key (None: no driver asks, as in a sweep trial)."""
    rank: int = 0
    checkpoint_after_s: float = 60.0
    """train.stop_checkpoint_after_s."""
    checkpoint_step: int = 0
    """The step of the state the run would resume from (the last checkpoint, or the one restored)."""
    reason: int = 0
    """Once agreed: PREEMPTED or ASKED; 0 while the run goes on."""
    checkpoint: bool = False
    """Once agreed: save a checkpoint at this step."""
    _last_checkpoint: float = field(default_factory=time.monotonic)
    """When the state the run would resume from was saved (or restored: nothing to lose yet)."""
    _checkpoint_cost: float = 0.0
    _asked: dict[str, Any] | None = None
    _polled: float = 0.0
    _told: bool = False

    @property
    def agreed(self) -> bool:
        return self.reason > 0

    def vote(self, step: int) -> float:
        """This rank's vote after `step`: 0 to go on, else 2 x reason + 1 if it wants a checkpoint
        (the last one is older than checkpoint_after_s and one more fits before the deadline)."""
        reason, deadline = self._local()
        if not reason:
            return 0.0
        fits = deadline is None or time.time() + self._checkpoint_cost + MARGIN_S < deadline
        stale = time.monotonic() - self._last_checkpoint >= self.checkpoint_after_s
        return 2.0 * reason + float(fits and stale and step != self.checkpoint_step)

    def sums(self, counts, values: list[float], step: int) -> list[float] | None:
        """The next step's host numbers `values` summed over the ranks, with this rank's vote after
        `step` riding in the same message: `counts` (the loop's stepvalues.HostCounts) gathers
        both in the one all_gather the step makes anyway (none on one rank), so a stop costs no
        collective of its own. None when the ranks agree to stop after `step` (`agree`)."""
        gathered = counts.gather([*values, self.vote(step)])
        return None if self.agree(float(gathered[:, -1].max())) else gathered[:, :-1].sum(0).tolist()

    def agree(self, largest: float) -> bool:
        """Whether every rank stops: the largest vote of all ranks decides. Sets `reason` and
        `checkpoint` for what follows."""
        if largest:
            self.reason, self.checkpoint = int(largest) // 2, bool(int(largest) % 2)
        return self.agreed

    def checkpointed(self, seconds: float, step: int) -> None:
        """A checkpoint of `step` was saved; it took `seconds`."""
        self._last_checkpoint, self._checkpoint_cost, self.checkpoint_step = time.monotonic(), seconds, step

    def finish(self, step: int) -> None:
        """After the loop: tell the driver where a stop it asked for left the run; on a node's
        preemption, wait for Ray Train to end this worker group (module doc)."""
        if self.reason == ASKED and self.rank == 0 and self.key:
            _raycompat().kv_put(f"{self.key}:done", json.dumps({"step": step, "checkpoint": self.checkpoint,
                                                             "resume_from": self.checkpoint_step}),
                             namespace=NAMESPACE)
        elif self.reason == PREEMPTED:
            if self.rank == 0:
                print(f"[raypack] a node of this run is being preempted: stopped after step {step} "
                      f"({resumes(step, self.checkpoint_step)}); Ray Train restarts the workers from the last checkpoint "
                      "on the nodes left", flush=True)
            # Returning would end the run as finished; Ray Train tears this group down when the
            # node goes or its deadline passes, and starts a new one from the checkpoint.
            while True:
                time.sleep(60)

    def _local(self) -> tuple[int, float | None]:
        """(reason, deadline as a Unix time) this rank knows of, (0, None) when none."""
        asked = self._poll()
        if asked:
            return ASKED, asked["deadline"]
        info = _raycompat().preemption_info()
        if info is not None:
            return PREEMPTED, info.deadline_ms / 1000 if info.deadline_ms else None
        return 0, None

    def _poll(self) -> dict[str, Any] | None:
        if self._asked or self.rank != 0 or not self.key or time.monotonic() - self._polled < POLL_S:
            return self._asked
        self._polled = time.monotonic()
        value = _raycompat().kv_get(self.key, namespace=NAMESPACE)
        self._asked = json.loads(value) if value else None
        return self._asked


def resumes(step: int, resume_from: int) -> str:
    """Where a run stopped after `step` goes on from: that step, or an earlier checkpoint."""
    if resume_from == step:
        return "a checkpoint saved there"
    if resume_from == 0:
        return "no checkpoint yet: it would start over"
    return (f"it goes on from its checkpoint at step {resume_from}, younger than train.stop_checkpoint_after_s, "
            "or saving one didn't fit the time left")

