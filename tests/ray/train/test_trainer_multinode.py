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
from pathlib import Path
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


ELASTIC = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path

    import ray
    import ray.train
    from ray.cluster_utils import Cluster

    from raypack.config import load
    from raypack.train import trainer

    out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
    # The head can't hold a worker of 2 CPUs; each worker node holds one
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2}})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)

    class LoseANode(ray.train.UserCallback):
        # At the first checkpoint Ray Train registers, in its controller: asks the driver to remove
        # a node and waits until it has, so the workers stop at their next report (Ray Train's
        # result queue holds one); a later fit's copy does nothing.
        def after_report(self, run_context, metrics, checkpoint):
            if checkpoint is None or (out / "lose").exists():
                return
            (out / "lose").write_text(str(metrics[0]["step"]))
            while not (out / "lost").exists():
                time.sleep(0.1)

    def lose():
        while not (out / "lose").exists():
            time.sleep(0.1)
        cluster.remove_node(nodes[1], allow_graceful=False)
        while sum(n["Alive"] for n in ray.nodes()) > 2:
            time.sleep(0.1)
        # Ray Train's elastic policy counts the nodes its AutoscalingCoordinator saw at its last
        # tick (every 20 s): one now, not a worker-group start that waits for a node gone
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
        ray.get(get_or_create_autoscaling_coordinator().get_reserved_resources.remote("test", recompute=True))
        (out / "lost").write_text("")

    threading.Thread(target=lose, daemon=True).start()
    cfg = load(str(Path.cwd() / "jobs/configs/tiny_cpu.yaml"), overrides)
    t0 = time.perf_counter()
    outcome = trainer.start(cfg, callbacks=[LoseANode()])
    seconds = time.perf_counter() - t0
    from trained import planned_label_tokens, planned_train_ids  # on this cluster: no Ray start in the test

    print("RESULT", json.dumps({"metrics": outcome.metrics, "checkpoint": outcome.checkpoint, "s": seconds,
                                "lost_at": int((out / "lose").read_text()), "planned_ids": planned_train_ids(cfg),
                                "planned_labels": planned_label_tokens(cfg)}))
    ray.shutdown()
    cluster.shutdown()
    """
)


ELASTIC_ENGINES = {"torch": ["train.engine=torch", "train.zero_stage=0"],
                   # DeepSpeed's ZeRO state through its universal checkpoint (bf16 weights: the dtype
                   # raypack converts), with LoRA: the frozen base left out of the checkpoint
                   "deepspeed-lora": ["train.engine=deepspeed", "train.zero_stage=2", "model.dtype=bfloat16",
                                      "model.peft.method=lora"]}


@pytest.mark.slow  # 181-347 s on 2 cores shared at load 15; two fits, a lost node and the rest planned between
@pytest.mark.parametrize("engine", list(ELASTIC_ENGINES))
def test_an_elastic_run_loses_a_node_and_trains_on_on_one_worker_every_example_once(tmp_path, engine):
    """`train.num_workers: [1, 2]` on either engine (the torch engine's DDP; DeepSpeed's ZeRO-2
    with LoRA), on a head and two worker nodes of one
    worker each: after the first checkpoint (step 2) a node is removed; Ray Train restarts the
    group on the one worker the cluster still holds, raypack says so in one line, plans the rest
    of the epoch for it (train.grad_accum 2 -> 4: a step still trains 4 packs) and trains it from
    that checkpoint. The epoch trains every example once, its trained totals are the data's (what
    an uninterrupted run trains), every step is in the final model's step logs once, and the
    trackers' `workers` curve steps from 2 to 1."""
    from trackfiles import tensorboard_events
    from trained import trained_ids

    data = tmp_path / "chat.jsonl"  # the sample's first 80 conversations: ~10 steps on 2 workers
    data.write_text("".join((REPO / "raypack/assets/sample/chat.jsonl").read_text().splitlines(keepends=True)[:80]))
    overrides = [f"run.storage_path={tmp_path / 'results'}", "run.name=elastic", "pack.budget=256", f"data.paths=['{data}']",
                 *ELASTIC_ENGINES[engine], "train.num_workers=[1, 2]", "train.cpus_per_worker=2",
                 "train.checkpoint_every_steps=2", "train.report_every_steps=1"]
    env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", ELASTIC, str(tmp_path), json.dumps(overrides)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    lost = result["lost_at"]
    said = [line for line in proc.stdout.splitlines() if line.startswith("[raypack] the cluster holds")]
    assert said == [f"[raypack] the cluster holds 1 worker now, not 2 (train.num_workers=[1, 2]): going on from step "
                    f"{lost}'s checkpoint; train.grad_accum 2 -> 4, so an optimizer step still trains 4 packs; the "
                    "rest of epoch 1 is planned again for them"], proc.stdout[-3000:]

    ids, steps = trained_ids(Path(result["checkpoint"]))
    last = result["metrics"]["step"]
    assert sorted(set(s for rank in steps for s in rank)) == list(range(1, last + 1)), steps
    assert len(ids) == len(set(ids)) and sorted(ids) == result["planned_ids"], "an example trained twice or never"
    labels = result["planned_labels"]
    assert result["metrics"]["trained"] == {"examples": len(ids), "label_tokens": labels,
                                            "epochs": [{"examples": len(ids), "label_tokens": labels}]}
    workers = {step: value for tag, step, value in tensorboard_events(tmp_path / "results" / "elastic" / "tensorboard")
               if tag == "train/workers"}
    # The steps the lost group logged last may not have reached the event file before it was killed
    assert {v for s, v in workers.items() if s <= lost} == {2}, workers
    assert {s: workers.get(s) for s in range(lost + 1, last + 1)} == dict.fromkeys(range(lost + 1, last + 1), 1), workers
