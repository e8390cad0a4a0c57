"""Where rank 0's metrics go besides Ray Train's reports: TensorBoard, Weights & Biases and MLflow.

    trackers = Trackers.open(targets, run_name="quickstart", params=cfg.to_dict())
    trackers.scalars(step, {"loss": 2.3, "lr": 1e-3})     # TensorBoard and W&B, as train/<key>
    trackers.report(step, metrics)                          # MLflow, one row per Ray Train report
    trackers.close()

TensorBoard and W&B get the same scalars under the same names at the same optimizer steps (each
step's values, and at each report the window's throughput, MFU, memory, eval loss and the plan's
packing efficiency and balance), so their curves agree. MLflow gets each report's metrics, as it
did before W&B came: its file store writes a file a metric, too much for every step.

W&B online goes through Ray's own `ray.air.integrations.wandb.setup_wandb` (its API-key lookup
and hooks). Its defaults come from Ray Train V1's session (run name, id, group, rank 0 only), which
Train V2 workers don't have, so the worker passes them itself: only rank 0 calls it, with the id
saved in the run folder (`WANDB_ID`), so that a resumed run (or a restarted worker group) goes on
in the same W&B run. Offline, it calls `wandb.init` with the same arguments: Ray's demands an API key. Ray's `WandbLoggerCallback`
is a Tune callback that logs what trials report; a `raypack train` run has no Tune, and trials of
a sweep log from their rank 0 like any run (grouped by the sweep's name, `runs.trial_config`).
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tensorboardX import SummaryWriter

from raypack import storage
from raypack.config import Config
from raypack.errors import ConfigError


@dataclass(frozen=True)
class TrackingTargets:
    """Where a run's trackers write (rank 0), as the driver resolved them (trainer.build_trainer)."""

    tensorboard_dir: str | None = None
    mlflow_uri: str | None = None
    """MLFLOW_TRACKING_URI overrides it."""
    wandb: dict[str, Any] | None = None
    """`run.wandb` as a dict (mode, project, entity, group, tags), with `dir` and `id` added; None: off."""


def targets(cfg: Config, root: str, check: bool = True) -> TrackingTargets:
    """Where the run in `root` tracks, from its config and the environment; with `check`, a
    ConfigError, before anything starts, for a tracker that could not work there."""
    t, w = cfg.train, cfg.run.wandb
    local = not storage.is_uri(root)
    if not check:
        return TrackingTargets(f"{root}/tensorboard" if t.tensorboard and local else None)
    # Event files, MLflow's file store and an offline W&B run need a local folder.
    if t.mlflow and not local and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError("train.mlflow: with a URI run.storage_path, set MLFLOW_TRACKING_URI to a tracking server")
    if w.enabled:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"run.wandb.mode={w.mode} needs wandb: pip install 'raypack[tracking]'")
        if w.mode == "offline" and not local:
            raise ConfigError("run.wandb.mode=offline writes the W&B run into the run folder, which a URI "
                              "run.storage_path isn't; use run.wandb.mode=online")
        if w.mode == "online" and not _wandb_key():
            raise ConfigError("run.wandb.mode=online: set WANDB_API_KEY in the environment (on a cluster, from a "
                              "Secret: cluster/README.md), or run `wandb login`; raypack never reads it from a config")
    return TrackingTargets(
        tensorboard_dir=f"{root}/tensorboard" if t.tensorboard and local else None,
        mlflow_uri=(os.environ.get("MLFLOW_TRACKING_URI") or f"file://{root}/mlruns") if t.mlflow else None,
        wandb={**asdict(w), "dir": str(wandb_dir(root)) if local else None, "id": wandb_id(root)} if w.enabled else None,
    )


def save_wandb_id(root: str, tracking: TrackingTargets) -> None:
    """Keep the run's W&B id in its folder, once the run has started, for its resumes."""
    if tracking.wandb and not storage.exists(f"{root}/{WANDB_ID}"):
        storage.write_text(f"{root}/{WANDB_ID}", tracking.wandb["id"])


def _wandb_key() -> bool:
    """Whether W&B has an API key here: WANDB_API_KEY, or the netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


WANDB_ID = "raypack_wandb_id"
"""The run's W&B run id, in its folder: a resume continues that W&B run, and a new run that reuses
the folder's name after it was removed starts its own."""


