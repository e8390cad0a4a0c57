"""Ray Train assembly: prepare the packed data on the driver, then fit a `TorchTrainer`.

    cfg ──> init_ray ──> prepare (tokenize, plan, pack; once, reused on resume) ──> TorchTrainer.fit
                                                          workers: raypack.train.loop.train_loop_per_worker

Runs land in `<run.storage_path>/<run.name>/`: Ray's result files and checkpoints, `packed/`
(the plan's per-rank packs, or under `data.cache_path` when set) and `tensorboard/`. Fitting again with the same name and storage path
resumes from that run's last checkpoint; that is what `raypack train --resume PATH` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raypack import storage
from raypack.config import Config, ConfigError
from raypack.data.prepare import packed_root, prepare
from raypack.runtime import absolute_paths, init_ray, run_dir, storage_path
from raypack.train.loop import train_loop_per_worker


def build_trainer(
    cfg: Config,
    *,
    callbacks: Sequence = (),
    loop: Callable[[dict], None] | None = None,
    extra_loop_config: dict | None = None,
):
    """The `TorchTrainer` for `cfg`, with its packed data prepared (or reused) under the run dir.
    `loop` replaces the per-worker function (tests wrap it); `extra_loop_config` adds to its config."""
    cfg = absolute_paths(cfg)
    t = cfg.train
    root = run_dir(cfg)
    if t.mlflow and storage.is_uri(root) and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError("train.mlflow: with a URI run.storage_path, set MLFLOW_TRACKING_URI to a tracking server")
    prepared = prepare(cfg, t.num_workers, packed_root(cfg, t.num_workers, root))
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
    return TorchTrainer(
        loop or train_loop_per_worker,
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
            callbacks=list(callbacks),
            worker_runtime_env={"env_vars": env} if env else None,
        ),
    )


def fit(cfg: Config, *, callbacks: Sequence = (), **kwargs):
    """Prepare and train; returns Ray Train's `Result` (metrics, checkpoint, path)."""
    init_ray()
    return build_trainer(cfg, callbacks=callbacks, **kwargs).fit()
