"""Scale-out on one box: a head and two worker nodes (`ray.cluster_utils.Cluster`), and a tiny
fine-tune whose 2 workers land on different nodes.

It runs in a subprocess: a multi-node cluster cannot share this process with the session's
local Ray instance.
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
    import functools, json, sys
    from pathlib import Path

    import ray
    from ray.cluster_utils import Cluster

    from raypack.config import load
    from raypack.train import trainer

    out = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)

    def loop(config, out):
        import ray.train
        from raypack.train.loop import train_loop_per_worker

        rank = ray.train.get_context().get_world_rank()
        (Path(out) / f"node-rank{rank}").write_text(ray.get_runtime_context().get_node_id())
        train_loop_per_worker(config)

    cfg = load(str(Path.cwd() / "jobs/configs/tiny_cpu.yaml"), [
        f"run.storage_path={out}", "run.name=multinode", "pack.budget=256", "train.max_steps=2",
        "train.placement_strategy=STRICT_SPREAD", "train.checkpoint_every_steps=0", "train.report_every_steps=1",
    ])
    trainer.worker_loop = functools.partial(loop, out=str(out))  # the workers record their node
    result = trainer.start(cfg).result
    nodes = [(out / f"node-rank{r}").read_text() for r in range(2)]
    print("RESULT", json.dumps({"step": result.metrics["step"], "nodes": nodes, "all": len(ray.nodes())}))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_two_workers_on_different_nodes(tmp_path):
    env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["all"] == 3
    assert result["step"] == 2
    assert result["nodes"][0] != result["nodes"][1], "both workers landed on one node"
