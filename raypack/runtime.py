"""Process set-up shared by every command: start or join Ray, and where a run's files live.

    init_ray()                      # join RAY_ADDRESS's cluster, else start a local instance
    cfg = absolute_paths(cfg)       # before the config travels to processes with another cwd
    run_dir(cfg)                    # <run.storage_path>/<run.name>, absolute or a URI

One policy for every command, so `raypack data`, `plan`, `train` and `sweep` start Ray alike.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import ray

from raypack import storage
from raypack.config import Config

# ray.train.report blocks until the controller's health-check poll drains it (every 2 s by
# default); a short interval keeps a report near 0.07 s. Ray reads it when it starts, and the
# raylet passes the driver's environment on, so it is set on import, before any init_ray().
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a local one."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        # More logical CPUs than cores: workers and Ray Data actors that took every CPU would
        # leave the read tasks none, and the job would hang on a small machine.
        ray.init(address="local", num_cpus=max(8, 2 * (os.cpu_count() or 2)), include_dashboard=False)


def absolute_paths(cfg: Config) -> Config:
    """Relative local paths resolved against the current directory, which is the job's working
    directory under `ray job submit`. Ray workers may run elsewhere, so they get absolute paths.
    Paths that don't exist here (hub names, `tiny-llama`) and URIs are left as they are."""

    def absolute(p: str) -> str:
        return p if storage.is_uri(p) or not Path(p).exists() else str(Path(p).resolve())

    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, paths=tuple(absolute(p) for p in cfg.data.paths)),
        tokenize=dataclasses.replace(cfg.tokenize, tokenizer=absolute(cfg.tokenize.tokenizer)),
        model=dataclasses.replace(cfg.model, name=absolute(cfg.model.name)),
    )


def storage_path(cfg: Config) -> str:
    """`run.storage_path`, absolute when local (Ray Train requires it), a URI left as it is."""
    return storage.absolute(cfg.run.storage_path)


def run_dir(cfg: Config) -> str:
    """Where one run's files go: Ray Train's results and checkpoints, packed/, tensorboard/."""
    return f"{storage_path(cfg)}/{cfg.run.name}"
