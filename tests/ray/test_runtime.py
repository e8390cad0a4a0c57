"""The local Ray instance raypack starts listens on 127.0.0.1 only: the GCS, the raylet, the
dashboard and its agents, and the Prometheus metrics endpoint that Ray otherwise serves on every
interface without authentication. Each probe is a process of its own, with its own Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paths import REPO

pytestmark = pytest.mark.ray

PROBE = """
import json, time, psutil, ray
from raypack.runtime import init_ray
init_ray()
time.sleep(8)  # the agents open their ports after ray.init returns
me = psutil.Process()
ours = {me.pid} | {p.pid for p in me.children(recursive=True)}
listening = [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.pid in ours]
metrics = ray._private.worker._global_node.metrics_export_port
print(json.dumps({"listening": listening, "metrics_port": metrics}))
ray.shutdown()
"""
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def probe(**env) -> dict:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_local_ray_listens_on_loopback_only():
    found = probe()
    ips = {ip for ip, _ in found["listening"]}
    assert len(found["listening"]) >= 5 and ips <= LOOPBACK, found
    assert found["metrics_port"] in {port for _, port in found["listening"]}, "the metrics endpoint was not seen"


def test_the_probe_sees_other_interfaces_when_ray_binds_them():
    """Guard the guard: with Ray's switch back on (as on a Linux cluster node), the same probe
    finds servers on all interfaces."""
    found = probe(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    assert {ip for ip, _ in found["listening"]} - LOOPBACK, found
