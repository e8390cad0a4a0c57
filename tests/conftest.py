"""Shared fixtures. One local Ray cluster serves every test that needs Ray (ray.init costs ~8 s)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "raypack" / "assets"
TEST_ASSETS = Path(__file__).parent / "assets"

# DeepSpeed JIT-builds ops on first use; keep them in one place that CI can cache.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# ray.train.report blocks until the controller's health-check poll drains it (2 s by default).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # Everything under tests/ray/ starts Ray: `pytest -m "not ray"` is the fast tier.
    for item in items:
        if "ray" in Path(str(item.fspath)).parent.parts[-1:]:
            item.add_marker(pytest.mark.ray)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance for the whole session. `address="local"` never joins a cluster that
    some other process (or a test using `ray start`) left running on this machine."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # More logical CPUs than cores: trainer workers and Ray Data actors would otherwise take every
    # CPU and leave read tasks none (the job hangs on 2 cores).
    # Workers unpickle test-defined loop functions by module name, so they need the test folders.
    paths = [str(REPO), *(str(p) for p in Path(__file__).parent.iterdir() if p.is_dir())]
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}},
    )
    yield ray
    ray.shutdown()