def wandb_id(root: str) -> str:
    """The W&B id saved in the run folder, or a new one for a run that has none yet."""
    path = f"{root}/{WANDB_ID}"
    return storage.read_text(path).strip() if storage.exists(path) else secrets.token_hex(8)


def wandb_dir(run_dir: str) -> Path:
    """Where an offline W&B run of the run in `run_dir` is written (wandb adds its own wandb/)."""
    return Path(run_dir) / "wandb"


def offline_runs(run_dir: str) -> list[Path]:
    """The offline W&B run folders under a run folder, oldest first: what `wandb sync` uploads."""
    return sorted((wandb_dir(run_dir) / "wandb").glob("offline-run-*"))


class Trackers:
    """TensorBoard, W&B and MLflow on rank 0; on other ranks, nothing."""

    def __init__(self, tensorboard: Any = None, wandb_run: Any = None, mlflow: Any = None):
        self._tb, self._wandb, self._mlflow = tensorboard, wandb_run, mlflow

    @classmethod
    def open(cls, targets: TrackingTargets, run_name: str, params: dict[str, Any], rank: int = 0) -> Trackers:
        if rank != 0:
            return cls()
        tb = None
        if targets.tensorboard_dir:
            Path(targets.tensorboard_dir).mkdir(parents=True, exist_ok=True)
            tb = SummaryWriter(targets.tensorboard_dir)
        return cls(tb, _start_wandb(targets.wandb, run_name, params), _start_mlflow(targets.mlflow_uri, run_name, params))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """Numeric `values` as train/<key> at optimizer step `step`, to TensorBoard and W&B."""
        scalars = {f"train/{k}": float(v) for k, v in values.items() if _is_number(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            # W&B drops a step lower than one it has (a run resumed from an earlier checkpoint
            # than it had logged); those steps were logged already, from the same data.
            self._wandb.log(scalars, step=step)

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """A Ray Train report's numeric metrics, to MLflow; flushes TensorBoard."""
        if self._tb is not None:
            self._tb.flush()
        if self._mlflow is not None:
            self._mlflow.log_metrics({k: float(v) for k, v in metrics.items() if _is_number(v)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _start_wandb(settings: dict[str, Any] | None, run_name: str, params: dict[str, Any]):
    if not settings:
        return None
    try:  # optional (raypack[tracking]): imported only when a run asks for it
        import wandb
        from ray.air.integrations.wandb import setup_wandb
    except ImportError:
        raise RuntimeError("run.wandb.mode is on but wandb is not installed: pip install 'raypack[tracking]'") from None
    if settings["dir"]:
        Path(settings["dir"]).mkdir(parents=True, exist_ok=True)
    init = dict(
        config=params,
        project=settings["project"],
        entity=settings.get("entity"),
        group=settings.get("group"),
        tags=list(settings.get("tags") or ()),
        mode=settings["mode"],
        dir=settings["dir"],
        resume="allow",  # Ray's default, `True`, fails when the run doesn't exist yet
        # W&B's banner and sync lines on every run's screen; raypack prints where the run is.
        settings=wandb.Settings(quiet=True, silent=True, console="off"),
    )
    if settings["mode"] == "offline":
        # Ray's setup_wandb demands an API key even for an offline run, which never uses one.
        return wandb.init(id=settings["id"], name=run_name, **init)
    # rank_zero_only: only rank 0 gets here; Ray's own rank check reads a Train V1 session.
    return setup_wandb(trial_id=settings["id"], trial_name=run_name, rank_zero_only=False, **init)


def _start_mlflow(uri: str | None, run_name: str, params: dict[str, Any]):
    if not uri:
        return None
    try:  # optional (raypack[tracking])
        import mlflow
    except ImportError:
        raise RuntimeError("train.mlflow is on but mlflow is not installed: pip install 'raypack[tracking]'") from None
    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", uri))
    mlflow.set_experiment("raypack")
    mlflow.start_run(run_name=run_name)
    # MLflow refuses a param value over its length limit (500 characters in older servers): an
    # inline chat template or a long list of paths is cut, not a failed start.
    mlflow.log_params({k: v if len(str(v)) <= 500 else f"{str(v)[:497]}..." for k, v in _flat(params).items()})
    return mlflow


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} as {"train.lr": 1e-3}: MLflow's params are flat."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
