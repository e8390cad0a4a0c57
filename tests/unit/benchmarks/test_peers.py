"""benchmarks/peers.py's rows, without running them: every raypack row's config is one raypack
accepts, on the CPU (the smoke that `make gpu-rehearsal` and `make bench-smoke` run) as on CUDA,
and gpu-check's smoke runs every row the GPU runs. The rows themselves run end to end in
tests/ray/benchmarks/test_smoke.py and the rehearsal."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from paths import REPO

sys.path.insert(0, str(REPO / "tools"))
from bench_gpu import STEPS  # noqa: E402

from raypack.train.engines.deepspeed_engine import model_dtype  # noqa: E402


@pytest.fixture(scope="module")
def peers():
    # peers.py sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for its runs at import: not for this process's
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
        yield importlib.import_module("benchmarks.peers")


def peers_step():
    return next(s for s in STEPS if s.name == "peers")


def test_gpu_check_smoke_runs_every_row_the_gpu_runs(peers):
    step = peers_step()
    gpu, smoke = peers.parse_args(step.args[1:]), peers.parse_args([*step.args[1:], *step.smoke_args])
    assert gpu.configs == smoke.configs == list(peers.CONFIGS)


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_every_raypack_row_is_a_config_raypack_accepts(peers, tmp_path, cuda):
    """At HEAD before this test, raypack-bf16's smoke gave raypack `model.dtype: float32` with
    `train.precision: bf16`, which the config refuses: the rehearsal's peers step failed every time."""
    step = peers_step()
    args = peers.parse_args([*step.args[1:], *(() if cuda else step.smoke_args)])
    rows = [name for name, peer in peers.CONFIGS.items() if peer.side == "raypack"]
    assert {"raypack", "raypack-full", "raypack-bf16"} <= set(rows)
    for name in rows:
        cfg = peers.raypack_config(args, tmp_path, name, cuda)  # raises ConfigError on a refused row
        assert cfg.train.use_gpu is cuda and cfg.pack.budget == args.budget
        for override in peers.CONFIGS[name].overrides:  # the row is what it says it is
            key, value = override.split("=")
            section, field = key.split(".")
            assert str(getattr(getattr(cfg, section), field)) == value, (name, override)
        # the weights' dtype the workers use: bf16 where the row asks for bf16 precision, else model.dtype auto's
        expected = torch.bfloat16 if cuda or cfg.train.precision == "bf16" else torch.float32
        if not cuda:  # auto resolves on the machine that trains; here there is no CUDA
            assert model_dtype(cfg.train, cfg.model.dtype) == expected, name
