"""Ray Train assembly: prepare the packed data on the driver, then fit a `TorchTrainer`.

    cfg ──> init_ray ──> prepare (tokenize, plan, pack; once, reused on resume) ──> TorchTrainer.fit
                                                          workers: raypack.train.loop.train_loop_per_worker

Runs land in `<run.storage_path>/<run.name>/`: Ray's result files and checkpoints, `packed/`
(the plan's per-rank packs) and `tensorboard/`. Fitting again with the same name and storage path
resumes from that run's last checkpoint; that is what `raypack train --resume PATH` does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from raypack import storage
from raypack.config import Config, ConfigError, load

# ray.train.report blocks until the controller's health-check poll drains it (every 2 s by
# default); a short interval keeps a report near 0.07 s. It must be set before Ray starts.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a local one."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        # More logical CPUs than cores: workers and Ray Data actors that took every CPU would
        # leave the read tasks none, and the job would hang on a small machine.
        ray.init(address="local", num_cpus=max(8, 2 * (os.cpu_count() or 2)), include_dashboard=False)


def storage_path(cfg: Config) -> str:
    """`run.storage_path`, absolute when local (Ray Train requires it), a URI left as it is."""
    path = cfg.run.storage_path
    return path.rstrip("/") if "://" in path else str(Path(path).expanduser().resolve())


def run_dir(cfg: Config) -> str:
    return f"{storage_path(cfg)}/{cfg.run.name}"


def build_trainer(
    cfg: Config,
    *,
    callbacks: Sequence = (),
    loop: Callable[[dict], None] | None = None,
    extra_loop_config: dict | None = None,
):
    """The `TorchTrainer` for `cfg`, with its packed data prepared (or reused) under the run dir."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raypack.data.prepare import prepare
    from raypack.train.loop import train_loop_per_worker

    cfg = cfg.with_absolute_paths()
    t = cfg.train
    root = run_dir(cfg)
    if t.mlflow and storage.is_uri(root) and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError("train.mlflow: with a URI run.storage_path, set MLFLOW_TRACKING_URI to a tracking server")
    prepared = prepare(cfg, t.num_workers, f"{root}/packed")
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


def resume_config(path: str, overrides: Sequence[str] = ()) -> Config:
    """The config a stopped run was started with (saved as raypack_config.yaml), for --resume."""
    import tempfile

    saved = f"{path.rstrip('/')}/raypack_config.yaml"
    if not storage.exists(saved):
        raise ConfigError(f"--resume {path}: no raypack_config.yaml there; is it a raypack run folder?")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(storage.read_text(saved))
        f.flush()
        return load(f.name, list(overrides))


def run_cli(args) -> int:
    import yaml

    cfg = resume_config(args.resume, args.overrides) if args.resume else load(args.config, args.overrides)
    root = run_dir(cfg)
    if not args.resume and storage.exists(f"{root}/checkpoint_manager_snapshot.json"):
        print(f"[raypack] run {cfg.run.name!r} exists in {root}: continuing from its last checkpoint "
              "(set run.name to start a fresh run)")
    storage.write_text(f"{root}/raypack_config.yaml", yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False))
    result = fit(cfg)
    metrics = result.metrics or {}
    print("\n[raypack] training finished", file=sys.stderr)
    for key in ("step", "loss", "eval_loss", "tokens_per_s", "packing_efficiency", "peak_memory_gb"):
        if metrics.get(key) is not None:
            value = metrics[key]
            print(f"  {key:<20} {value:.4f}" if isinstance(value, float) else f"  {key:<20} {value}")
    print(f"  results             {result.path}")
    if result.checkpoint:
        print(f"  checkpoint          {result.checkpoint.path}  (Hugging Face model in model/)")
    if cfg.train.tensorboard and not storage.is_uri(root):
        print(f"  tensorboard         tensorboard --logdir {root}/tensorboard")
    return 0 if result.error is None else 1


def _plain(value):
    """Tuples to lists, so that the saved YAML loads back through the config schema."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
