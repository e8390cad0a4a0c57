"""Run Ray's real autoscaler on the node types of each launcher file, on this one machine.

    python cluster/fake_autoscale.py                 # every launcher file x every GPU config
    python cluster/fake_autoscale.py --smoke         # aws-gpu.yaml: the CPU ask + one 1-node config
    python cluster/fake_autoscale.py --launcher gcp-gpu.yaml --config llama8b_zero3_4node.yaml

For each launcher file (`cluster/*-gpu.yaml`) this starts a head with Ray's fake multi-node
provider (`provider: type: fake_multinode`, `RAY_FAKE_CLUSTER=1`): the autoscaler (the monitor
process of `ray start --head --autoscaling-config`) reads the file's `available_node_types`
(resources, min_workers, max_workers, the head's resources) and "launches" each node as a local
raylet that advertises the declared resources. Then, per type of work the shipped configs do:

1. CPU-only work (tokenizing, `jobs/plan.py`): `tokenize.num_actors` x `tokenize.num_cpus`
   CPUs. The autoscaler must start a CPU node type and no GPU node.
2. Each GPU config in `jobs/configs/` (ascending node count): the placement group Ray Train
   makes for it, `train.num_workers` bundles of {CPU: cpus_per_worker, GPU: 1} with
   `train.placement_strategy`. It must become ready, with exactly ceil(GPUs / GPUs per node)
   GPU nodes up.

What this shows: the declared resources, min/max workers and head resources make the autoscaler
start the right node types and that Ray can place every config on them. What it cannot show:
anything about the cloud (the fake provider ignores node_config, setup and docker commands).
`memory` is dropped from the fake nodes' resources: the fake provider hands it to
`RayParams(resources=...)`, which refuses it; tests/unit/cluster/test_launcher.py checks the
declared memory against the machine instead.

Processes: the head runs `ray start --head --block` in its own process group with its own port
and temp dir, and every fake node is its child; at the end the group is ended by its id (never
`ray stop`, which would end every Ray cluster on the machine). Prints one line per check and a
summary; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
CONFIGS = REPO / "jobs" / "configs"
sys.path.insert(0, str(REPO))

from raypack.config import load  # noqa: E402  (config only: no torch)

LAUNCHERS = sorted(CLUSTER.glob("*-gpu.yaml"))
# The shipped configs that run on the GPU clusters (the CPU ones run on local.sh / CI).
GPU_CONFIGS = ["llama8b_lora_1gpu.yaml", "llama8b_zero3_1node.yaml", "qwen7b.yaml", "sweeps/packing.yaml",
               "llama8b_zero3_2node.yaml", "llama8b_zero3_4node.yaml", "llama70b_zero3_offload.yaml"]
SMOKE = ("aws-gpu.yaml", ["llama8b_zero3_1node.yaml"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_config(launcher: dict, gcs_address: str) -> tuple[dict, dict]:
    """The launcher file's node types as a fake_multinode autoscaling config, and the head's resources."""
    types = {}
    head_type = launcher["head_node_type"]
    for name, t in launcher["available_node_types"].items():
        if name == head_type:
            continue
        resources = {k: v for k, v in t["resources"].items() if k != "memory"}
        types[name] = {"resources": resources, "node_config": {},
                       "min_workers": t.get("min_workers", 0), "max_workers": t["max_workers"]}
    head = {k: v for k, v in launcher["available_node_types"][head_type]["resources"].items() if k != "memory"}
    types["ray.head.default"] = {"resources": dict(head), "node_config": {}, "max_workers": 0}
    config = {
        "cluster_name": "fake-" + launcher["cluster_name"],
        "max_workers": launcher["max_workers"],
        "upscaling_speed": launcher.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": launcher.get("idle_timeout_minutes", 5),
        # As Ray's own fake_multi_node/example.yaml (not in the wheel): fake nodes have no SSH to
        # update and their node id is their address.
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
    return config, head


class FakeCluster:
    def __init__(self, launcher_path: Path, workdir: Path):
        self.launcher = yaml.safe_load(launcher_path.read_text())
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.workdir = workdir
        self.config, self.head = fake_config(self.launcher, self.address)
        self.proc: subprocess.Popen | None = None
        self.token = os.environ["RAY_AUTH_TOKEN"]  # main() sets it before ray is imported

    def start(self) -> None:
        cfg = self.workdir / "autoscaling.json"
        cfg.write_text(json.dumps(self.config))
        head = dict(self.head)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--port={self.port}", f"--autoscaling-config={cfg}", "--node-ip-address=127.0.0.1",
               f"--temp-dir={self.workdir / 'ray'}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={head.pop('CPU', 0)}", f"--num-gpus={head.pop('GPU', 0)}",
               f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
               f"--object-manager-port={free_port()}", "--object-store-memory=100000000"]
        if head:
            cmd.append(f"--resources={json.dumps(head)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        env.update({
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # Fake nodes advertise 192-208 CPUs on a 2-core machine: start no idle workers for them.
            "RAY_enable_worker_prestart": "0",
            "RAY_prestart_worker_first_driver": "0",
            "RAY_num_prestart_python_workers": "0",
            # Each fake node's object store: small, the machine is shared.
            "RAY_OBJECT_STORE_MEMORY": "100000000",
        })
        self.log = open(self.workdir / "head.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.workdir)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # this head's own process group, by its id
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def node_types(self) -> dict[str, int]:
        """Alive worker nodes by launcher node type (matched on the declared CPU/GPU)."""
        import ray

        counts: dict[str, int] = {}
        for n in ray.nodes():
            if not n["Alive"]:
                continue
            res = n["Resources"]
            for name, t in self.config["available_node_types"].items():
                want = t["resources"]
                if name != "ray.head.default" and all(res.get(k, 0) == want.get(k, 0) for k in ("CPU", "GPU")):
                    counts[name] = counts.get(name, 0) + 1
                    break
        return counts


def gpu_types(config: dict) -> dict[str, dict]:
    return {k: t for k, t in config["available_node_types"].items() if t["resources"].get("GPU")}


def run_launcher(path: Path, configs: list[str], timeout: float) -> list[tuple[str, bool, str]]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    results = []
    tmp = tempfile.mkdtemp(prefix="rpfake-", dir="/tmp")  # kept when a check fails: head.log, ray/
    cluster = FakeCluster(path, Path(tmp))
    t0 = time.monotonic()
    try:
        cluster.start()
        deadline = time.monotonic() + 240
        while True:
            try:
                ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
                break
            except Exception:
                if time.monotonic() > deadline or cluster.proc.poll() is not None:
                    raise RuntimeError(f"head did not start: see {cluster.workdir / 'head.log'}")
                time.sleep(1)
        gtypes = gpu_types(cluster.config)
        per_node = max(t["resources"]["GPU"] for t in gtypes.values())

        # 1. CPU-only work: the tokenizer actors of the largest config. A CPU type, no GPU node.
        cfgs = {name: load(CONFIGS / name) for name in configs}
        tok = max(cfgs.values(), key=lambda c: c.tokenize.num_actors * c.tokenize.num_cpus).tokenize
        pg = placement_group([{"CPU": tok.num_cpus}] * tok.num_actors, strategy="SPREAD")
        ok = pg.wait(timeout)
        up = cluster.node_types()
        started_gpu = sum(up.get(k, 0) for k in gtypes)
        good = ok and started_gpu == 0 and sum(up.values()) > 0
        results.append((f"{path.name}: CPU work ({tok.num_actors} x {tok.num_cpus} CPU)", good, f"nodes {up}"))
        remove_placement_group(pg)

        # 2. Each GPU config's Train placement group, smallest first.
        order = sorted(configs, key=lambda n: cfgs[n].train.num_workers)
        for name in order:
            t = cfgs[name].train
            bundles = [{"CPU": t.cpus_per_worker, "GPU": 1}] * t.num_workers
            nodes_needed = math.ceil(t.num_workers / per_node)
            start = time.monotonic()
            pg = placement_group(bundles, strategy=t.placement_strategy)
            ok = pg.wait(timeout)
            up = cluster.node_types()
            gpu_up = sum(up.get(k, 0) for k in gtypes)
            # Asks come smallest first and idle nodes stay up (idle timeout), so exactly the nodes
            # this config needs are up: none short, none extra.
            good = ok and gpu_up == nodes_needed
            results.append((f"{path.name}: {name} ({t.num_workers} x {{CPU: {t.cpus_per_worker}, GPU: 1}}, "
                            f"{t.placement_strategy})", good,
                            f"ready={ok} in {time.monotonic() - start:.1f}s; {nodes_needed} GPU node(s) needed; nodes {up}"))
            remove_placement_group(pg)
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.stop()
    results.append((f"{path.name}: total", all(r[1] for r in results), f"{time.monotonic() - t0:.1f}s"))
    if all(r[1] for r in results):
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one launcher file, the CPU ask and one 1-node config")
    ap.add_argument("--launcher", action="append", help="launcher file name(s) in cluster/ (default: all)")
    ap.add_argument("--config", action="append", help="config(s) under jobs/configs/ (default: every GPU config)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for each placement group")
    args = ap.parse_args(argv)
    # Token auth as on the real clusters, with a token made for this run only, set before Ray is
    # imported (Ray reads it once per process). The fake nodes inherit it from the head.
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.pop("RAY_ADDRESS", None)
    if args.smoke:
        launchers, configs = [CLUSTER / SMOKE[0]], SMOKE[1]
    else:
        launchers = [CLUSTER / n for n in args.launcher] if args.launcher else LAUNCHERS
        configs = args.config or GPU_CONFIGS
    failed = False
    for path in launchers:
        for what, good, detail in run_launcher(path, configs, args.timeout):
            print(f"{'ok  ' if good else 'FAIL'} {what}: {detail}", flush=True)
            failed |= not good
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
