"""The DeepSpeed config (a JSON preset overlaid by the typed config) and the LR schedule, without Ray."""

from __future__ import annotations

import copy
import json
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raypack.config import TrainConfig
from raypack.train.engines.deepspeed_engine import deepspeed_config
from raypack.train.engines.optim import lr_lambda


def test_typed_config_overlays_preset_and_leaves_no_auto():
    cfg = TrainConfig(zero_stage=3, grad_accum=4, grad_clip=0.5, deepspeed_preset="zero3_offload",
                      offload_optimizer=False, offload_params=False)
    ds = deepspeed_config(cfg, dtype=torch.bfloat16, world_size=8)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero and "offload_param" not in zero
    assert zero["overlap_comm"] is True  # the preset's tuning survives
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert "optimizer" not in ds and "scheduler" not in ds  # raypack passes its own
    assert "auto" not in json.dumps(ds)


def test_offload_uses_deepspeeds_optimizer_and_auto_is_refused(tmp_path):
    ds = deepspeed_config(TrainConfig(zero_stage=2, offload_optimizer=True), dtype=torch.float32, world_size=2)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW"
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": "auto"}}))
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size is still 'auto'"):
        deepspeed_config(TrainConfig(deepspeed_preset=str(preset)), dtype=torch.float32, world_size=1)
    with pytest.raises(ValueError, match="no preset 'zero9'"):
        deepspeed_config(TrainConfig(deepspeed_preset="zero9"), dtype=torch.float32, world_size=1)


