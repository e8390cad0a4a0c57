"""Every use raypack makes of Ray's private modules, in one place, each with a fallback.

Ray's public API covers what raypack needs to train (Ray Data, `ray.train`, `ray.tune`); what
it reads from Ray's internals only makes a run quieter, faster to start, or kinder to stop. A Ray
release may move any of it, so each use below is wrapped: where the internal is missing, the
fallback keeps the run correct and loses only what the function's docstring says.
`tests/unit/test_raycompat.py` runs every fallback (the internal made to fail) beside the real
thing. Nothing outside this module imports `ray._private`, `ray._raylet`, `ray.experimental`,
`ray.autoscaler._private` or `ray.train.v2._internal` (a test greps for it).

| use | internal | without it |
|---|---|---|
| a key-value store shared by the driver and workers (graceful stop, local-instance mark) | `ray.experimental.internal_kv` | Ctrl-C/SIGTERM stop at once, without the last checkpoint; a local instance is taken for a cluster (its resource check is the cluster's) |
| a node's preemption notice, read without a barrier | Train's worker context | a preempted node's workers are not stopped after their step: the run goes on from its last checkpoint |
| Ray Train's per-report INFO dump and its traceback lines for errors raypack prints as one line | Train's logger names | those lines reach the screen |
| a local instance's scaling policy without autoscaler requests; callbacks a raypack run has no use for | Train's scaling policy, callbacks | Ray Train's defaults: a slower start |
| worker output routed (raypack's lines bare, known noise dropped) | Ray's stdstream dispatcher | Ray prints every worker line, prefixed |
| a joined cluster's autoscaler node types | the GCS's cluster config and autoscaler report | the cluster is taken to grow: a start is never refused for nodes that may come |
| a local instance in a session of its own, on loopback only | Ray's process launcher, its constants | Ctrl-C through a process group reaches the instance too; Ray's own loopback default |
| Ray Train's log level (`ray.train.LoggingConfig`, public from Ray 2.56) | none before 2.56 | Train's INFO lines show |
| Ray Train's SIGINT handler replaced by raypack's graceful stop | `TorchTrainer._register_sigint_handler` | Ray Train's handler: Ctrl-C aborts the run, no checkpoint |
| tokenized Parquet files of at least 32 MiB (`write_parquet(min_bytes_per_file=)`: in Ray 2.60, not in 2.55) | none, a public keyword | a row count for rows of the longest length: files no bigger, more of them where rows are short (more pack-stage read tasks, no more memory each) |
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from typing import Any, Callable

import ray
import ray.train

__all__ = [
    "AUTH_LOGGER", "CONTROLLER_LOGGER", "TRAIN_FN_LOGGER", "cluster_autoscaling", "kv_del", "kv_get", "kv_put", "local_scaling_policy",
    "own_session", "parquet_min_file", "preemption_info", "quiet_report_log", "set_loopback_only", "stdstream_dispatcher",
    "store_stats_poller", "take_sigint_handler", "train_logging", "unused_callbacks",
]  # fmt: skip

# --- the key-value store ---------------------------------------------------------------------------


def _kv():
    try:
        from ray.experimental import internal_kv
    except ImportError:
        return None
    return internal_kv


def kv_put(key: str | bytes, value: str | bytes, namespace: str) -> bool:
    """Store `value` under `key` in the GCS's key-value store; False where this Ray has none."""
    kv = _kv()
    if kv is None:
        return False
    kv._internal_kv_put(key, value, namespace=namespace)
    return True


def kv_get(key: str | bytes, namespace: str) -> bytes | None:
    """The value under `key`, or None (none stored, or no store in this Ray)."""
    kv = _kv()
    return None if kv is None else kv._internal_kv_get(key, namespace=namespace)


def kv_del(key: str | bytes, namespace: str) -> None:
    kv = _kv()
    if kv is not None:
        kv._internal_kv_del(key, namespace=namespace)


# --- Ray Train ------------------------------------------------------------------------------------

