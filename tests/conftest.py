"""Shared fixtures. One local Ray cluster serves every test that needs Ray (ray.init costs ~8 s).

Tests live in tests/<tier>/<package>/test_<module>.py: tier `unit` (no Ray), `ray` (a local Ray
cluster; marked `ray` here) or `gpu` (marked `gpu`, skipped without CUDA). pytest imports them in
importlib mode (pyproject.toml), so two tiers can each hold a test_<module>.py, and a test module
is importable as `tests.<tier>.<package>.test_<module>`, which is how Ray workers find a loop
function that a test defines.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from paths import REPO, TESTS

# DeepSpeed JIT-builds ops on first use; keep them in one place that CI can cache.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# ray.train.report blocks until the controller's health-check poll drains it (2 s by default).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def asked_for_slow(config) -> bool:
    """`-m` names `slow` (not as `not slow`), or RAYPACK_SLOW=1. A plain `pytest tests` (the
    README's and CI's command) leaves the `slow` tests out: multi-minute runs of what a faster
    test already covers for one case."""
    expr = config.getoption("markexpr") or ""
    return bool(re.search(r"(?<!not )\bslow\b", expr)) or os.environ.get("RAYPACK_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    # Everything under tests/ray/ starts Ray: `pytest -m "not ray"` is the fast tier.
    for item in items:
        if Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0] == "ray":
            item.add_marker(pytest.mark.ray)
    if not asked_for_slow(config):
        skip_slow = pytest.mark.skip(reason="slow: run with `pytest -m slow` or RAYPACK_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny models: they are all overhead, and two threads on
    a shared 2-core host only fight (3x slower). A module asks with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank_group(monkeypatch, tmp_path):
    """A gloo process group of one, with the variables DeepSpeed's launcher would set."""
    import torch.distributed as dist

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(key, value)
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if ours:
        from benchmarks.step_syncs import destroy_process_group

        destroy_process_group()  # through DeepSpeed, which forgets the groups it cached


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance for the whole session, started the way every raypack command starts
    one (`raypack.runtime.init_ray`: loopback only, quiet Ray Data), with the tests' settings.
    Without RAY_ADDRESS it never joins a cluster that some other process (or a test using
    `ray start`) left running on this machine."""
    import ray

    from raypack.runtime import RaySettings, init_ray

    if ray.is_initialized():
        ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    # Workers unpickle test-defined functions by module name (tests.ray.<package>.test_<module>,
    # benchmarks.pack_baselines), so they need the repository root; tests/ holds the helpers.
    paths = [str(REPO), str(TESTS)]
    init_ray(RaySettings(
        num_cpus=8,  # more logical CPUs than cores: Ray Data's read tasks always find one free
        dashboard=False,  # seconds and memory saved; no test here needs Train's State API
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}},
    ))
    yield ray
    ray.shutdown()
