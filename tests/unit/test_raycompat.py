"""raypack/raycompat.py: each use of Ray's internals works on this Ray, and its fallback, with
the internal made to vanish, keeps the caller working and loses only what its docstring says."""

from __future__ import annotations

import pickle
import re
import sys

import pytest

from paths import REPO
from raypack import raycompat

PRIVATE = re.compile(r"^\s*(from|import)\s+ray\.(_private|_raylet|experimental|autoscaler\._private|train\.v2\._internal)\b"
                     r"|^\s*from\s+ray\s+import\s+_private\b", re.M)  # fmt: skip


def test_no_module_but_raycompat_imports_ray_internals():
    found = [f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}"
             for folder in ("raypack", "benchmarks", "tools", "jobs") for path in sorted((REPO / folder).rglob("*.py"))
             if path.name != "raycompat.py"
             for text in [path.read_text()] for m in PRIVATE.finditer(text)]  # fmt: skip
    assert not found, f"private Ray imports outside raypack/raycompat.py: {found}"
    assert PRIVATE.search("    from ray.experimental.internal_kv import _internal_kv_get\n")  # the check can fail


def test_this_ray_has_every_internal_raypack_uses():
    """On the Ray raypack is tested with, no fallback is taken: a move in a new Ray release shows here."""
    policy = raycompat.LocalScalingPolicy
    assert pickle.loads(pickle.dumps(policy)) is policy  # Ray hands it to the controller by reference
    assert policy.__module__ == "raypack.raycompat"
    assert len(raycompat.unused_callbacks(local=True)) == 2 and len(raycompat.unused_callbacks(local=False)) == 1
    assert raycompat.stdstream_dispatcher() is not None
    assert raycompat._kv() is not None
    import ray.train.torch

    assert callable(getattr(ray.train.torch.TorchTrainer, "_register_sigint_handler", None))
    import logging

    for name in (raycompat.TRAIN_FN_LOGGER, raycompat.CONTROLLER_LOGGER, raycompat.AUTH_LOGGER):
        assert name in sys.modules or __import__("importlib").util.find_spec(name) is not None, name
    assert logging.getLogger(raycompat.TRAIN_FN_LOGGER)


@pytest.fixture
def without_internals(monkeypatch):
    """Every Ray internal raycompat imports made to fail as a moved module would (ImportError)."""
    for name in ("ray.experimental.internal_kv", "ray.experimental", "ray._private.ray_constants", "ray._private.state",
                 "ray._private.services", "ray._private.utils", "ray._private.worker", "ray._private.ray_logging",
                 "ray._private.internal_api", "ray._raylet", "ray.autoscaler._private.util",
                 "ray.train.v2._internal.execution.context",
                 "ray.train.v2._internal.execution.scaling_policy.fixed",
                 "ray.train.v2._internal.callbacks.datasets",
                 "ray.train.v2._internal.callbacks.placement_group_callback"):
        monkeypatch.setitem(sys.modules, name, None)
    # `from ray._private import worker` finds an attribute of the package, not sys.modules
    import ray

    monkeypatch.delattr(ray, "_private", raising=False)
    raycompat._local_policy_class.cache_clear()
    yield
    raycompat._local_policy_class.cache_clear()


def test_each_fallback_keeps_the_caller_working(without_internals):
    assert raycompat.kv_put("k", "v", namespace="raypack") is False
    assert raycompat.kv_get("k", namespace="raypack") is None
    raycompat.kv_del("k", namespace="raypack")
    raycompat.quiet_report_log()
    assert raycompat.preemption_info() is None
    assert raycompat.local_scaling_policy(object()) is None
    with pytest.raises(AttributeError):
        raycompat.LocalScalingPolicy
    assert raycompat.unused_callbacks(local=True) == ()
    assert raycompat.stdstream_dispatcher() is None
    assert raycompat.cluster_autoscaling() == ([], True)  # taken to grow: no start refused
    with raycompat.own_session(), raycompat.set_loopback_only("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        pass
    assert raycompat.store_stats_poller() is None

    class Trainer:  # a Ray without the method: its own handler stays
        pass

    trainer = Trainer()
    assert raycompat.take_sigint_handler(trainer, dict) == {} and not hasattr(trainer, "_register_sigint_handler")
    from raypack.console import route_worker_output

    route_worker_output()  # Ray's printing stays as it is


def test_a_stop_without_the_store_stops_at_once(without_internals):
    """SIGTERM with no store to tell the workers through: the stop at once (the docstring's loss)."""
    import signal

    from raypack.train.stop import DriverStop, Terminated

    stop = DriverStop(grace_s=5.0)
    with pytest.raises(Terminated):
        stop._on_signal(signal.SIGTERM, None)


def test_parquet_file_size_is_a_row_count_where_ray_has_no_byte_keyword(monkeypatch):
    import ray.data

    def write_parquet(self, path, *, min_rows_per_file=None, **kwargs):  # Ray 2.55's: no min_bytes_per_file
        pass

    has_bytes = "min_bytes_per_file" in __import__("inspect").signature(ray.data.Dataset.write_parquet).parameters
    assert raycompat.parquet_min_file(1000, 30) == ({"min_bytes_per_file": 1000} if has_bytes else {"min_rows_per_file": 33})
    monkeypatch.setattr(ray.data.Dataset, "write_parquet", write_parquet)
    assert raycompat.parquet_min_file(1000, 30) == {"min_rows_per_file": 33}  # rows of 30 bytes at most: files <= 1000
    assert raycompat.parquet_min_file(10, 30) == {"min_rows_per_file": 1}


def test_a_local_instances_policy_cancels_no_request_it_never_sent(monkeypatch):
    """Ray 2.55's policy cancels its request at every stop, starting the autoscaling coordinator
    to do it (a timeout and a traceback under load); the local policy sent none."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    reached = []
    monkeypatch.setattr(FixedScalingPolicy, "_autoscaling_coordinator", property(lambda self: reached.append(self)),
                        raising=False)  # fmt: skip
    policy = raycompat.local_scaling_policy(ScalingConfig(num_workers=2))
    policy.before_controller_abort()
    __import__("asyncio").run(policy.before_controller_shutdown())
    assert reached == [], "the local policy reached for the autoscaling coordinator"


def test_ray_trains_info_lines_are_dropped_only_where_ray_cant_quiet_them():
    from raypack import console

    printed = []
    data = {"lines": ["Started training worker group of size 2: ", "- (ip=127.0.0.1, pid=8) world_rank=0, local_rank=0",
                      "a user's line", "[raypack] step 1/2"], "is_err": False}  # fmt: skip
    console._print(lambda d, ignore_prefix: printed.extend(d["lines"]), False, data, noise=console.NOISE + console.TRAIN_INFO)
    assert printed == ["a user's line"]
    printed.clear()
    console._print(lambda d, ignore_prefix: printed.extend(d["lines"]), False, data)
    assert printed == data["lines"][:3]  # NOISE alone keeps them: Ray Train's LoggingConfig quiets them at the source
