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

import base64
import importlib.util
import json
import netrc
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tensorboardX import SummaryWriter

from raypack import storage
from raypack.config import Config
from raypack.errors import ConfigError, InputError


@dataclass(frozen=True)
class TrackingTargets:
    """Where a run's trackers write (rank 0), as the driver resolved them (trainer.build_trainer)."""

    tensorboard_dir: str | None = None
    mlflow_uri: str | None = None
    """MLFLOW_TRACKING_URI overrides it."""
    wandb: dict[str, Any] | None = None
    """`run.wandb` as a dict (mode, project, entity, group, tags), with `dir` and `id` added; None: off."""


REACH_TIMEOUT_S = 10.0
"""How long the check before Ray starts waits for the W&B server or an MLflow tracking server."""


class TrackingError(InputError):
    """A tracker that can't work here (a package missing, a server that doesn't answer, a key it
    refuses): the same on every try, so never retried; the message says what to change."""


def targets(cfg: Config, root: str, check: bool = True) -> TrackingTargets:
    """Where the run in `root` tracks, from its config and the environment; with `check`, a
    ConfigError or TrackingError, before anything starts, for a tracker that could not work there:
    its package missing, its settings refused by the tracker's own validation, its server not
    answering within REACH_TIMEOUT_S."""
    t, w = cfg.train, cfg.run.wandb
    local = not storage.is_uri(root)
    if not check:
        return TrackingTargets(f"{root}/tensorboard" if t.tensorboard and local else None)
    # Event files, MLflow's file store and an offline W&B run need a local folder.
    if t.mlflow:
        if importlib.util.find_spec("mlflow") is None:
            raise ConfigError("train.mlflow: true needs mlflow: pip install 'raypack[tracking]' (or set "
                              "train.mlflow=false)")
        if not local and not os.environ.get("MLFLOW_TRACKING_URI"):
            raise ConfigError("train.mlflow: with a URI run.storage_path, set MLFLOW_TRACKING_URI to a tracking server")
        if os.environ.get("MLFLOW_TRACKING_URI"):
            check_mlflow_server(os.environ["MLFLOW_TRACKING_URI"])
    if w.enabled:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"run.wandb.mode={w.mode} needs wandb: pip install 'raypack[tracking]'")
        check_wandb_settings(w)
        if w.mode == "offline" and not local:
            raise ConfigError("run.wandb.mode=offline writes the W&B run into the run folder, which a URI "
                              "run.storage_path isn't; use run.wandb.mode=online")
        if w.mode == "online":
            if not (key := _wandb_key()):
                raise ConfigError("run.wandb.mode=online: set WANDB_API_KEY in the environment (on a cluster, from a "
                                  "Secret: cluster/README.md), or run `wandb login`; raypack never reads it from a "
                                  "config")
            check_wandb_server(key)
    return TrackingTargets(
        tensorboard_dir=f"{root}/tensorboard" if t.tensorboard and local else None,
        mlflow_uri=(os.environ.get("MLFLOW_TRACKING_URI") or f"file://{root}/mlruns") if t.mlflow else None,
        wandb={**asdict(w), "dir": str(wandb_dir(root)) if local else None, "id": wandb_id(root)} if w.enabled else None,
    )


def save_wandb_id(root: str, tracking: TrackingTargets) -> None:
    """Keep the run's W&B id in its folder, once the run has started, for its resumes."""
    if tracking.wandb and not storage.exists(f"{root}/{WANDB_ID}"):
        storage.write_text(f"{root}/{WANDB_ID}", tracking.wandb["id"])


def _wandb_base() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")


def _wandb_key() -> str | None:
    """W&B's API key here: WANDB_API_KEY, or the netrc entry `wandb login` writes; None if neither."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        entry = netrc.netrc().authenticators(urlparse(_wandb_base()).hostname)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def check_wandb_settings(w) -> None:
    """`run.wandb`'s names as W&B itself validates them (a project name with `/` or `:`, ...)."""
    import wandb

    try:
        wandb.Settings(project=w.project, entity=w.entity, run_group=w.group, run_tags=tuple(w.tags))
    except Exception as e:  # UsageError, or pydantic's ValidationError wrapping it
        raise ConfigError(f"run.wandb: {_first_line(e)}") from None


