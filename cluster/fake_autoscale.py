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

Isolation, so that it runs beside any other Ray instance on the machine (a test session's local
instance, another user's cluster): the head runs `ray start --head --block` in its own session and
process group, with its own temp dir (/tmp/rpfake-*), its own token, an environment without the
caller's RAY_* variables, a GCS and Ray client port that nothing listens on (picked once each,
distinct, below the kernel's ephemeral range: see `pick_ports`; the autoscaler's and dashboard's
metrics ports likewise), and every other port chosen by the component that binds it (0), never a
default (6379, 10001, 52365, 44217...) that another instance may hold. Every fake node is its child.

Every wait is bounded and names what it waited for: the head's GCS must listen within
HEAD_START_S, the driver must connect within CONNECT_S, each placement group must be ready within
--timeout, and a watchdog ends the run (exit code 3) when a phase or the whole run (--deadline)
overruns, e.g. inside Ray's own connection retries. A failure prints the tail of the head's log
and of Ray's error logs. At the end, however it ends (a failed check, Ctrl-C, SIGTERM, the
watchdog), the head's process group is ended by its id, then any process still naming the temp
dir, then the temp dir is removed (--keep keeps it); never `ray stop`, which would end every Ray
cluster on the machine. Prints one line per check and a summary; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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

# Bounds, in seconds, on the waits that have no timeout of their own. On 2 busy cores the head's
# GCS listens within ~0.5-3 s of `ray start` and the driver connects ~2-15 s later (it waits for
# the head's raylet and agents).
HEAD_START_S = 90  # `ray start --head` until its GCS listens
CONNECT_S = 60  # ray.init, once the GCS listens
SHUTDOWN_S = 30  # ray.shutdown
EXIT_TIMED_OUT = 3
HEAD_LINE = "head: pid "  # "head: pid <pid> (process group), temp dir <dir>": what a caller must end


