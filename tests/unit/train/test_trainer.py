"""The driver's model check, before any data preparation or worker starts (no Ray here)."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from raypack.config import Config, ModelConfig, PackConfig, TrainConfig
from raypack.model.traits import UnsupportedModelError
from raypack.train.trainer import check_packed_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)  # fmt: skip


def cfg_for(model_dir, strategy, use_gpu=False, attention="auto", budget=1024):
    return dataclasses.replace(
        Config(),
        model=ModelConfig(name=str(model_dir), attention=attention),
        pack=PackConfig(strategy=strategy, budget=budget),
        train=TrainConfig(use_gpu=use_gpu),
    )


@pytest.fixture
def lfm2(tmp_path):
    transformers.Lfm2Config(**TINY, layer_types=["conv", "full_attention"]).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("strategy", ["bfd", "flatten", "wrapped"])
@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_token_mixer_refused_for_packed_strategies(lfm2, strategy, attention):
    """`sdpa` over packed rows leaves the model's convolution just as free to mix examples."""
    with pytest.raises(UnsupportedModelError, match=r"Lfm2ForCausalLM.*layer_types conv.*\(pad or pad_sorted\)"):
        check_packed_model(cfg_for(lfm2, strategy, attention=attention))


@pytest.mark.parametrize("strategy", ["pad", "pad_sorted"])
def test_padded_strategies_take_any_model(lfm2, strategy):
    check_packed_model(cfg_for(lfm2, strategy))


def test_backend_traits_follow_the_device(tmp_path):
    transformers.GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    check_packed_model(cfg_for(tmp_path, "bfd"))  # CPU: the exact path applies sinks
    check_packed_model(cfg_for(tmp_path, "bfd", use_gpu=True, attention="sdpa_varlen"))
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        check_packed_model(cfg_for(tmp_path, "bfd", use_gpu=True))


def test_row_bound_is_the_budget_except_for_flatten(tmp_path):
    transformers.Llama4TextConfig(**TINY, num_local_experts=4, intermediate_size_mlp=128, no_rope_layers=[1, 0],
                                  floor_scale=512).save_pretrained(tmp_path)  # fmt: skip
    check_packed_model(cfg_for(tmp_path, "bfd", budget=256))
    with pytest.raises(UnsupportedModelError, match="floor_scale 512"):
        check_packed_model(cfg_for(tmp_path, "bfd", budget=1024))
    check_packed_model(cfg_for(tmp_path, "flatten", budget=1024))  # rows unbounded here: checked per batch
