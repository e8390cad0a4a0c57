"""Start-up (issue 35 part 6): the phases before the first step, from the driver's and a worker's
marks, and DeepSpeed's shared-memory all-reduce left unbuilt."""

from __future__ import annotations

import time

import pytest

from raypack.train.startup import TOTAL, Startup, describe, process_start


def test_phases_run_between_their_marks_and_the_total_from_the_process_start():
    marks = {"process": 100.0, "start": 103.0, "preflight": 104.0, "ray": 110.0, "prepare": 110.0, "data": 130.0,
             "fit": 130.5, "worker": 150.0, "imports": 158.0, "received": 158.0, "model": 159.0,
             "deepspeed": 163.0, "setup": 164.0, "first_step": 166.0}
    phases = Startup(marks).phases()
    assert list(phases) == ["python and imports", "preflight", "Ray start", "data preparation", "worker group",
                            "worker imports", "waiting for data", "model load", "DeepSpeed init", "worker setup",
                            "first step", TOTAL]
    assert phases["data preparation"] == 20.0 and phases["worker group"] == 19.5 and phases[TOTAL] == 66.0
    assert describe(phases).startswith("66.0 s to the first step: python and imports 3.0, preflight 1.0,")
    # a worker that has no driver marks (a test's loop) reports what it has, and no total
    assert Startup({"deepspeed": 1.0, "setup": 3.0}).phases() == {"worker setup": 2.0}
    with pytest.raises(ValueError, match="unknown start-up mark 'tokenize'"):
        Startup().mark("tokenize")


def test_the_process_start_is_before_now():
    started = process_start()
    assert started is not None and time.time() - 3600 * 24 < started <= time.time()


def test_deepspeeds_shm_all_reduce_is_not_built(monkeypatch):
    """Training never calls DeepSpeed's inference_all_reduce; its JIT build (60-110 s on 2 cores
    the first time) and the probe of every op's compiler before it are skipped."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed.ops

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # DeepSpeed's backend module, not torch

    from raypack.train.engine import skip_shm_build

    built = []
    monkeypatch.setattr(ds_torch.get_accelerator().create_op_builder("ShareMemCommBuilder").__class__, "load",
                        lambda self, *a, **k: built.append(self) or object())
    skip_shm_build()
    assert ds_torch.build_shm_op() is None and not built
    assert vars(deepspeed.ops)["__compatible_ops__"]["deepspeed_shm_comm"] is False
