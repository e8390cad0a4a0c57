"""Process set-up shared by every command: start or join Ray.

    init_ray()                      # join RAY_ADDRESS's cluster, else start a local instance
    init_ray(RaySettings(num_cpus=8, dashboard=False))   # the same path, other settings (tests)

One policy for every command, so `raypack data`, `plan`, `train` and `sweep` start Ray alike
(where a run's files live is raypack/runs.py's):

- a local instance listens on 127.0.0.1 only (GCS, raylet, dashboard, the Prometheus metrics
  endpoints), with the dashboard on, which Ray Train's State API queries need;
- the screen shows raypack's lines and Ray's warnings: Ray's own INFO lines (start-up, Ray Data's
  execution plans and per-dataset progress lines off a terminal) go to Ray's log files only.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray

# ray.train.report blocks until the controller's health-check poll drains it (every 2 s by
# default); a short interval keeps a report near 0.07 s. Ray reads it when it starts, and the
# raylet passes the driver's environment on, so it is set on import, before any init_ray().
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for "this node may join a cluster" (its default is off on macOS and Windows, on
on Linux). Off, Ray binds every server to 127.0.0.1 instead of the node's address or all
interfaces; raypack turns it off for the local instance it starts (set it to 1 to undo that)."""


@dataclass(frozen=True)
class RaySettings:
    """How a local instance starts. The defaults are what every command uses."""

    num_cpus: int | None = None
    """Logical CPUs; None: max(8, 2 x cores). More than the cores: workers and Ray Data actors
    that took every CPU would leave the read tasks none, and a job would hang on a small machine."""
    dashboard: bool = True
    """Ray Train's placement-group cleaner queries the State API, which the dashboard serves."""
    log_to_driver: bool = True
    """Workers' output on this process's screen (tests read it from Ray's log files instead)."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Passed to ray.init (tests put the repository on the workers' PYTHONPATH)."""


_LOCAL: list[str] = []
"""The GCS address of the local instance this process started: a cluster that can never grow."""


def is_local_instance() -> bool:
    """Whether Ray here is a local instance this process started (no autoscaler: what it has at
    start is all it will ever have), not a cluster it joined."""
    return ray.is_initialized() and ray.get_runtime_context().gcs_address in _LOCAL


def init_ray(settings: RaySettings = RaySettings()) -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a local one
    with `settings`."""
    quiet_ray_data()
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
    else:
        _init_local(settings)


def _init_local(settings: RaySettings) -> None:
    from ray._private import ray_constants

    port = _free_port()
    # Set for the processes ray.init starts, which pass them on to every worker, then put back so
    # that nothing started later by this process (a test's multi-node cluster) inherits them:
    # - the loopback switch, which Ray also read when it was imported, hence the module attribute;
    # - where this instance's State API answers. Ray Train's placement-group cleaner queries it,
    #   and without an address looks for Ray instances on the machine and fails when it finds
    #   more than one (another user's, another test's).
    env = {LOOPBACK_ONLY: "0", **({"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"} if settings.dashboard else {})}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update({k: v for k, v in env.items() if saved_env[k] is None})
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(LOOPBACK_ONLY, False)
    try:
        context = ray.init(
            address="local",
            num_cpus=settings.num_cpus or max(8, 2 * (os.cpu_count() or 2)),
            include_dashboard=settings.dashboard,
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            log_to_driver=settings.log_to_driver,
            runtime_env=settings.runtime_env or None,
            logging_level=logging.WARNING,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
    _LOCAL[:] = [context.address_info["gcs_address"]]
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
