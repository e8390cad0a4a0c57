"""Start-up (issue 35 part 6, issue 40): the phases before the first step, from the driver's and a
worker's marks, DeepSpeed's shared-memory all-reduce left unbuilt, and its Muon module imported
without Inductor."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from paths import REPO

from raypack.train.startup import TOTAL, Startup, describe, process_start


def test_phases_run_between_their_marks_and_the_total_from_the_process_start():
    marks = {"process": 100.0, "start": 103.0, "preflight": 104.0, "ray": 110.0, "prepare": 110.0, "data": 130.0,
             "fit": 130.5, "worker": 150.0, "imports": 158.0, "received": 158.0, "model": 159.0,
             "engine": 163.0, "setup": 164.0, "first_step": 166.0}
    phases = Startup(marks).phases()
    assert list(phases) == ["python and imports", "preflight", "Ray start", "data preparation", "worker group",
                            "worker imports", "waiting for data", "model load", "engine init", "worker setup",
                            "first step", TOTAL]
    assert phases["data preparation"] == 20.0 and phases["worker group"] == 19.5 and phases[TOTAL] == 66.0
    assert describe(phases).startswith("66.0 s to the first step: python and imports 3.0, preflight 1.0,")
    # a worker that has no driver marks (a test's loop) reports what it has, and no total
    assert Startup({"engine": 1.0, "setup": 3.0}).phases() == {"worker setup": 2.0}
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

    from raypack.train.engines.deepspeed_engine import skip_shm_build

    built = []
    monkeypatch.setattr(ds_torch.get_accelerator().create_op_builder("ShareMemCommBuilder").__class__, "load",
                        lambda self, *a, **k: built.append(self) or object())
    skip_shm_build()
    assert ds_torch.build_shm_op() is None and not built
    assert vars(deepspeed.ops)["__compatible_ops__"]["deepspeed_shm_comm"] is False


NO_INDUCTOR = """
import os, sys, tempfile
os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
from raypack.config import TrainConfig
from raypack.model.build import load_model
from raypack.train.engines.deepspeed_engine import setup_engine
setup_engine(load_model("tiny-llama"), TrainConfig(num_workers=1, zero_stage=2), dtype=torch.float32, world_size=1,
             total_steps=1)
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
print("RESULT", "torch._inductor.compile_fx" in sys.modules, MuonWithAuxAdam in ZERO_SUPPORTED_OPTIMIZERS,
      hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable"))
"""


def test_deepspeed_init_imports_no_inductor():
    """DeepSpeed's ZeRO optimizer check imports its Muon module, whose @torch.compile decorators
    import Inductor (1.0-1.4 s before the first step); raypack imports that module first with
    decorators that compile on first call. In a fresh process: a ZeRO engine set up, no Inductor,
    DeepSpeed's check still knows Muon, and Muon's functions are not compiled yet."""
    proc = subprocess.run([sys.executable, "-c", NO_INDUCTOR], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("RESULT", 1)[1].split() == ["False", "True", "False"]


def test_muon_functions_compile_on_their_first_call(monkeypatch):
    import torch

    from raypack.train.engines.deepspeed_engine import _compile_on_first_call

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or (lambda x: fn(x) + 1))

    def double(x):
        return 2 * x

    lazy = _compile_on_first_call(double)
    assert compiled == [] and lazy.__name__ == "double"
    assert lazy(3) == 7 and lazy(4) == 9 and compiled == [double]  # compiled once, then reused
