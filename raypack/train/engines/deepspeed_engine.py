"""The DeepSpeed engine (train.engine: deepspeed): ZeRO 0-3, where the JSON presets meet the typed config.

A lean step: every DeepSpeed setting that costs time and buys nothing is off (read in DeepSpeed
0.19.8's engine.py, utils/timer.py and runtime/zero/stage_1_and_2.py):
- `bf16.check_grad_overflow` (on by default): before every optimizer step it tests each gradient
  for inf/NaN, all-reduces the answer and reads it on the host (`.item()`: the host waits for the
  whole backward), to skip the step. bf16 has fp32's exponent range and no loss scale to lower, so
  raypack turns it off and reads the gradient norm a step late instead: a non-finite one stops the
  run before any checkpoint holds its weights (raypack/train/stepvalues.py). fp16 keeps it.
- `timers.throughput` (on and synchronized by default, apart from `wall_clock_breakdown`):
  synchronizes the device at every forward and every `engine.step()` from the third step on.
- `zero_optimization.overlap_comm` on one rank: it buys nothing (there is no communication to
  overlap) and synchronizes the device at the end of every backward (ZeRO 1-2's epilogue), on top
  of a second reduce bucket. With many ranks the preset's choice stands.
- ZeRO 1-2's gradient clipping (`gradient_clipping`, train.grad_clip: 1.0 by default) reads a
  device value on the host once per parameter group every step, to put inf in place of an invalid
  norm: raypack swaps in the same replacement as a tensor op (`clip_without_reading`).
The reduce bucket still carries one rank's gradients (copied in, "reduced" over a group of one,
copied into the partition): its size only sets how many such flushes a step takes, each a few
launches, and costs 2 bytes an element, so the preset's size stands.

Start-up: `setup_engine` skips two things DeepSpeed's initialization does that training never
uses, each seconds before the first step: the JIT build of a shared-memory all-reduce for inference
(`skip_shm_build`), and the Inductor import that its Muon module's `torch.compile` decorators bring
(`import_muon_uncompiled`).

Precision (`train.precision`): `mixed` keeps fp32 master weights and Adam moments beside the
model's bf16 weights; `bf16` asks DeepSpeed for bf16 master weights, gradients and moments
(`bf16_master_weights_and_grads`, `bf16_optimizer_states`) and passes torch-optimi's AdamW with
Kahan summation (raypack/train/engines/optim.py).

Checkpoints: DeepSpeed's own `save_checkpoint` under the tag `ds` (its model and ZeRO partition
files, one set per rank), read back offline by its `zero_to_fp32` (`read_offline`). Partitions
cut for another rank count (a resume on another worker count) load from `ds_universal/`, the
universal checkpoint the driver converted them to (raypack/train/engines/universal.py).

A preset under raypack/configs/deepspeed/ holds what a cluster operator tunes (bucket sizes, overlap,
offload devices). The typed `TrainConfig` then overwrites every key it owns, so no value is left
as "auto" for DeepSpeed and Ray to resolve differently. The presets are package data: a name such
as `zero3` resolves the same from a checkout, an uploaded working dir or an installed wheel (the
cluster image).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import types
from pathlib import Path
from typing import Any

import deepspeed
import torch

from raypack.config import TrainConfig
from raypack.errors import InputError
from raypack.model.build import resolve_dtype
from raypack.train.engines import universal
from raypack.train.engines.base import Engine, SavedWeights, param_groups
from raypack.train.engines.optim import BETAS, EPS, make_optimizer, schedule
from raypack.train.presets import find_auto, load_preset

__all__ = ["DeepSpeedEngine", "building", "clip_without_reading", "deepspeed_config", "import_muon_uncompiled",
           "model_dtype", "read_offline", "setup_engine", "skip_shm_build"]


def deepspeed_config(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int) -> dict[str, Any]:
    """The full DeepSpeed config for one run: the preset, overlaid by the typed config."""
    ds = load_preset(cfg.deepspeed_preset)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = cfg.zero_stage
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
    else:
        zero.pop("offload_optimizer", None)
    if cfg.offload_params:
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
    else:
        zero.pop("offload_param", None)
    if cfg.zero_stage == 3:
        # Consolidate the full weights on save so a checkpoint loads without zero_to_fp32.
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    # One packed row per micro-batch: the pack budget, not a row count, sets the work per step.
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.grad_accum * world_size
    ds["gradient_clipping"] = cfg.grad_clip
    ds["bf16"] = {"enabled": dtype == torch.bfloat16}
    if dtype == torch.bfloat16:
        ds["bf16"]["check_grad_overflow"] = False  # see the module doc
        if cfg.precision == "bf16":
            ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
            ds["zero_allow_untested_optimizer"] = True  # torch-optimi's AdamW (ZeRO knows torch's by type)
    ds["fp16"] = {"enabled": dtype == torch.float16}
    ds["steps_per_print"] = 10**9  # raypack prints its own progress line
    ds["wall_clock_breakdown"] = False
    ds["timers"] = {"throughput": {"enabled": False}}  # its device syncs: see the module doc
    if world_size == 1 and cfg.zero_stage in (1, 2):
        zero["overlap_comm"] = False  # nothing to overlap on one rank, and a sync per backward
    if cfg.optimizer == "deepspeed" or cfg.offload_optimizer:
        # DeepSpeed's own (CPU-)Adam: needed for optimizer offload; JIT-builds on first use.
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": list(BETAS), "eps": EPS},
        }
    else:
        ds.pop("optimizer", None)
    ds.pop("scheduler", None)  # raypack passes its own warmup-cosine schedule
    if auto := find_auto(ds):
        raise ValueError(f"DeepSpeed config key {auto} is still 'auto'; set it in the preset or the typed config")
    return ds


def model_dtype(cfg: TrainConfig, dtype: str) -> torch.dtype:
    """The weights' dtype: model.dtype's, or bf16 for train.precision bf16 (the config refuses another)."""
    return torch.bfloat16 if cfg.precision == "bf16" else resolve_dtype(dtype)


SHM_OP = "deepspeed_shm_comm"


def skip_shm_build() -> None:
    """Start-up: DeepSpeed's communication backend builds, on the CPU, a shared-memory all-reduce
    (a JIT C++ build: 60-110 s on 2 cores the first time, and again for every new venv or extension
    folder), after probing every op's compiler. Only `inference_all_reduce` uses it, and training
    never calls that. DeepSpeed keeps the compatibility table it reads as a dict meant for edits
    (deepspeed/ops/__init__.py): marking the op unavailable skips the probe and the build. Call it
    before DeepSpeed starts its backend (deepspeed.initialize, init_distributed)."""
    import deepspeed.ops

    table = vars(deepspeed.ops).get("__compatible_ops__")
    if table is None:
        deepspeed.ops.__compatible_ops__ = {SHM_OP: False}
    else:
        table[SHM_OP] = False


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_uncompiled() -> None:
    """Start-up: DeepSpeed's ZeRO checks every optimizer against a list it completes, on each
    `deepspeed.initialize`, by importing its Muon optimizer's module, whose functions are decorated
    with `torch.compile`; that decoration imports Inductor (1.0-1.4 s of CPU in a worker, measured,
    before the first step), which a run that compiles nothing never uses. The module is imported
    here first with decorators that call `torch.compile` on a function's first call instead: the
    same compiled functions for whoever uses Muon, and no Inductor for those who don't."""
    import importlib
    import sys

    from deepspeed.runtime import compiler

    eager = getattr(compiler, "compile", None)
    if MUON_MODULE in sys.modules or eager is None:  # imported already, or another DeepSpeed: as it comes
        return
    compiler.compile = lambda: _compile_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # another DeepSpeed version: its check does what it does
        pass
    finally:
        compiler.compile = eager


