"""Data preparation spread over the nodes of a Ray cluster: a head and two worker nodes on this
machine (`ray.cluster_utils.Cluster`), each node with its own temporary folder, the packed rows
in one shared folder (what `run.storage_path` is on a real cluster).

- The tokenize, routing and finishing work runs on more than one node, and every rank's packed
  files are the same, byte for byte, as a one-node run's.
- A worker node removed in the middle of the pack stage (while a finishing task runs on it): the
  run finishes with the same rows (Ray retries the task and rebuilds the pieces lost with the
  node from the tokenized files), or fails with an error, leaving no committed cache entry.

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
    import hashlib, json, sys, threading, time, uuid
    from pathlib import Path

    import ray
    from ray.cluster_utils import Cluster

    from raypack.config import load
    from raypack.data import pack, tokenize
    from raypack.data.cache import packed_root
    from raypack.data.listing import Sources
    from raypack.data.prepare import prepare
    from raypack.data.synthetic import make_examples

    work = Path(sys.argv[1])
    shared, marks = work / "shared", work / "marks"
    marks.mkdir(parents=True)
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\\n" for r in make_examples("chat", 1500, seed=3, kind="flan", max_length=200)))
    tokenize.TOKENIZED_FILE_BYTES = 1  # a file per tokenized block: several routing tasks to spread
    VICTIM = {"node": None}

    def traced(fn, kind):
        def run(*args, **kwargs):
            node = ray.get_runtime_context().get_node_id()
            (marks / f"{kind}-{uuid.uuid4().hex}").write_text(node)
            if kind == "finish" and node == VICTIM["node"]:
                (marks / "victim-busy").write_text(node)
                time.sleep(5)  # the node is removed meanwhile
            return fn(*args, **kwargs)
        return run

    pack.route_file = traced(pack.route_file, "route")
    pack._finish_and_count = traced(pack._finish_and_count, "finish")

    def config(cache=None):
        return load(None, [f"data.paths=['{data}']", "pack.budget=256", "train.num_workers=4",
                           "tokenize.batch_size=32", "tokenize.num_actors=2", "data.eval_fraction=0.1",
                           "data.driver_max_mb=0"]  # Ray's tasks, spread over the nodes, however small
                    + ([f"data.cache_path={cache}"] if cache else []))

    def files(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(Path(root).rglob("*.parquet")) if "/tokenized/" not in str(p)}

    def nodes(kind):
        return sorted({p.read_text() for p in marks.glob(f"{kind}-*")})

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "env_vars": {"TMPDIR": str(work / "tmp-head")}})
    workers = [cluster.add_node(num_cpus=2, env_vars={"TMPDIR": str(work / f"tmp-{i}")}) for i in range(2)]
    for i in ("head", 0, 1):
        (work / f"tmp-{i}").mkdir()
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    sources = Sources.of([str(data)])
    multi = prepare(config(), 4, str(shared / "multi"), sources)
    result = {"route_nodes": len(nodes("route")), "finish_nodes": len(nodes("finish")),
              "all_nodes": len(set(nodes("route")) | set(nodes("finish"))), "steps": multi.steps_per_rank}

    # The same prepare again, into a cache entry, losing a worker node while it finishes a rank.
    VICTIM["node"] = workers[1].node_id
    def kill():
        while not (marks / "victim-busy").exists():
            time.sleep(0.05)
        cluster.remove_node(workers[1])
    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    cache = shared / "cache"
    try:
        cfg = config(cache)
        killed = prepare(cfg, 4, packed_root(cfg, 4, ""), sources)
        result["killed"] = {"ok": True, "data": str(Path(killed.train_dir).parent)}  # the entry's own folder
    except Exception as e:
        result["killed"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    result["victim_was_busy"] = (marks / "victim-busy").exists()
    killer.join(timeout=30)
    result["nodes_after"] = sum(n["Alive"] for n in ray.nodes())
    committed = [p.parent for p in (cache / "packed").rglob("manifest.json")] if (cache / "packed").exists() else []
    ray.shutdown()
    cluster.shutdown()

    ray.init(num_cpus=4)  # one node: the reference rows
    single = prepare(config(), 4, str(work / "single"), sources)
    reference = files(work / "single")
    result["same_multi"] = files(shared / "multi") == reference and multi.steps_per_rank == single.steps_per_rank
    result["reference_files"] = len(reference)
    if result["killed"]["ok"]:
        got = files(result["killed"]["data"])
        result["same_killed"] = got == reference
        result["killed_diff"] = sorted(k for k in set(got) | set(reference) if got.get(k) != reference.get(k))[:6]
    result["committed_entries"] = len(committed)
    result["stray_tmp"] = sorted(str(p.relative_to(work)) for i in ("head", 0, 1) for p in (work / f"tmp-{i}").rglob("*.parquet"))
    ray.shutdown()
    print("RESULT", json.dumps(result))
    """
)


@pytest.mark.slow  # 100 s on 2 cores: three Ray nodes and three preparations; test_prepare.py prepares on Ray
def test_prepare_spreads_over_nodes_and_survives_a_lost_node(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["reference_files"] > 4  # every rank's train and eval files
    assert result["all_nodes"] > 1, result  # routing and finishing ran on more than one node
    assert result["same_multi"], result  # byte for byte, every rank's files
    assert result["stray_tmp"] == [], result  # nothing written to a node's own temporary folder
    # The lost node: it was running a rank's finishing task when it went.
    assert result["victim_was_busy"] and result["nodes_after"] == 2, result
    if result["killed"]["ok"]:
        assert result["same_killed"] and result["committed_entries"] == 1, {k: result[k] for k in (
            "same_killed", "killed_diff", "committed_entries", "reference_files")}
    else:  # a clear failure leaves no committed entry behind
        assert result["committed_entries"] == 0, result
