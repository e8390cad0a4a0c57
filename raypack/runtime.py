"""Process set-up shared by every command: start or join Ray, and where a run's files live.

    init_ray()                      # join RAY_ADDRESS's cluster, else start a local instance
    cfg = absolute_paths(cfg)       # before the config travels to processes with another cwd
    run_dir(cfg)                    # <run.storage_path>/<run.name>, absolute or a URI

One policy for every command, so `raypack data`, `plan`, `train` and `sweep` start Ray alike:

- a local instance listens on 127.0.0.1 only (GCS, raylet, dashboard, the Prometheus metrics
  endpoints), with the dashboard on, which Ray Train's State API queries need;
- the screen shows raypack's lines and Ray's warnings: Ray's own INFO lines (start-up, Ray Data's
  execution plans and per-dataset progress lines off a terminal) go to Ray's log files only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path

import ray

from raypack import storage
from raypack.config import Config

# ray.train.report blocks until the controller's health-check poll drains it (every 2 s by
# default); a short interval keeps a report near 0.07 s. Ray reads it when it starts, and the
# raylet passes the driver's environment on, so it is set on import, before any init_ray().
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for "this node may join a cluster" (its default is off on macOS and Windows, on
on Linux). Off, Ray binds every server to 127.0.0.1 instead of the node's address or all
interfaces; raypack turns it off for the local instance it starts (set it to 1 to undo that)."""


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a local one."""
    quiet_ray_data()
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
    else:
        _init_local()


def _init_local() -> None:
    from ray._private import ray_constants

    port = _free_port()
    # Set for the processes ray.init starts, which pass them on to every worker, then put back so
    # that nothing started later by this process (a test's multi-node cluster) inherits them:
    # - the loopback switch, which Ray also read when it was imported, hence the module attribute;
    # - where this instance's State API answers. Ray Train's placement-group cleaner queries it,
    #   and without an address looks for Ray instances on the machine and fails when it finds
    #   more than one (another user's, another test's).
    env = {LOOPBACK_ONLY: "0", "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update({k: v for k, v in env.items() if saved_env[k] is None})
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(LOOPBACK_ONLY, False)
    try:
        context = ray.init(
            address="local",
            # More logical CPUs than cores: workers and Ray Data actors that took every CPU would
            # leave the read tasks none, and the job would hang on a small machine.
            num_cpus=max(8, 2 * (os.cpu_count() or 2)),
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            logging_level=logging.WARNING,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
    dashboard = f", dashboard http://{context.dashboard_url}" if context.dashboard_url else ""
    print(f"[raypack] started a local Ray instance (listening on {context.address_info['node_ip_address']}{dashboard})",
          flush=True)


def _free_port() -> int:
    """A port free on 127.0.0.1 now (8265, Ray's default, may be another instance's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_ray_data() -> None:
    """Ray Data on this process: no execution-plan lines, and its INFO lines (per-dataset
    progress blocks every few seconds off a terminal, "execution finished") to its log file
    only; its warnings still reach the screen, and so do its progress bars on a terminal."""
    import ray.data

    ray.data.DataContext.get_current().print_on_execution_start = False
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(max(handler.level, logging.WARNING))


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