def _compile_on_first_call(fn):
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def cast_added_params(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Weights added after zero.Init built the model (LoRA adapters) cast to the compute dtype.

    DeepSpeed casts a model's weights to bf16 itself, except a model zero.Init built
    (`_cast_module_mixed_precision`: "ZeRO-Init params are already at the configured dtype"): there
    the adapters peft adds afterwards stay fp32, so ZeRO-3's LoRA branch multiplied in fp32 where
    ZeRO-1/2 and the torch engine multiply in bf16 (tests/ray/train/test_matrix.py: Kimi Linear's
    b_proj adapter gradient 5.5% off each example alone in bf16). Cast as DeepSpeed casts the rest:
    the fp32 master copy is ZeRO's optimizer's, drawn from the same values ZeRO-2's is."""
    if dtype not in (torch.bfloat16, torch.float16) or not any(hasattr(p, "ds_id") for p in model.parameters()):
        return 0
    cast = 0
    for p in model.parameters():
        if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def setup_engine(model: torch.nn.Module, cfg: TrainConfig, *, dtype: torch.dtype, world_size: int,
                 total_steps: int) -> DeepSpeedEngine:
    """`deepspeed.initialize` with raypack's optimizer and schedule, behind the engine seam."""
    skip_shm_build()
    import_muon_uncompiled()
    ds_config = deepspeed_config(cfg, dtype=dtype, world_size=world_size)
    cast_added_params(model, dtype)
    optimizer = None
    if "optimizer" not in ds_config:
        # A torch optimizer avoids DeepSpeed's JIT Adam builds (85-105 s each on 2 cores).
        optimizer = make_optimizer(param_groups(model, cfg.weight_decay), cfg)

    # The schedule is built on DeepSpeed's wrapped optimizer and stepped by engine.step() at each
    # accumulation boundary; save/load_checkpoint carry its state.
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=None if optimizer is not None else [p for p in model.parameters() if p.requires_grad],
        lr_scheduler=lambda opt: schedule(opt, cfg, total_steps),
        config=ds_config,
    )
    clip_without_reading(engine.optimizer)
    return DeepSpeedEngine(engine, scheduler, dtype)


