"""Process set-up shared by every command: start or join Ray.

    init_ray()                      # join RAY_ADDRESS's cluster, else start a local instance
    init_ray(RaySettings(num_cpus=8, log_to_driver=False))   # the same path, other settings (tests)

One policy for every command, so `raypack data`, `plan`, `train` and `sweep` start Ray alike
(where a run's files live is raypack/runs.py's):

- a local instance listens on 127.0.0.1 only (GCS, raylet, its agents, the Prometheus metrics
  endpoints; a run's torch.distributed store and gloo / NCCL: raypack/train/placement.py), and
  starts without the dashboard: its web server and nine module processes cost ~3 CPU-seconds of a
  start-up that waits on 2 cores for every one (docs/guides/speed.md, start-up), and nothing a run
  does needs the State API it serves (raypack/train/trainer.py, RunTrainer). For a dashboard, start
  Ray with one (`ray start --head`) and set RAY_ADDRESS: raypack joins it.
  `is_local_instance()` tells a local instance from a cluster that was joined, whose nodes and
  autoscaler node types `cluster_view()` reads;
- a local instance's processes run in a session of their own, so a signal to the command's
  process group (`timeout`) reaches the command, which stops a run gracefully, and not them;
  SIGTERM's handler stays the command's (raypack/train/stop.py), not the one ray.init installs;
- the screen shows raypack's lines and Ray's warnings: Ray's own INFO lines (start-up, Ray Data's
  execution plans and per-dataset progress lines off a terminal) go to Ray's log files only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import ray

from raypack import raycompat
from raypack.console import route_worker_output

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
    dashboard: bool = False
    """Start the dashboard too (listening on 127.0.0.1; its URL printed). Off: a faster start."""
    log_to_driver: bool = True
    """Workers' output on this process's screen (tests read it from Ray's log files instead)."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Passed to ray.init (tests put the repository on the workers' PYTHONPATH)."""


LOCAL_MARK = b"raypack_local_instance"
"""Key (namespace "raypack") that `init_ray` writes into the GCS of a local instance it starts, so
that its other processes (a sweep trial runs `start` in a Tune actor) know it too."""

_LOCAL: dict[str, bool] = {}
"""GCS address -> whether it is a local instance raypack started, once asked."""


def is_local_instance() -> bool:
    """Whether Ray here is a local instance that raypack started (no autoscaler: what it has at
    start is all it will ever have, and it listens on 127.0.0.1 only), not a cluster it joined."""
    if not ray.is_initialized():
        return False
    gcs = ray.get_runtime_context().gcs_address
    if gcs not in _LOCAL:
        _LOCAL[gcs] = raycompat.kv_get(LOCAL_MARK, namespace="raypack") is not None
    return _LOCAL[gcs]


@dataclass(frozen=True)
class ClusterView:
    """A joined cluster as Ray's GCS sees it: the nodes it has, and what an autoscaler may add."""

    nodes: list[dict[str, float]]
    """Each alive node's total resources."""
    node_types: list[tuple[str, dict[str, float], int]]
    """(name, resources, most nodes or -1 for no limit) of each node type the autoscaler may add,
    where it publishes them (Ray Train's and Ray Data's own checks read the same record); empty
    where it doesn't."""
    grows: bool
    """Whether an autoscaler may add nodes (of the types above, or of types it doesn't publish)."""


def cluster_view() -> ClusterView:
    """What the cluster this process joined has, and can grow to."""
    nodes = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    types, grows = raycompat.cluster_autoscaling()
    return ClusterView(nodes, types, grows)


def init_ray(settings: RaySettings = RaySettings()) -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a local one
    with `settings`."""
    quiet_ray_data()
    if ray.is_initialized():
        return
    # ray.init replaces this process's SIGTERM handler with one that exits from inside whatever
    # runs (Ray's own handler then dumps native stacks); the command's handler (a clean stop,
    # raypack/train/stop.py) goes back in its place. A process without one keeps Ray's.
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
    else:
        _init_local(settings)
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)
    route_worker_output()


def _init_local(settings: RaySettings) -> None:
    port = _free_port()
    # Set for the processes ray.init starts, which pass them on to every worker, then put back so
    # that nothing started later by this process (a test's multi-node cluster) inherits them:
    # - the loopback switch, which Ray also read when it was imported, hence the module attribute;
    # - with a dashboard, where this instance's State API answers: without an address, a State
    #   API query looks for Ray instances on the machine and fails when it finds more than one
    #   (another user's, another test's);
    # - Ray 2.60's default for a task or actor without GPUs (its accelerator variables left as
    #   they are), which Ray 2.55 only announces, in a FutureWarning at every start.
    env = {LOOPBACK_ONLY: "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", **({"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"} if settings.dashboard else {})}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if saved_env[k] is None})
    # Ray warns at every start that it turned token authentication on (its default for a new local
    # instance) and how to opt out; raypack's own line below says whether it is on.
    auth_log = logging.getLogger(raycompat.AUTH_LOGGER)
    auth_level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        with raycompat.own_session(), raycompat.set_loopback_only(LOOPBACK_ONLY):
            context = ray.init(
                address="local",
                num_cpus=settings.num_cpus or max(8, 2 * (os.cpu_count() or 2)),
                include_dashboard=settings.dashboard,
                dashboard_host="127.0.0.1",
                dashboard_port=port,
                log_to_driver=settings.log_to_driver,
                runtime_env=settings.runtime_env or None,
                logging_level=logging.WARNING,
                # Ray starts idle workers for the first driver's plain tasks (two here, ~0.5 CPU-s
                # each, as a run starts): a run's actors all ask for workers of their own (a
                # runtime env), and small data is prepared in this process (data.driver_max_mb).
                _system_config={"prestart_worker_first_driver": False},
            )
    finally:
        auth_log.setLevel(auth_level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
    raycompat.kv_put(LOCAL_MARK, b"1", namespace="raypack")
    _LOCAL[context.address_info["gcs_address"]] = True
    dashboard = f", dashboard http://{context.dashboard_url}" if context.dashboard_url else ""
    auth = " with token authentication" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else ""
    print(f"[raypack] started a local Ray instance (listening on {context.address_info['node_ip_address']}{auth}"
          f"{dashboard})", flush=True)


def _free_port() -> int:
    """A port free on 127.0.0.1 now (8265, Ray's default, may be another instance's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_ray_data() -> None:
    """Ray Data on this process: no execution-plan lines, and its INFO lines (per-dataset
    progress blocks every few seconds off a terminal, "execution finished") to its log file
    only, and no progress bars: data preparation prints its own progress lines
    (raypack/data/progress.py). Its warnings still reach the screen."""
    import ray.data

    from ray.util.debug import log_once

    context = ray.data.DataContext.get_current()
    context.print_on_execution_start = False
    context.enable_progress_bars = False
    # Ray Data warns, once per process, that it draws no bars, and how to turn them on: spend its once.
    log_once("ray_data_progress_manager_disabled")
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(max(handler.level, logging.WARNING))
