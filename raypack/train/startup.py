"""Where the time before the first step goes: a run's start-up, phase by phase.

    clock = Startup.begin()          # the driver, as `start` begins
    clock.mark("preflight")          # ... each phase ends at its mark
    loop_config["startup"] = clock.marks                 # to the workers
    clock = Startup(config["startup"]); clock.mark(...)  # a worker goes on from there
    clock.phases()                   # {"python and imports": 3.1, ..., "first step": 2.0}

The phases, each between two marks (wall-clock seconds, `time.time()`, so the driver's marks and
a worker's compare: one machine, or nodes whose clocks agree):

| phase | where | from, to | what |
|---|---|---|---|
| python and imports | driver | process, start | the interpreter, raypack's and Ray's imports, the config |
| preflight | driver | start, preflight | every check that needs no Ray (raypack/train/preflight.py) |
| Ray start | driver | preflight, ray | `init_ray`: a local instance started, or a cluster joined |
| data preparation | driver | prepare, data | tokenize, plan and pack (or find them prepared) |
| worker group | workers | fit, worker | Ray Train's controller, the placement group, the worker processes, the process group |
| worker imports | workers | worker, imports | torch and transformers (and DeepSpeed, for its engine) in each worker (raypack.train.loop) |
| waiting for data | workers | imports, received | until the driver hands over the prepared data |
| model load | workers | received, model | the model built or read, kernels and adapters applied |
| engine init | workers | model, engine | the engine (raypack/train/engines/): `deepspeed.initialize` and ZeRO's flat buffers, or FSDP2's sharding; the optimizer |
| worker setup | workers | engine, setup | the loss probe, the checkpoint restored, trackers, the tokenizer |
| first step | workers | setup, first_step | the first optimizer step, until its loss is read |

With train.overlap_start the worker group starts as the data preparation does
(raypack/train/trainer.py), so those two run side by side and the total, from the process's
start to the first step's end, is less than the phases' sum. A run that Ray Train restarted after
a failure reports the attempt that finished: its worker group phase then holds the failed attempts
too. The process's start is read from /proc (Linux); elsewhere the total counts from `start`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

PHASES = (
    ("python and imports", "process", "start"), ("preflight", "start", "preflight"), ("Ray start", "preflight", "ray"),
    ("data preparation", "prepare", "data"), ("worker group", "fit", "worker"), ("worker imports", "worker", "imports"),
    ("waiting for data", "imports", "received"), ("model load", "received", "model"),
    ("engine init", "model", "engine"), ("worker setup", "engine", "setup"), ("first step", "setup", "first_step"),
)  # fmt: skip
"""(phase, the mark it begins at, the mark it ends at)."""
MARKS = ("process", "start", "preflight", "ray", "prepare", "fit", "data", "worker", "imports", "received", "model",
         "engine", "setup", "first_step")
TOTAL = "to the first step"
"""The key of the whole: from the process's start (or `start`) to the first step's end."""


def process_start() -> float | None:
    """When this process started (wall clock), from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@dataclass
class Startup:
    """Marks (name -> wall-clock time) of one start-up, driver's and workers' alike."""

    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls) -> Startup:
        """The driver's clock: the process's start, and now (the run's `start`)."""
        clock = cls({"process": at} if (at := process_start()) is not None else {})
        clock.mark("start")
        return clock

    def mark(self, name: str) -> None:
        if name not in MARKS:
            raise ValueError(f"unknown start-up mark {name!r}; expected one of {', '.join(MARKS)}")
        self.marks[name] = time.time()

    def phases(self) -> dict[str, float]:
        """Seconds per phase whose two marks are both set, in order, and the TOTAL."""
        out = {name: round(self.marks[end] - self.marks[begin], 3) for name, begin, end in PHASES
               if begin in self.marks and end in self.marks}
        first = self.marks.get("process", self.marks.get("start"))
        if first is not None and "first_step" in self.marks:
            out[TOTAL] = round(self.marks["first_step"] - first, 3)
        return out

    def line(self) -> str:
        return describe(self.phases())


def describe(phases: dict[str, float]) -> str:
    """One line: the total to the first step, then each phase."""
    parts = ", ".join(f"{name} {s:.1f}" for name, s in phases.items() if name != TOTAL)
    total = phases.get(TOTAL)
    return f"{total:.1f} s to the first step: {parts}" if total is not None else parts
