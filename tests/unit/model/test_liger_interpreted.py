"""Liger-Kernel on packed rows without a GPU: its Triton kernels run in Triton's CPU interpreter
(tests/liger_interpreted.py, in one subprocess). With Liger's RMSNorm, RoPE, SwiGLU/GeGLU on,
packed rows give each example's logits, loss and gradients run alone through the model's own
code, compiled (train.compile) or not; Liger's fused linear cross-entropy gives the chunked loss. fp32.

Skipped unless liger-kernel and triton are importable: Triton is a 1 GB install that a CPU machine
needs only for this, so it is not in the lock; `make test-liger` installs both beside .venv and runs
this file (~2 minutes on 2 cores). tests/gpu/model/test_kernels.py runs the same checks on CUDA, the
MoE families included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from families import FAMILIES

pytest.importorskip("triton")
pytest.importorskip("liger_kernel")

from liger_interpreted import COMPILED_FAMILIES, LOSS_FAMILIES, MOE_GPU_ONLY  # noqa: E402

from raypack.model import kernels  # noqa: E402

HELPER = Path(__file__).parents[2] / "liger_interpreted.py"
TOLERANCE = 1e-5  # fp32 on the CPU; what differs is the reduction order
LIGER = sorted(f for f, spec in FAMILIES.items()
               if not spec.refused and f in kernels.liger_families() and f not in MOE_GPU_ONLY)  # fmt: skip


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HELPER.parent), *sys.path])}
    done = subprocess.run([sys.executable, str(HELPER), *LIGER], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


COUNTS = ("liger_modules", "graphs", "new_graphs")


def _worst(errors: dict) -> tuple[str, float]:
    assert "error" not in errors, errors["error"]
    worst = max((k for k in errors if k not in COUNTS), key=errors.get)
    return worst, errors[worst]


@pytest.mark.parametrize("family", LIGER)
def test_liger_kernels_keep_packed_examples_apart(results, family):
    errors = results[f"kernels/{family}"]
    what, err = _worst(errors)
    assert errors["liger_modules"] > 0
    assert err < TOLERANCE, f"{family} + liger: {what} off by {err:.2e}"


@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_liger_kernels_compiled_keep_packed_examples_apart_and_do_not_recompile(results, family):
    errors = results[f"compiled/{family}"]
    what, err = _worst(errors)
    assert err < TOLERANCE, f"{family} + liger, compiled: {what} off by {err:.2e}"
    assert errors["graphs"] > 0, "nothing was compiled"
    assert errors["new_graphs"] == 0, "a new packed length recompiled"
    assert errors["graph_breaks"] == 0, "a layer's graph broke: it would run eagerly"


@pytest.mark.parametrize("family", LOSS_FAMILIES)
def test_liger_loss_is_the_chunked_loss(results, family):
    what, err = _worst(results[f"loss/{family}"])
    assert err < TOLERANCE, f"{family}: liger's {what} off by {err:.2e}"


def test_the_moe_families_left_to_the_gpu_are_still_liger_families():
    """The list above must not hide a family that Liger no longer patches, or one raypack dropped."""
    assert MOE_GPU_ONLY <= kernels.liger_families() & set(FAMILIES)