class DeepSpeedEngine(Engine):
    """DeepSpeed's engine behind the seam: its own calls, and its checkpoints under one fixed tag."""

    name = "deepspeed"
    tag = "ds"  # one fixed DeepSpeed tag: every Ray checkpoint folder holds exactly one

    def __init__(self, ds, scheduler, compute_dtype: torch.dtype) -> None:
        self.ds = ds
        """DeepSpeed's own engine (tests read its optimizer's partitions)."""
        self.module = ds.module
        self.optimizer = ds.optimizer
        """DeepSpeed's optimizer (ZeRO's wrapper around raypack's AdamW, or its own)."""
        self.device = ds.device
        self.scheduler = scheduler
        self.compute_dtype = compute_dtype
        self.zero_stage = ds.zero_optimization_stage()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> None:
        self.ds.step()

    def grad_norm(self):
        return self.ds.get_global_grad_norm()

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def eval(self) -> None:
        self.ds.eval()

    def save(self, folder: Path, state: dict[str, Any], *, frozen: bool) -> None:
        self.ds.save_checkpoint(str(folder), tag=self.tag, client_state={"train_state": state},
                                exclude_frozen_parameters=frozen)

    def load(self, folder: Path, *, frozen: bool) -> dict[str, Any]:
        # With adapters the checkpoint leaves the frozen base weights out.
        saved = universal.partitions(Path(folder) / self.tag)
        if saved in (0, self.ds.dp_world_size):
            _, client = self.ds.load_checkpoint(str(folder), tag=self.tag, load_module_strict=not frozen)
            return client["train_state"]
        # ZeRO partitions cut for another rank count: the universal state the driver converted
        # them to (universal.convert), which this engine cuts again for its own ranks
        if not (Path(folder) / universal.TAG / universal.DONE).exists():
            raise InputError(f"{folder}: its ZeRO state was saved on {saved} workers and this run has "
                             f"{self.ds.dp_world_size}, but {universal.TAG}/ (its conversion) is missing or cut short")
        config = self.ds._config  # read when loading only (DeepSpeed 0.19.8's engine.load_universal_checkpoint)
        config.load_universal_checkpoint = True
        try:
            _, client = self.ds.load_checkpoint(str(folder), tag=universal.TAG, load_module_strict=not frozen)
        finally:
            config.load_universal_checkpoint = False
        return client["train_state"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:
            return self.ds._zero3_consolidated_16bit_state_dict()
        return self.module.state_dict()

    def destroy(self) -> None:
        self.ds.destroy()
        # ZeRO-3 swaps torch.nn.functional.linear for its own ("This will persist unless manually
        # reset", DeepSpeed 0.19.8's partition_parameters.py): an in-place bias add that the
        # process's later models (a test's, a benchmark's next engine) would run, and that
        # selective checkpointing's check then refuses
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patched

        original = getattr(Patched, "linear_bk", None)
        if original is not None:
            torch.nn.functional.linear = original


@contextlib.contextmanager
def building(cfg: TrainConfig, *, dtype: torch.dtype, world_size: int):
    """Where the model is built: under ZeRO-3, inside transformers' `HfDeepSpeedConfig`, so that
    from_pretrained and from_config build it under `deepspeed.zero.Init` and each rank materializes
    only its partition (8 x 140 GB for 70B otherwise)."""
    if cfg.zero_stage != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    skip_shm_build()  # before DeepSpeed's backend starts
    deepspeed.init_distributed()  # joins Ray Train's process group; the config checks world size
    zero3 = HfDeepSpeedConfig(deepspeed_config(cfg, dtype=dtype, world_size=world_size))
    try:
        yield
    finally:
        del zero3


def read_offline(folder: Path, adapters: bool) -> SavedWeights:
    """The DeepSpeed state in folder/ds, its weights consolidated from every rank's shard by
    DeepSpeed's own `zero_to_fp32`. `adapters`: the run trained adapters, so the frozen base
    weights are not in it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns, on import, that it found no GPU
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds = Path(folder) / DeepSpeedEngine.tag
    # rank 0's model states: one file under ZeRO 0-2, one per rank under ZeRO-3
    first = next((f for f in (ds / "mp_rank_00_model_states.pt", ds / "zero_pp_rank_0_mp_rank_00_model_states.pt")
                  if f.exists()), None)
    if first is None:
        raise InputError(f"{folder}: no DeepSpeed state in {DeepSpeedEngine.tag}/ (is it a raypack checkpoint, "
                         "copied whole?)")
    # mmap: under ZeRO 0-2 this file holds the whole module, of which only ZeRO-0 needs the tensors
    saved = torch.load(first, map_location="cpu", mmap=True, weights_only=False)
    ds_config = saved["ds_config"]
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    dtype = (torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else
             torch.float16 if ds_config.get("fp16", {}).get("enabled") else torch.float32)
    if stage == 0:
        # zero_to_fp32 reads ZeRO's partitioned optimizer state, which stage 0 doesn't write
        weights = dict(saved["module"])
    else:
        # It prints every step and draws a progress bar; what it found is reported by the caller.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            weights = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=DeepSpeedEngine.tag,
                                                               exclude_frozen_parameters=adapters)
    return SavedWeights(saved["train_state"], DeepSpeedEngine.name, stage, int(saved["dp_world_size"]), dtype, weights)


def clip_without_reading(optimizer) -> bool:
    """ZeRO 1-2's gradient clipping, made to wait for nothing: DeepSpeed's `unscale_and_clip_grads`
    (0.19.8, runtime/zero/stage_1_and_2.py) asks `is_invalid_grad_norm(total_norm)` on the host, a
    `bool()` of a device tensor per parameter group, every step at any train.grad_clip > 0, only
    to put inf in place of an invalid norm. The same replacement as a tensor op (`torch.where`)
    gives the same clip factor, bit for bit, with no read (tests/unit/train/test_engine.py checks
    it against DeepSpeed's own). Returns whether it was installed (ZeRO 1-2's optimizer only)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, optimizer)
    return True


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with the invalid norm replaced on the device."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not torch.is_tensor(total_norm):  # not a path DeepSpeed 0.19.8 takes: its own code, as it is
        return DeepSpeedZeroOptimizer.unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return None
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        valid = torch.isfinite(total_norm) & (total_norm >= 0)
        clip_norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad  # norm is in fact norm * scale
        combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)
    return None
