"""What reaches the screen from Ray's workers: raypack's own lines as they are, known noise not at
all, anything else as Ray prints it.

Ray's driver prints every line its workers write, prefixed with `(RayTrainWorker pid=...)` and
wrapped in colour codes, through the handlers of Ray's `global_worker_stdstream_dispatcher`
(`raycompat.stdstream_dispatcher`). `route_worker_output` puts one in place of Ray's own:

- a line that starts with `[raypack] ` (rank 0's progress, the loop's notices) is printed bare, as
  the driver's own lines are: which worker wrote it says nothing to a user;
- a line in NOISE is dropped (it stays in the worker's log file under the session folder), and
  one in TRAIN_INFO where this Ray can't set Ray Train's log level (before 2.56);
- any other line goes to Ray's own printer (deduplicated, prefixed), uncoloured unless the screen
  is a terminal.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

OWN = "[raypack] "

NOISE = (
    # DeepSpeed, once per worker on the CPU: a JIT-built op found in TORCH_EXTENSIONS_DIR.
    "deepspeed_shm_comm_op built successfully",
    # Ray's core worker, for each actor it creates with its constructor's arguments in the object
    # store and restarts allowed (ray#53727): Ray Train's PreemptionWatcher here. Ray Data's
    # MapWorker gets one too, written by the driver's own core worker straight to its stderr,
    # where no handler sees it (Ray 2.60 deprecates the `max_restarts=0` that would avoid it).
    "has constructor arguments in the object store and max_restarts",
    # Ray Train's PlacementGroupCleaner, each time it can't ask the State API whether the run's
    # controller still lives (no dashboard, or a head too busy to answer in time); it only
    # retries, and it came after raypack's last line of a stopped run.
    "Failed to query Ray Train Controller actor state",
)

TRAIN_INFO = (
    # Ray Train's INFO lines, which a Ray without `ray.train.LoggingConfig` (before 2.56:
    # raycompat.train_logging) prints from its controller and workers; dropped there alone.
    "Attempting to start training worker group of size",
    "Started training worker group of size",
    ") world_rank=",  # one line per worker under the one before
    "Setting up process group for: ",
    "Checkpoint successfully created at: ",
)

_HANDLER = "ray_print_logs"
"""The name Ray gives its printer in the dispatcher (ray/_private/worker.py, `connect`)."""


def route_worker_output() -> None:
    """Print worker output as the module doc says, in place of Ray's printer. Does nothing where
    Ray prints no worker output here (log_to_driver=False) or its internals differ."""
    from raypack import raycompat

    found_dispatcher = raycompat.stdstream_dispatcher()
    if found_dispatcher is None:
        return
    dispatcher, ray_print = found_dispatcher
    found = [handler for name, handler in dispatcher.handlers if name == _HANDLER]
    if not found or not isinstance(found[0], functools.partial):
        return  # not Ray's printer as this module knows it, or already replaced
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read by Ray's printer at every line
    ignore_prefix = found[0].keywords.get("ignore_prefix", False)
    dispatcher.remove_handler(_HANDLER)
    noise = NOISE if raycompat.train_logging("WARNING") else NOISE + TRAIN_INFO
    dispatcher.add_handler(_HANDLER, functools.partial(_print, ray_print, ignore_prefix, noise=noise))


def _print(ray_print, ignore_prefix: bool, data: dict[str, Any], noise: tuple[str, ...] = NOISE) -> None:
    stream = sys.stderr if data.get("is_err") else sys.stdout
    others: list[str] = []
    for line in data.get("lines", []):
        if line.startswith(OWN):
            if others:  # in the order the worker wrote them
                ray_print({**data, "lines": others}, ignore_prefix=ignore_prefix)
                others = []
            print(line, file=stream, flush=True)
        elif not any(known in line for known in noise):
            others.append(line)
    if others:
        ray_print({**data, "lines": others}, ignore_prefix=ignore_prefix)