TRAIN_FN_LOGGER = "ray.train.v2._internal.util"
"""Ray Train's logger of "Error in training function" (with the traceback), in each worker. A
name only: where Ray renames it, the filter on it filters nothing and the traceback shows."""
CONTROLLER_LOGGER = "ray.train.v2._internal.execution.controller.controller"
"""Ray Train's logger of "Error in control loop iteration" (with the traceback), in the controller."""
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""Ray's logger that warns, at every start of a local instance, that token authentication is on
(raypack's start line says whether it is); renamed, the warning shows."""


def train_logging(level: str) -> dict[str, Any]:
    """RunConfig's keywords for Ray Train's log level, a public API from Ray 2.56 (`LoggingConfig`);
    before it none: Train's INFO lines (worker group start, a dump per report) show."""
    config = getattr(ray.train, "LoggingConfig", None)
    return {} if config is None else {"logging_config": config(log_level=level)}


def parquet_min_file(min_bytes: int, max_row_bytes: int) -> dict[str, int]:
    """`Dataset.write_parquet`'s keywords for files of at least `min_bytes`: `min_bytes_per_file`
    where this Ray has it (2.60; 2.55 passes it on to pyarrow, which refuses it), else
    `min_rows_per_file` for rows of at most `max_row_bytes`: files no bigger, more of them
    where rows are shorter (more read tasks in the pack stage, none holding more memory)."""
    if "min_bytes_per_file" in inspect.signature(ray.data.Dataset.write_parquet).parameters:
        return {"min_bytes_per_file": min_bytes}
    return {"min_rows_per_file": max(1, min_bytes // max_row_bytes)}


def quiet_report_log() -> None:
    """Leave out Ray Train's "Reporting training result ... TrainingReport(...)" INFO dump that
    every report prints in a worker: its logger is named by its file's path, outside `ray.train`,
    so Train's LoggingConfig misses it. Without the internal: the lines show."""
    try:
        from ray.train.v2._internal.execution import context as train_context
    except ImportError:
        return
    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def preemption_info() -> Any:
    """Ray Train's notice that a node of this worker group is being preempted, as this worker
    holds it (Train's PreemptionWatcher sets it on every worker), or None. Read without the
    barrier that the public `ray.train.get_preemption_info()` is (every rank would have to call
    it at once; raypack's step agrees on it in its own all_gather). Without the internal: None,
    so a preempted node's run goes on from its last checkpoint rather than one saved on notice."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # another Ray version, or not in a Train worker: no notice
        return None


def local_scaling_policy(scaling_config) -> Any:
    """Ray Train's fixed-size policy without its AutoscalingCoordinator requests, for a local
    instance, which no autoscaler grows (the workers' placement group holds their resources
    either way), or None where this Ray has no such class: Train's default, a slower start."""
    policy = _local_policy_class()
    return None if policy is None else policy(scaling_config)


@functools.cache
def _local_policy_class() -> type | None:
    try:
        from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
    except ImportError:
        return None

    class LocalScalingPolicy(FixedScalingPolicy):
        def after_controller_start(self, train_run_context) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

        def _cancel_resource_request(self) -> None:
            # None was sent. Ray 2.55's cancels anyway, starting the coordinator to ask it: at a
            # stop under load its get times out and the controller prints the traceback.
            pass

    # Ray hands the policy to its Train controller pickled by reference: made on first use (so
    # importing this module imports no Train internals), and found as this module's attribute
    # (`__getattr__` below), as a class defined at the top would be.
    LocalScalingPolicy.__qualname__ = "LocalScalingPolicy"
    return LocalScalingPolicy


def __getattr__(name: str) -> Any:
    if name == "LocalScalingPolicy" and _local_policy_class() is not None:
        return _local_policy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unused_callbacks(local: bool) -> tuple[type, ...]:
    """Ray Train's default callbacks a raypack run has no use for: the datasets callback (raypack
    hands Train no dataset) and, on a local instance, the placement-group cleaner (an actor that
    outlives nothing there). Without the internals: none, Train's defaults run."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return ()
    return (DatasetsCallback, PlacementGroupCleanerCallback) if local else (DatasetsCallback,)


def take_sigint_handler(trainer, install: Callable[[], dict]) -> dict:
    """Put `install` (raypack's graceful stop) where Ray Train would put its own SIGINT handler
    while `trainer.fit` runs; returns the dict `install`'s call fills with the handlers it
    replaced. Train's handler asks the controller to abort, then calls sys.exit from inside the
    handler: status 1 and no word of what happened. Without the method (another Ray): Train's."""
    before: dict = {}
    if callable(getattr(type(trainer), "_register_sigint_handler", None)):
        trainer._register_sigint_handler = lambda controller: before.update(install())
    return before


# --- the driver: worker output, a joined cluster, a local instance ---------------------------------


def stdstream_dispatcher() -> tuple[Any, Callable] | None:
    """(Ray's dispatcher of worker output to this driver, Ray's printer function), or None
    where this Ray has neither (its printing then stays as it is)."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return None
    return dispatcher, ray_worker.print_to_stdstream


def cluster_autoscaling() -> tuple[list[tuple[str, dict[str, float], int]], bool]:
    """(node types an autoscaler may add: (name, resources, most nodes or -1), whether it may add
    nodes at all) of the cluster this process joined. Every head runs Ray's (v1) autoscaler;
    started without a cluster config it only mirrors the nodes that joined, naming each one's type
    after its node id, where a real one (launcher, KubeRay) names them after its config. What
    can't be told apart (no report yet, autoscaler v2, which reports elsewhere) is taken to grow:
    a start is never refused for nodes that may come. Without the internals: ([], True)."""
    try:
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray._private.state import state
        from ray._raylet import GCS_AUTOSCALER_STATE_NAMESPACE, GCS_AUTOSCALER_V2_ENABLED_KEY
        from ray.autoscaler._private.util import format_readonly_node_type
    except ImportError:
        return [], True
    config = state.get_cluster_config()
    types = [(g.name, dict(g.resources), g.max_count) for g in (config.node_group_configs if config else ())]
    status = json.loads(kv_get(DEBUG_AUTOSCALING_STATUS, namespace=None) or "{}").get("autoscaler_report", {})
    kinds = (status.get("node_type_mapping") or {}).items()
    mirror = all(kind == format_readonly_node_type(node) for node, kind in kinds)
    v2 = kv_get(GCS_AUTOSCALER_V2_ENABLED_KEY, namespace=GCS_AUTOSCALER_STATE_NAMESPACE) == b"1"
    return types, bool(types) or v2 or not (status and mirror)


@contextlib.contextmanager
def set_loopback_only(env_name: str):
    """While a local instance starts: Ray's module flag that it read from `env_name` when it was
    imported, read again from the environment now (the caller has set the variable), and put back
    after. Without the internal: the variable alone, which the processes Ray starts read."""
    try:
        from ray._private import ray_constants
    except ImportError:
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(env_name, False)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def own_session():
    """The processes `ray.init` starts (GCS, raylet, dashboard; the raylet's workers) in a
    session of their own, not this command's process group: a signal sent to the group
    (`timeout`, `kill -TERM -PGID`) then reaches the command, which stops the run gracefully,
    and not the instance under it, which would die mid-step. Ray does the same on Windows
    wherever the kernel ties a child's life to its parent's, as Linux does here
    (PR_SET_PDEATHSIG), so the instance still ends with this process. Without the internals (or
    without fate sharing): Ray's own launch, in this process group."""
    import sys

    try:
        from ray._private import services, utils
    except ImportError:
        yield
        return
    base = getattr(services, "ConsolePopen", None)
    if sys.platform != "linux" or base is None or not utils.detect_fate_sharing_support():
        yield
        return

    class OwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def store_stats_poller() -> Callable[[], Any] | None:
    """A function returning the raylet's object store report (bytes used, bytes spilled) each
    call, for the benchmarks that poll it; None where this Ray has no such call (they then
    report no object store figures)."""
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    except ImportError:
        return None
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return lambda: get_memory_info_reply(state).store_stats
