"""What Ray ships from a run to its Train controller and workers, by reference: the workers'
function and the controller's callback.

Ray unpickles each by importing its module in that process. Here they import only Ray Train and
raypack.errors, not raypack.train.trainer (the driver's data preparation: transformers, Ray Data,
the trackers), which the controller would otherwise import before it starts a worker: measured
with `python -X importtime`, seconds of CPU on start-up's critical path (docs/guides/speed.md).
The workers import the training loop's modules themselves, in `worker_loop`.
"""

from __future__ import annotations

import logging
import time

import ray.train

from raypack import raycompat
from raypack.errors import InputError


def worker_loop(config: dict) -> dict | None:
    """The workers' function. Imported here, in the worker, so that the driver never loads
    DeepSpeed (seconds of imports, and a warning on machines without a GPU). In an elastic run
    that Ray Train restarted on another worker count than the data is planned for, it returns
    `{RESIZED: count}` at once, untrained: the driver plans again for them (elastic.py)."""
    raycompat.quiet_report_log()
    world = ray.train.get_context().get_world_size()
    if config["cfg"]["train"].get("elastic") and world != config["cfg"]["train"]["num_workers"]:
        return {RESIZED: world}
    config.setdefault("startup", {})["worker"] = time.time()  # the worker group phase ends (startup.py)
    from raypack.train.loop import train_loop_per_worker

    config["startup"]["imports"] = time.time()
    try:
        train_loop_per_worker(config)
    except Exception as e:
        if as_input_error(e) is not None:
            # The command prints it as one line; Ray Train would print its traceback first.
            _drop_logs(raycompat.TRAIN_FN_LOGGER, lambda record: record.getMessage().startswith("Error in training function"))
        raise


RESIZED = "raypack_resized_to"
"""The key of an elastic run's return value: the worker count Ray Train restarted it on."""


def as_input_error(error: BaseException) -> InputError | None:
    """What a worker's exception says about the run's input or environment, if anything: an
    InputError, or an ImportError (a package missing on a worker's node), which every try would
    meet again. None for a crash, which a restart may get past."""
    cause = getattr(error, "_base_exc", error)  # Train wraps it with its traceback text
    if isinstance(cause, InputError):
        return cause
    if isinstance(cause, ImportError):
        return InputError(f"a worker can't import {cause.name or 'a module'} ({cause}): install it on every node "
                          "that runs workers (the cluster image, or the job's runtime_env pip)")
    return None


def _drop_logs(name: str, drop) -> None:
    """Leave out the records of Ray's logger `name` that `drop` picks, in this process."""
    logger = logging.getLogger(name)
    if not any(getattr(f, "raypack", False) for f in logger.filters):
        filt = logging.Filter()
        filt.filter = lambda record: not drop(record)
        filt.raypack = True
        logger.addFilter(filt)


class StopOnInputError(ray.train.UserCallback):
    """Ends the run when a worker raised an error about the input or the environment
    (`as_input_error`), instead of restarting the worker group. Ray Train's default failure policy
    retries every worker error (there is no public way to give it another policy), but an error
    raised in a controller callback becomes a ControllerError, which it does not retry: raising
    the InputError here stops the run at once, and `fit_trainer` unwraps it (see the module doc).
    Runs in the controller, whose log of the error's traceback it leaves out: the command prints
    the cause as its one line."""

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        for error in worker_exceptions.values():
            if (cause := as_input_error(error)) is not None:
                _drop_logs(raycompat.CONTROLLER_LOGGER, lambda record: record.exc_info is not None
                           and isinstance(record.exc_info[1], InputError))
                raise cause

