"""Ray's real autoscaler on the shipped launcher files' node types, with Ray's fake multi-node
provider (cluster/fake_autoscale.py: what it checks, and how its head stays apart from any other
Ray instance on the machine, is in its docstring and cluster/README.md).

- Every run: one launcher file, aws-gpu.yaml, with the CPU work and a one-node GPU config
  (`--smoke`): the CPU work starts a CPU node and no GPU node, the config exactly one GPU node.
  10-40 s on 2 cores shared with other Ray jobs. gcp-gpu.yaml has the same shape (one CPU type,
  one 8-GPU type, at most 4 of each), so it would cost the same and show nothing more here.
- `slow`, run only when asked for (`pytest -m slow tests/ray/cluster`; tests/conftest.py skips
  `slow` tests otherwise): every launcher file with every GPU config, ~25 s each.

Each run is bounded twice: the script's own --deadline (it then ends its head and exits 3 with
what it waited for and the head's logs), and, should the script outlive that anyway, this test
ends it and its head's process group and fails with the script's output. It never hangs.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "cluster" / "fake_autoscale.py"
_spec = importlib.util.spec_from_file_location("raypack_fake_autoscale_runner", SCRIPT)
fa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fa)

SMOKE_LIMIT_S = 180  # the CI case; it takes 10-40 s
FULL_LIMIT_S = 600  # one launcher file x every GPU config; ~25 s


def heads(output: str) -> list[tuple[int, Path]]:
    """(pid, temp dir) of every head the script said it started."""
    found = re.findall(re.escape(fa.HEAD_LINE) + r"(\d+) \(process group\), temp dir (\S+)", output)
    return [(int(pid), Path(workdir)) for pid, workdir in found]


def leftovers(workdir: Path) -> list[str]:
    """Processes that still name the head's temp dir, and the dir itself if it is still there."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(workdir) in arg for arg in p.info["cmdline"] or ()):
                left.append(f"pid {p.pid}: {' '.join(p.info['cmdline'])[:200]}")
        except (psutil.Error, TypeError):
            pass
    return left + ([f"{workdir} still exists"] if workdir.exists() else [])


def run_script(args: list[str], limit: float, tmp_path: Path) -> tuple[int, str, float]:
    """Runs cluster/fake_autoscale.py with --deadline 30 s short of `limit`; past `limit`, ends
    it (SIGTERM, then SIGKILL) and whatever its heads left, and fails with its output."""
    log = tmp_path / "fake_autoscale.out"
    cmd = [sys.executable, str(SCRIPT), *args, f"--deadline={limit - 30:.0f}"]
    start = time.monotonic()
    with open(log, "w") as out:  # a file, not a pipe: nothing the script leaves behind can hold it open
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            text = log.read_text(errors="replace")
            for pid, workdir in heads(text):
                fa.end_processes(pid, workdir)
            pytest.fail(f"{' '.join(cmd[1:])} did not end within {limit:.0f}s, past its own --deadline; "
                        f"ended it and its head(s). Its output:\n{text[-6000:]}")
    took = time.monotonic() - start
    text = log.read_text(errors="replace")
    for pid, workdir in heads(text):
        left = leftovers(workdir)
        fa.end_processes(pid, workdir)  # whatever the assertion below finds, gone before the next test
        assert not left, "the script left these behind:\n" + "\n".join(left)
    return rc, text, took


def checks(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("ok ", "FAIL"))]


def test_the_autoscaler_starts_the_right_node_types_on_aws_gpu_yaml(tmp_path):
    rc, out, took = run_script(["--smoke", "--timeout=90"], SMOKE_LIMIT_S, tmp_path)
    report = checks(out)
    assert rc == 0 and len(report) == 3 and all(line.startswith("ok ") for line in report), out[-6000:]
    assert "nodes {'cpu_m7i': 1}" in report[0], report  # the CPU work: one CPU node, no GPU node
    assert re.search(r"1 GPU node\(s\) needed; nodes \{.*'gpu_p5': 1", report[1]), report  # one p5, no more
    print(f"fake autoscaler, aws-gpu.yaml smoke: {took:.0f}s ({report[-1]})")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [p.name for p in fa.LAUNCHERS])
def test_the_autoscaler_places_every_gpu_config_on_each_launcher_file(launcher, tmp_path):
    rc, out, took = run_script([f"--launcher={launcher}"], FULL_LIMIT_S, tmp_path)
    report = checks(out)
    assert rc == 0 and len(report) == 2 + len(fa.GPU_CONFIGS), out[-6000:]
    assert all(line.startswith("ok ") for line in report), "\n".join(report)
    print(f"fake autoscaler, {launcher} x {len(fa.GPU_CONFIGS)} GPU configs: {took:.0f}s ({report[-1]})")
