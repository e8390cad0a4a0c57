"""A start on a cluster raypack joined (RAY_ADDRESS, `ray job submit`): workers the cluster can
never hold stop it in seconds with one line; workers it can hold, but has no room for now, are
waited for up to `train.start_timeout_s`, saying so, then stop it with one line; workers that fit
start, and the placement group that waited for them is gone.

The cluster is a head and one worker node of 2 CPUs each (`ray.cluster_utils.Cluster`, no
autoscaler), in a subprocess: a multi-node cluster cannot share this process with the session's
local Ray instance. Node types an autoscaler may add are published to its GCS the way an
autoscaler does (`report_cluster_config`), which is what Ray Train's own check reads too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from paths import REPO

pytestmark = pytest.mark.ray

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys, time
    from pathlib import Path

    import ray
    from ray._raylet import GcsClient
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_get

    from raypack.config import load
    from raypack.runs import run_dir
    from raypack.train import placement, trainer

    out = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    # The head's autoscaler (one that only mirrors the nodes that joined) reports every 5 s; its
    # first reports may not have its summary yet (until then the cluster is taken to grow).
    while "autoscaler_report" not in json.loads(_internal_kv_get("__autoscaling_status") or "{}"):
        time.sleep(0.5)

    def cfg(*overrides):
        return load(str(Path.cwd() / "jobs/configs/tiny_cpu.yaml"),
                    [f"run.storage_path={out}", "run.name=joined", "train.start_timeout_s=3", *overrides])

    def attempt(fn, *overrides):
        t0, printed = time.perf_counter(), io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                fn(cfg(*overrides))
            error = None
        except Exception as e:
            error = {"type": type(e).__name__, "message": str(e)}
        return {"s": time.perf_counter() - t0, "error": error,
                "waiting": [l for l in printed.getvalue().splitlines() if l.startswith("[raypack] waiting")]}

    def publish(max_gpu_nodes):
        config = autoscaler_pb2.ClusterConfig()
        config.node_group_configs.append(autoscaler_pb2.NodeGroupConfig(
            name="gpu", resources={"CPU": 4, "GPU": 1}, max_count=max_gpu_nodes))
        GcsClient(address=cluster.address).report_cluster_config(config.SerializeToString())

    results = {"cpus": attempt(trainer.start, "train.cpus_per_worker=3")}
    results["cpus"]["run_dir_left"] = Path(run_dir(cfg())).exists()
    results["gpu"] = attempt(placement.check_request, "train.use_gpu=true")

    @ray.remote(num_cpus=2)
    class Hold:
        def ready(self):
            return True

    hold = Hold.remote()
    ray.get(hold.ready.remote())
    results["busy"] = attempt(placement.check_request, "train.cpus_per_worker=2")
    ray.kill(hold)
    results["fits"] = attempt(placement.check_request, "train.placement_strategy=STRICT_SPREAD")
    groups = ray.util.placement_group_table().values()
    results["probes_left"] = [pg["name"] for pg in groups if pg["state"] != "REMOVED"]

    publish(max_gpu_nodes=1)
    results["types"] = attempt(placement.check_request, "train.use_gpu=true")
    publish(max_gpu_nodes=2)
    results["scales"] = attempt(placement.check_request, "train.use_gpu=true", "train.start_timeout_s=4")
    print("RESULT", json.dumps(results))
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path_factory.mktemp("joined")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def one_line(attempt: dict, kind: str) -> str:
    assert attempt["error"] and attempt["error"]["type"] == kind, attempt
    message = attempt["error"]["message"]
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case,says", [
    ("cpus", "train.num_workers=2 workers of {CPU: 3} each (PACK) can never start on this cluster, which holds at "
             "most 0 (its nodes: 2 x {CPU: 2}; no autoscaler adds nodes); lower train.cpus_per_worker"),
    ("gpu", "workers of {CPU: 1, GPU: 1} each (PACK) can never start on this cluster, which holds at most 0 (its "
            "nodes: 2 x {CPU: 2, GPU: 0}; no autoscaler adds nodes); set train.use_gpu=false"),
    ("types", "which holds at most 1 (its nodes: 2 x {CPU: 2, GPU: 0}; node types its autoscaler may add: gpu "
              "{CPU: 4, GPU: 1} up to 1); lower train.num_workers to 1"),
])  # fmt: skip
def test_workers_the_cluster_can_never_hold_stop_the_start_in_seconds(results, case, says):
    assert says in one_line(results[case], "ConfigError")
    assert results[case]["s"] < 15 and not results[case]["waiting"], results[case]
    if case == "cpus":  # through trainer.start: before any data is prepared, and no run folder left
        assert not results[case]["run_dir_left"]


@pytest.mark.parametrize("case,limit", [("busy", 3), ("scales", 4)])
def test_workers_with_no_room_yet_are_waited_for_then_stop_the_start(results, case, limit):
    message = one_line(results[case], "InputError")
    assert message.startswith(f"train.start_timeout_s={limit}: no room for 2 workers of {{CPU: ")
    assert "raise train.start_timeout_s" in message
    assert limit <= results[case]["s"] < limit + 10, results[case]
    waiting = results[case]["waiting"]
    assert len(waiting) == 1 and "free now" in waiting[0] and "gives up in" in waiting[0], waiting
    assert ("an autoscaler may add nodes" in waiting[0]) == (case == "scales")


def test_workers_that_fit_start_and_leave_no_placement_group(results):
    assert results["fits"]["error"] is None and results["fits"]["s"] < 5, results["fits"]
    assert results["probes_left"] == []
