"""Ray Train assembly: check the inputs, prepare the packed data on the driver, fit a `TorchTrainer`.

    cfg ──> preflight (no Ray) ──> init_ray ──> prepare (tokenize, plan, pack; once, reused on resume)
        ──> TorchTrainer.fit          workers: raypack.train.loop.train_loop_per_worker

Runs land in `<run.storage_path>/<run.name>/`: Ray's result files and checkpoints, `packed/`
(the plan's per-rank packs, or under `data.cache_path` when set) and `tensorboard/`. Fitting again with the same name and storage path
resumes from that run's last checkpoint; that is what `raypack train --resume PATH` does.

Failures: Ray Train restarts the worker group from the last checkpoint up to
`train.max_failures` times, which is right for a crash (a killed worker, a lost node). An
`InputError` raised in a worker (a model that can't run packed rows, a checkpoint taken on other
data) would fail the same way every time, so it ends the run at once and `fit` raises it as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raypack import storage
from raypack.config import Config, ConfigError, InputError
from raypack.data.prepare import packed_root, prepare
from raypack.runtime import init_ray, run_dir, storage_path
from raypack.train.preflight import Checked, preflight


def _train_loop(config: dict) -> None:
    """The workers' function. Imported here, in the worker, so that the driver never loads
    DeepSpeed (seconds of imports, and a warning on machines without a GPU)."""
    try:
        from ray.train.v2._internal.execution import context as train_context

        # Ray Train names this module's logger by its file path, outside `ray.train`, so its
        # LoggingConfig misses the "Reporting training result ... TrainingReport(...)" INFO dump
        # that every report prints.
        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:  # moved in another Ray version: a noisier screen, nothing worse
        pass
    from raypack.train.loop import train_loop_per_worker

    train_loop_per_worker(config)


class StopOnInputError(ray.train.UserCallback):
    """Ends the run when a worker raised an InputError, instead of restarting the worker group.
    Ray Train's default failure policy retries every worker error (there is no public way to
    give it another policy), but an error raised in a controller callback becomes a
    ControllerError, which it does not retry: raising the InputError here stops the run at once,
    and `fit_trainer` unwraps it (see the module doc)."""

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        for error in worker_exceptions.values():
            cause = getattr(error, "_base_exc", error)  # Train wraps it with its traceback text
            if isinstance(cause, InputError):
                raise cause


def build_trainer(
    cfg: Config,
    *,
    checked: Checked | None = None,
    reprepare: bool = False,
    callbacks: Sequence = (),
    loop: Callable[[dict], None] | None = None,
    extra_loop_config: dict | None = None,
):
    """The `TorchTrainer` for `cfg`, with its packed data prepared (or reused) under the run dir.
    `checked`: `preflight(cfg)`'s record, if the caller ran it (else it runs here); `reprepare`
    packs the data again from changed sources. `loop` replaces the per-worker function (tests
    wrap it); `extra_loop_config` adds to its config."""
    checked = checked or preflight(cfg, reprepare=reprepare)
    cfg = checked.cfg
    t = cfg.train
    root = run_dir(cfg)
    if t.mlflow and storage.is_uri(root) and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError("train.mlflow: with a URI run.storage_path, set MLFLOW_TRACKING_URI to a tracking server")
    prepared = prepare(cfg, t.num_workers, packed_root(cfg, t.num_workers, root), vocab_size=checked.vocab_size,
                       reprepare=reprepare)
    loop_config = {
        "cfg": cfg.to_dict(),
        "data": prepared.to_dict(),
        # Event files and MLflow's file store need a local folder; with object storage, point
        # MLFLOW_TRACKING_URI at a tracking server instead.
        "tensorboard_dir": None if storage.is_uri(root) else f"{root}/tensorboard",
        "mlflow_uri": None if storage.is_uri(root) else f"file://{root}/mlruns",
        **(extra_loop_config or {}),
    }
    resources = {"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}
    env = {k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR", "HF_HOME", "MLFLOW_TRACKING_URI") if k in os.environ}
    quiet = {
        # Ray Train patches print() in workers to log through its own logger, whose console
        # handler writes to stderr while the print still reaches stdout: every line twice.
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # The final checkpoint's save_pretrained draws a progress bar for one shard.
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        # DeepSpeed's collectives call a torch API that warns of its deprecation, in every worker.
        "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger",
        # DeepSpeed otherwise warns, in every worker, that it found no GPU.
        **({} if t.use_gpu else {"DS_ACCELERATOR": "cpu"}),
    }
    env.update({k: os.environ.get(k, v) for k, v in quiet.items()})  # the user's own settings win
    return TorchTrainer(
        loop or _train_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.use_gpu,
            resources_per_worker=resources,
            placement_strategy=t.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=storage_path(cfg),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=[StopOnInputError(), *callbacks],
            worker_runtime_env={"env_vars": env},
            # Ray Train's INFO lines (worker group start, one "Reporting training result" dump per
            # report) bury raypack's own; its warnings stay.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def fit(cfg: Config, *, checked: Checked | None = None, reprepare: bool = False, callbacks: Sequence = (), **kwargs):
    """Check, prepare and train; returns Ray Train's `Result` (metrics, checkpoint, path).
    Raises an InputError for bad input, found before Ray starts where it can be (`preflight`)."""
    checked = checked or preflight(cfg, reprepare=reprepare)
    init_ray()
    return fit_trainer(build_trainer(cfg, checked=checked, reprepare=reprepare, callbacks=callbacks, **kwargs))


def fit_trainer(trainer: TorchTrainer):
    """`trainer.fit()`, with an InputError that stopped a worker raised as it is."""
    try:
        return trainer.fit()
    except ray.train.ControllerError as e:
        if isinstance(e.controller_failure, InputError):
            raise e.controller_failure from None
        raise
