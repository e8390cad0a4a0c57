"""The DeepSpeed config (a JSON preset overlaid by the typed config) and the LR schedule, without Ray."""

from __future__ import annotations

import json

import pytest
import torch

from raypack.config import TrainConfig
from raypack.train.engine import deepspeed_config, lr_lambda


def test_typed_config_overlays_preset_and_leaves_no_auto():
    cfg = TrainConfig(zero_stage=3, grad_accum=4, grad_clip=0.5, deepspeed_preset="zero3_offload",
                      offload_optimizer=False, offload_params=False)
    ds = deepspeed_config(cfg, dtype=torch.bfloat16, world_size=8)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero and "offload_param" not in zero
    assert zero["overlap_comm"] is True  # the preset's tuning survives
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
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


def test_warmup_then_cosine():
    lrs = [lr_lambda(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