def check_wandb_server(key: str) -> None:
    """The W&B server answers within REACH_TIMEOUT_S and takes the API key (one GraphQL query for
    the key's user), so that no worker blocks in wandb.init and no run is retried for it."""
    base = _wandb_base()
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": "{ viewer { entity } }"}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Basic "
                                              + base64.b64encode(f"api:{key}".encode()).decode()})
    offline = ("log offline with run.wandb.mode=offline (then `wandb sync`), or fix the network or WANDB_BASE_URL")
    try:
        urllib.request.urlopen(request, timeout=REACH_TIMEOUT_S).close()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise TrackingError(f"run.wandb.mode=online: the W&B server at {base} refused the API key (HTTP {e.code}); "
                                "check WANDB_API_KEY or run `wandb login` again") from None
        raise TrackingError(f"run.wandb.mode=online: {base} answered HTTP {e.code} where a W&B server answers its "
                            f"API (is WANDB_BASE_URL right?); {offline}") from None
    except (OSError, ValueError) as e:  # no route, refused, DNS, a timeout, a malformed URL
        raise TrackingError(f"run.wandb.mode=online: can't reach the W&B server at {base} within "
                            f"{REACH_TIMEOUT_S:g} s ({_reason(e)}); {offline}") from None


def check_mlflow_server(uri: str) -> None:
    """MLFLOW_TRACKING_URI answers within REACH_TIMEOUT_S: an HTTP server its /health endpoint, a
    file store its folder; other stores (databricks, a database) are left to MLflow."""
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        folder = Path(urlparse(uri).path if scheme else uri).expanduser()
        above = folder
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir() or not os.access(above, os.W_OK):
            raise TrackingError(f"train.mlflow: MLFLOW_TRACKING_URI {uri}: can't write {folder} ({above} is "
                                "not a writable folder)")
        return
    if scheme not in ("http", "https"):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=REACH_TIMEOUT_S).close()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise TrackingError(f"train.mlflow: the MLflow server at {uri} refused the credentials (HTTP {e.code}); set "
                                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN") from None
        raise TrackingError(f"train.mlflow: {uri} answered HTTP {e.code} at /health, which an MLflow tracking "
                            "server answers; fix MLFLOW_TRACKING_URI, or unset it to log to <run>/mlruns") from None
    except (OSError, ValueError) as e:
        raise TrackingError(f"train.mlflow: can't reach MLFLOW_TRACKING_URI {uri} within {REACH_TIMEOUT_S:g} s "
                            f"({_reason(e)}); start the server, fix the URI, or unset it to log to <run>/mlruns"
                            ) from None


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e  # URLError wraps the socket's error
    return "timed out" if isinstance(reason, TimeoutError) else _first_line(reason)


def _first_line(e: BaseException | str) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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

    def image(self, step: int, name: str, image: Any) -> None:
        """An [H, W, 3] uint8 image as train/<name> at optimizer step `step`, to TensorBoard and W&B
        (MLflow keeps images as artifacts, not per step: left out)."""
        if self._tb is not None:
            self._tb.add_image(f"train/{name}", image, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({f"train/{name}": wandb.Image(image)}, step=step)

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
            import wandb

            self._wandb.finish()
            # finish() only tells W&B's service process that the run is over; the service writes
            # the run's last records (all of an offline run's file, where it had not flushed yet)
            # as it closes the run, after finish returns. teardown waits for that. Its atexit hook
            # would too, but a Ray worker can end without running atexit hooks.
            wandb.teardown()
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
        raise TrackingError("run.wandb.mode is on but wandb is not installed on this worker's node: pip install "
                            "'raypack[tracking]' there, or set run.wandb.mode=disabled") from None
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
    try:
        if settings["mode"] == "offline":
            # Ray's setup_wandb demands an API key even for an offline run, which never uses one.
            return wandb.init(id=settings["id"], name=run_name, **init)
        # rank_zero_only: only rank 0 gets here; Ray's own rank check reads a Train V1 session.
        return setup_wandb(trial_id=settings["id"], trial_name=run_name, rank_zero_only=False, **init)
    except Exception as e:  # the server, the key, the folder: what a restart would meet again
        raise TrackingError(f"run.wandb.mode={settings['mode']}: W&B failed to start on rank 0 ({_first_line(e)}); "
                            "log offline with run.wandb.mode=offline, or turn it off with run.wandb.mode=disabled"
                            ) from e


def _start_mlflow(uri: str | None, run_name: str, params: dict[str, Any]):
    if not uri:
        return None
    try:  # optional (raypack[tracking])
        import mlflow
    except ImportError:
        raise TrackingError("train.mlflow is on but mlflow is not installed on this worker's node: pip install "
                            "'raypack[tracking]' there, or set train.mlflow=false") from None
    try:
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", uri))
        mlflow.set_experiment("raypack")
        mlflow.start_run(run_name=run_name)
        # MLflow refuses a param value over its length limit (500 characters in older servers): an
        # inline chat template or a long list of paths is cut, not a failed start.
        mlflow.log_params({k: v if len(str(v)) <= 500 else f"{str(v)[:497]}..." for k, v in _flat(params).items()})
    except Exception as e:  # the server, its credentials, the store: what a restart would meet again
        raise TrackingError(f"train.mlflow: MLflow failed to start on rank 0 ({_first_line(e)}); fix "
                            "MLFLOW_TRACKING_URI or set train.mlflow=false") from e
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