class Failed(RuntimeError):
    """A wait ran out, a port was taken or the head died; the message names what was awaited."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface: the GCS listens on all of them
        except OSError:
            return False
    return True


def pick_ports(n: int, low: int = 20000) -> list[int]:
    """`n` distinct ports that nothing listens on now, below the kernel's ephemeral range.

    Not `bind(("", 0))` once per port: two such calls in a row can answer the same port (the
    kernel picks at random in the ephemeral range and a port closed a moment ago is free again;
    ~1 run in 1,500 here). A CI run got 42133 for both the raylet and the Ray client server,
    `ray start` refused to start, and the driver then retried the missing GCS until the test's
    420 s limit. A port from the ephemeral range can also be taken, between the pick and
    `ray start`'s bind (seconds on a loaded machine), by any outgoing connection or by a Ray
    component's own random port (Ray draws those from the ephemeral range too). Between Ray's
    worker ports (10002-19999) and the ephemeral range neither happens."""
    high = _ephemeral_range()[0]
    chosen: list[int] = []
    for _ in range(1000):
        if high - low >= 1000:
            port = random.randrange(low, high)
        else:  # an unusual kernel setting leaves no room below: the kernel's picks, distinct at least
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        if port not in chosen and _bindable(port):
            chosen.append(port)
            if len(chosen) == n:
                return chosen
    raise Failed(f"found no {n} free ports in {low}-{high - 1}")


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _errors(path: Path, lines: int) -> str:
    """The last error lines of a Ray log: its E/C/F lines (glog and Ray's Python format), or, for
    a process's stderr (.err), its last lines when it has none; no stack frames."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    text = [t for t in text if t.strip() and not t.startswith(("/", "***", "    ", "  File"))]
    errors = [t for t in text if re.match(r"^([EF]\d{4} |\[.*? [ECF] \d+ \d+\]|\S+ \S+\s+(ERROR|CRITICAL) )", t)]
    return "\n".join((errors or (text if path.suffix == ".err" else []))[-lines:])


def _listener(port: int) -> tuple[int | None, int | None] | None:
    """(pid, process group) of what listens on TCP `port`, (None, None) when psutil cannot say
    who but something answers, None when nothing listens."""
    try:
        import psutil

        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                try:
                    return c.pid, os.getpgid(c.pid) if c.pid else None
                except ProcessLookupError:
                    return c.pid, None
        return None
    except Exception:  # no psutil, or not allowed to list sockets: does anything answer?
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return None, None
        except OSError:
            return None


def _group_is_ours(pgid: int, workdir: Path) -> bool:
    """Whether process group `pgid` is the head's of `workdir`: its leader (the head, whose
    command line names the temp dir) is alive and names it, or is gone, in which case the kernel
    gives no new process that id while any member of the old group lives. Guards a caller that
    only knows the printed pid against a pid the kernel has since given to someone else."""
    try:
        import psutil

        return any(str(workdir) in arg for arg in psutil.Process(pgid).cmdline())
    except ImportError:
        return True
    except Exception:  # gone (or a zombie): only our group can still carry that id
        return True


def end_processes(pgid: int | None, workdir: Path, keep: bool = False) -> list[int]:
    """End what a run started: the head's process group (by its id), then any process whose
    command line names `workdir` (a Ray process that left the group), then `workdir` itself
    unless `keep`. Returns the pids that were still alive after the group was ended. Safe to call
    twice, and from a caller that only knows what the run printed on its HEAD_LINE."""
    if pgid is not None and _group_is_ours(pgid, workdir):
        # SIGKILL at once: on SIGTERM `ray start --block` drains the node for up to 30 s first,
        # which a throwaway cluster does not need.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-pgid, os.WNOHANG)[0]:  # reap the head, our child
                    pass
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
    stragglers = []
    try:
        import psutil
    except ImportError:  # Ray depends on psutil; without it the group above is all we end
        psutil = None
    if psutil is not None:
        mark = str(workdir)
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if p.pid != os.getpid() and any(mark in arg for arg in p.info["cmdline"] or ()):
                    stragglers.append(p)
        for p in stragglers:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(stragglers, timeout=5)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return [p.pid for p in stragglers]


class FakeCluster:
    def __init__(self, launcher_path: Path, workdir: Path, keep: bool = False):
        self.name = launcher_path.name
        self.launcher = yaml.safe_load(launcher_path.read_text())
        self.port, self.client_port, self.autoscaler_metrics_port, self.dashboard_metrics_port = pick_ports(4)
        self.address = f"127.0.0.1:{self.port}"
        self.workdir = workdir
        self.keep = keep
        self.config, self.head = fake_config(self.launcher, self.address)
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.token = os.environ["RAY_AUTH_TOKEN"]  # main() sets it before ray is imported
        self._stop_lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        cfg = self.workdir / "autoscaling.json"
        cfg.write_text(json.dumps(self.config))
        head = dict(self.head)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--port={self.port}", f"--ray-client-server-port={self.client_port}",
               f"--autoscaling-config={cfg}", "--node-ip-address=127.0.0.1",
               f"--temp-dir={self.workdir / 'ray'}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={head.pop('CPU', 0)}", f"--num-gpus={head.pop('GPU', 0)}",
               # Every other port: picked by whatever binds it, never a default another instance holds.
               "--node-manager-port=0", "--object-manager-port=0", "--dashboard-agent-listen-port=0",
               "--min-worker-port=0", "--max-worker-port=0", "--include-log-monitor=false",
               "--object-store-memory=100000000"]
        if head:
            cmd.append(f"--resources={json.dumps(head)}")
        # None of the caller's Ray settings (RAY_ADDRESS, a test session's RAY_* switches, a Ray
        # worker's RAY_RAYLET_PID...): this head and its fake nodes are a cluster of their own.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # The autoscaler's and the dashboard's metrics servers, whose defaults (44217, 44227)
            # another Ray instance on the machine may hold (then they only log an error).
            "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics_port),
            "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics_port),
            # Fake nodes advertise 192-208 CPUs on a 2-core machine: start no idle workers for them.
            "RAY_enable_worker_prestart": "0",
            "RAY_prestart_worker_first_driver": "0",
            "RAY_num_prestart_python_workers": "0",
            # Each fake node's object store: small, the machine is shared.
            "RAY_OBJECT_STORE_MEMORY": "100000000",
        })
        self.log = open(self.workdir / "head.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir)
        print(f"{HEAD_LINE}{self.proc.pid} (process group), temp dir {self.workdir}", flush=True)

    def wait_for_gcs(self, timeout: float) -> None:
        """Until the head's GCS listens on its port; fails at once if `ray start` exits or the
        port's listener is some other process."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise Failed(f"`ray start --head` exited with code {rc} before its GCS listened on {self.address}")
            owner = _listener(self.port)
            if owner is not None:
                pid, pgid = owner
                if pgid in (None, self.proc.pid):  # ours (None: psutil cannot tell; the driver's connect will)
                    return
                raise Failed(f"port {self.port}, picked for the head's GCS, was taken by pid {pid} before the GCS bound it")
            if time.monotonic() > deadline:
                raise Failed(f"the head's GCS did not listen on {self.address} within {timeout:.0f}s")
            time.sleep(0.25)

    def report(self) -> str:
        """The tail of the head's log and the last error lines of Ray's logs, for a failure message."""
        head = re.sub(r"\x1b\[[0-9;]*m", "", _tail(self.workdir / "head.log", 200)).splitlines()
        head = [t for t in head if not re.search(r"\tINFO (scripts|cli_output_helpers)\.py:\d+ -- ", t)]
        parts = [f"--- {self.workdir / 'head.log'} (last lines)\n" + "\n".join(head[-30:])]
        logs = self.workdir / "ray" / "session_latest" / "logs"
        for name in ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out", "monitor.err", "monitor.log"):
            text = _errors(logs / name, 8)
            if text:
                parts.append(f"--- {name} (last error lines)\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """End the head's processes and remove the temp dir, once; a second caller (the watchdog,
        --deadline) waits for the first to finish."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            left = end_processes(self.proc.pid if self.proc else None, self.workdir, keep=self.keep)
            if left:
                print(f"note: ended {len(left)} process(es) outside the head's group that named {self.workdir}: {left}",
                      flush=True)
            if self.log:
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


