"""Ray's real autoscaler on a shipped launcher file's node types, with Ray's fake multi-node
provider: the CPU work and a one-node GPU config start the right node types and their placement
groups become ready (cluster/fake_autoscale.py --smoke, ~50 s on 2 busy cores). Every launcher
file with every GPU config is `python cluster/fake_autoscale.py` (~2.5 min; cluster/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    not os.environ.get("RAYPACK_FAKE_AUTOSCALER"),
    reason="opt-in (RAYPACK_FAKE_AUTOSCALER=1): in a full CI run on 2 cores its head's GCS did not come up and the "
           "script hung for 420 s; it passes run alone (~45 s), as does python cluster/fake_autoscale.py",
)
def test_fake_autoscaler_starts_the_right_node_types_for_the_smoke_case():
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "cluster" / "fake_autoscale.py"), "--smoke"],
                         capture_output=True, text=True, timeout=420, cwd=REPO)
    report = [line for line in out.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert out.returncode == 0, "\n".join(report) + out.stderr[-3000:]
    assert len(report) == 3 and all(line.startswith("ok ") for line in report), report
    assert "nodes {'cpu_m7i': 1}" in report[0]  # CPU work starts a CPU node and no GPU node
    assert "'gpu_p5': 1" in report[1]  # a one-node config, exactly one p5
    print(f"fake autoscaler smoke: {time.monotonic() - start:.0f}s")