class Reads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host (`.item()`, `bool()`: aten._local_scalar_dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func).startswith("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm", [0.3, 2.5, float("inf"), float("nan"), -1.0])
@pytest.mark.parametrize("clip_grad,loss_scale", [(1.0, 1.0), (0.7, 1.0), (1.0, 1024.0), (0.0, 8.0), (0.0, 1.0)])
def test_zero12_clipping_matches_deepspeeds_bit_for_bit_without_reading_the_device(norm, clip_grad, loss_scale):
    """DeepSpeed's ZeRO 1-2 unscale_and_clip_grads asks on the host whether the norm is invalid (a
    read that waits for the backward on CUDA); raypack's replacement decides it on the device. The
    same gradients come out of both, for a valid norm, inf, NaN and DeepSpeed's -1 sentinel."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from raypack.train.engines.deepspeed_engine import _unscale_and_clip_grads

    owner = types.SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device=torch.device("cpu"))
    grads = [torch.randn(37, generator=torch.Generator().manual_seed(0)), [torch.randn(5), torch.randn(3)]]
    theirs, ours = copy.deepcopy(grads), copy.deepcopy(grads)
    total = torch.tensor(norm)
    with Reads() as deepspeeds:
        DeepSpeedZeroOptimizer.unscale_and_clip_grads(owner, theirs, total)
    with Reads() as raypacks:
        _unscale_and_clip_grads(owner, ours, total)
    flat = lambda gs: torch.cat([g.reshape(-1) for x in gs for g in (x if isinstance(x, list) else [x])])  # noqa: E731
    torch.testing.assert_close(flat(ours), flat(theirs), rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(flat(ours), flat(grads)) or (clip_grad == 0 and loss_scale == 1.0) or norm < clip_grad
    assert raypacks.count == 0
    assert deepspeeds.count == (1 if clip_grad > 0 else 0), "DeepSpeed no longer reads here: is the swap still needed?"


def test_the_step_is_lean_on_one_rank_and_on_many():
    """What costs time and buys nothing is off (engine.py's module doc says what each costs)."""
    one = deepspeed_config(TrainConfig(zero_stage=2, deepspeed_preset="zero2"), dtype=torch.bfloat16, world_size=1)
    many = deepspeed_config(TrainConfig(zero_stage=2, deepspeed_preset="zero2"), dtype=torch.bfloat16, world_size=8)
    for ds in (one, many):
        assert ds["bf16"]["check_grad_overflow"] is False  # bf16: no overflow check, no .item() a step
        assert ds["timers"] == {"throughput": {"enabled": False}} and ds["wall_clock_breakdown"] is False
    assert one["zero_optimization"]["overlap_comm"] is False  # nothing to overlap; a sync per backward
    assert many["zero_optimization"]["overlap_comm"] is True  # the preset's choice where there is communication
    # fp16 has a loss scale to lower: DeepSpeed's overflow check stays (its default)
    fp16 = deepspeed_config(TrainConfig(zero_stage=2), dtype=torch.float16, world_size=1)
    assert "check_grad_overflow" not in fp16["fp16"] and fp16["bf16"] == {"enabled": False}


def test_bf16_precision_asks_deepspeed_for_bf16_master_weights_and_moments():
    ds = deepspeed_config(TrainConfig(zero_stage=2, precision="bf16"), dtype=torch.bfloat16, world_size=2)
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False, "bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True}
    assert ds["zero_allow_untested_optimizer"] is True
    mixed = deepspeed_config(TrainConfig(zero_stage=2), dtype=torch.bfloat16, world_size=2)
    assert "bf16_master_weights_and_grads" not in mixed["bf16"] and "zero_allow_untested_optimizer" not in mixed


def test_warmup_then_cosine():
    lrs = [lr_lambda(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_bf16_precisions_adamw_keeps_the_updates_rounding_drops():
    """1000 AdamW steps of 1e-4 on a bf16 weight of 1.0, where an ulp is 2^-7: each update is below
    half an ulp. torch's AdamW on bf16 weights (TRL on a bf16-loaded model) rounds every one away;
    raypack's (torch-optimi's, Kahan-summed) lands where fp32 weights do, within an ulp."""
    from raypack.train.engines.optim import make_optimizer

    def train(dtype, optimizer):
        w = torch.nn.Parameter(torch.ones(64, dtype=dtype))
        opt = optimizer([{"params": [w], "weight_decay": 0.0}])
        for _ in range(1000):
            w.grad = torch.ones_like(w)  # Adam's step is lr (times 1 - a vanishing bias term)
            opt.step()
        return w.detach().float()

    def torch_adamw(groups):
        return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    cfg = TrainConfig(zero_stage=2, precision="bf16", lr=1e-4)
    reference = train(torch.float32, torch_adamw)
    assert reference.mean().item() == pytest.approx(0.9, abs=1e-3)
    assert torch.equal(train(torch.bfloat16, torch_adamw), torch.ones(64))  # every update lost
    kahan = train(torch.bfloat16, lambda groups: make_optimizer(groups, cfg))
    assert (kahan - reference).abs().max().item() <= 2**-7


def test_a_zero2_engine_clips_as_deepspeed_does(one_rank_group):
    """The engine setup_engine builds swaps its clipping in (ZeRO-2, bf16, grad_clip small enough
    to clip): its step's weights equal, bit for bit, those of the same engine with DeepSpeed's own
    clipping put back, and its gradient norm is the one DeepSpeed computed."""
    from raypack.model.build import load_model
    from raypack.train.engines.deepspeed_engine import setup_engine

    cfg = TrainConfig(num_workers=1, zero_stage=2, grad_clip=0.05, warmup_steps=0, lr=1e-2)
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    after = {}
    for clipping in ("raypack", "deepspeed"):
        torch.manual_seed(0)
        model = load_model("tiny-llama", dtype="bfloat16", vocab_size=256)
        engine = setup_engine(model, cfg, dtype=torch.bfloat16, world_size=1, total_steps=2)
        swapped = "unscale_and_clip_grads" in vars(engine.optimizer)
        assert swapped, "setup_engine left ZeRO-2's clipping as it was"
        if clipping == "deepspeed":
            del engine.optimizer.unscale_and_clip_grads
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        norm = float(engine.grad_norm())
        assert norm > cfg.grad_clip, "the step did not clip: the test shows nothing"
        after[clipping] = (norm, {n: p.detach().clone() for n, p in engine.module.named_parameters()})
        engine.destroy()
    assert after["raypack"][0] == after["deepspeed"][0]
    for name, weight in after["deepspeed"][1].items():
        assert torch.equal(after["raypack"][1][name], weight), name
