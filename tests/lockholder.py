"""Another process holding a run folder's lock (raypack/runlock.py) until the test lets it go."""

from __future__ import annotations

import os
import subprocess
import sys

from paths import REPO

HOLDER = """
import sys
from raypack.runlock import hold
with hold(sys.argv[1], "run 'r'", sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def holder(root: str, command: str = "train") -> subprocess.Popen:
    """A process holding `root`'s lock as raypack `command`; close its stdin to let it go."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, root, command], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "held\n"
    return proc


def let_go(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