class Watchdog(threading.Thread):
    """Bounds the waits that have no timeout of their own, and notices a head that died. ray.init
    and ray.shutdown retry a missing GCS inside Ray's C++ client (20 tries of ~40 s each), where
    no Python exception or signal handler runs; so when a phase overruns, or the head exits
    during one, this thread prints what was awaited and the head's logs, ends the head's
    processes, removes the temp dir and exits the process (EXIT_TIMED_OUT)."""

    def __init__(self, cluster: FakeCluster):
        super().__init__(daemon=True, name="fake-autoscale-watchdog")
        self.cluster = cluster
        self._lock = threading.Lock()
        self._phase: tuple[str, float, float, bool] | None = None  # what, seconds, deadline, watch the head
        self._done = threading.Event()

    @contextlib.contextmanager
    def phase(self, what: str, seconds: float, watch_head: bool = True):
        with self._lock:
            self._phase = (what, seconds, time.monotonic() + seconds, watch_head)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def close(self) -> None:
        self._done.set()

    def run(self) -> None:
        while not self._done.wait(0.5):
            with self._lock:
                phase = self._phase
            if phase is None:
                continue
            what, seconds, deadline, watch_head = phase
            proc = self.cluster.proc
            rc = proc.poll() if proc is not None and watch_head else None
            if rc is not None:
                self.fail(f"the head (`ray start --head`) exited with code {rc} while {what}")
            elif time.monotonic() > deadline:
                self.fail(f"timed out after {seconds:.0f}s {what}")

    def fail(self, message: str) -> None:
        with self._lock:
            phase = self._phase
        if phase and phase[0] not in message:
            message += f", while {phase[0]}"
        print(f"FAIL {self.cluster.name}: {message}\n{self.cluster.report()}", flush=True)
        self.cluster.stop()
        os._exit(EXIT_TIMED_OUT)


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


RUNNING: list[Watchdog] = []
"""The watchdog of the cluster up now, for --deadline."""


def gpu_types(config: dict) -> dict[str, dict]:
    return {k: t for k, t in config["available_node_types"].items() if t["resources"].get("GPU")}


def run_launcher(path: Path, configs: list[str], timeout: float, keep: bool = False) -> list[tuple[str, bool, str]]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    results: list[tuple[str, bool, str]] = []
    # /tmp, not $TMPDIR: Ray's socket paths under it must stay short.
    workdir = Path(tempfile.mkdtemp(prefix="rpfake-", dir="/tmp"))
    try:
        cluster = FakeCluster(path, workdir, keep=keep)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    dog = Watchdog(cluster)
    RUNNING[:] = [dog]
    dog.start()
    t0 = time.monotonic()
    phases = {}
    try:
        # wait_for_gcs watches the head itself, and says why it stopped waiting.
        with dog.phase(f"waiting for the head's GCS on {cluster.address}", HEAD_START_S + 15, watch_head=False):
            cluster.start()
            cluster.wait_for_gcs(HEAD_START_S)
        phases["head"] = time.monotonic() - t0
        with dog.phase(f"connecting the driver to the head at {cluster.address} (ray.init)", CONNECT_S):
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        phases["connect"] = time.monotonic() - t0 - phases["head"]
        gtypes = gpu_types(cluster.config)
        per_node = max(t["resources"]["GPU"] for t in gtypes.values())

        # 1. CPU-only work: the tokenizer actors of the largest config. A CPU type, no GPU node.
        cfgs = {name: load(CONFIGS / name) for name in configs}
        tok = max(cfgs.values(), key=lambda c: c.tokenize.num_actors * c.tokenize.num_cpus).tokenize
        what = f"CPU work ({tok.num_actors} x {tok.num_cpus} CPU)"
        start = time.monotonic()
        with dog.phase(f"waiting for the placement group of the {what}", timeout + 60):
            pg = placement_group([{"CPU": tok.num_cpus}] * tok.num_actors, strategy="SPREAD")
            ok = pg.wait(timeout)
            up = cluster.node_types()
            remove_placement_group(pg)
        started_gpu = sum(up.get(k, 0) for k in gtypes)
        good = ok and started_gpu == 0 and sum(up.values()) > 0
        record(results, f"{path.name}: {what}", good, f"ready={ok} in {time.monotonic() - start:.1f}s; nodes {up}")

        # 2. Each GPU config's Train placement group, smallest first.
        order = sorted(configs, key=lambda n: cfgs[n].train.num_workers)
        for name in order:
            t = cfgs[name].train
            bundles = [{"CPU": t.cpus_per_worker, "GPU": 1}] * t.num_workers
            nodes_needed = math.ceil(t.num_workers / per_node)
            what = f"{name} ({t.num_workers} x {{CPU: {t.cpus_per_worker}, GPU: 1}}, {t.placement_strategy})"
            start = time.monotonic()
            with dog.phase(f"waiting for the placement group of {what}", timeout + 60):
                pg = placement_group(bundles, strategy=t.placement_strategy)
                ok = pg.wait(timeout)
                up = cluster.node_types()
                remove_placement_group(pg)
            gpu_up = sum(up.get(k, 0) for k in gtypes)
            # Asks come smallest first and idle nodes stay up (idle timeout), so exactly the nodes
            # this config needs are up: none short, none extra.
            good = ok and gpu_up == nodes_needed
            record(results, f"{path.name}: {what}", good,
                   f"ready={ok} in {time.monotonic() - start:.1f}s; {nodes_needed} GPU node(s) needed; nodes {up}")
    except Failed as e:
        record(results, f"{path.name}: {e}", False, "the head's logs follow")
    finally:
        try:
            if not all(r[1] for r in results):
                print(cluster.report(), flush=True)  # before stop() removes the logs
            with dog.phase("disconnecting the driver (ray.shutdown)", SHUTDOWN_S):
                ray.shutdown()
        finally:
            stopping = time.monotonic()
            cluster.stop()
            dog.close()
            RUNNING.clear()
            phases["stop"] = time.monotonic() - stopping
    took = ", ".join(f"{k} {v:.1f}s" for k, v in phases.items())
    record(results, f"{path.name}: total", all(r[1] for r in results), f"{time.monotonic() - t0:.1f}s ({took})")
    return results


def record(results: list[tuple[str, bool, str]], what: str, good: bool, detail: str) -> None:
    """One check's line, printed as soon as it is known (a run cut short still shows its progress)."""
    results.append((what, good, detail))
    print(f"{'ok  ' if good else 'FAIL'} {what}: {detail}", flush=True)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_launcher's cleanup, like Ctrl-C


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one launcher file, the CPU ask and one 1-node config")
    ap.add_argument("--launcher", action="append", help="launcher file name(s) in cluster/ (default: all)")
    ap.add_argument("--config", action="append", help="config(s) under jobs/configs/ (default: every GPU config)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for each placement group")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole run; past it, end everything and exit 3 (default: none)")
    ap.add_argument("--keep", action="store_true", help="keep each head's temp dir (/tmp/rpfake-*: head.log, ray/)")
    args = ap.parse_args(argv)
    # Token auth as on the real clusters, with a token made for this run only, set before Ray is
    # imported (Ray reads it once per process). The fake nodes inherit it from the head. None of
    # the caller's other Ray settings: this driver joins the fake cluster only.
    for key in [k for k in os.environ if k.startswith("RAY_")]:
        del os.environ[key]
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if args.smoke:
        launchers, configs = [CLUSTER / SMOKE[0]], SMOKE[1]
    else:
        launchers = [CLUSTER / n for n in args.launcher] if args.launcher else LAUNCHERS
        configs = args.config or GPU_CONFIGS
    if args.deadline:
        # The last resort (each phase's own bound normally fires first): ends the cluster that is
        # up, through its watchdog, and exits.
        def overrun():
            for dog in RUNNING[:1]:
                dog.fail(f"timed out after {args.deadline:.0f}s: the whole run (--deadline)")
            print(f"FAIL timed out after {args.deadline:.0f}s: the whole run (--deadline)", flush=True)
            os._exit(EXIT_TIMED_OUT)

        timer = threading.Timer(args.deadline, overrun)
        timer.daemon = True
        timer.start()
    failed = False
    for path in launchers:
        failed |= not all(good for _, good, _ in run_launcher(path, configs, args.timeout, keep=args.keep))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
