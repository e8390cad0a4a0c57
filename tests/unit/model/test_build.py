"""Loading models for packed training: tiny configs, paths, refusals, no shared config objects."""

from __future__ import annotations

import pytest
import torch
from transformers import BloomConfig

from raypack.config import ModelConfig
from raypack.data.strategies import STRATEGIES
from raypack.model.build import UnsupportedModelError, load_model, tiny_config

BLOOM = dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=1024)


def test_unpackable_model_is_refused_with_padded_alternatives():
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM.*pad or pad_sorted"):
        load_model(BloomConfig(**BLOOM))
    # the padded strategies can still load it
    load_model(BloomConfig(**BLOOM), attention="sdpa")


def test_refusal_names_exactly_the_padded_strategies():
    """The model layer knows no strategy; its message must still name the ones that pad."""
    padded = [name for name, strategy in STRATEGIES.items() if strategy.padded]
    with pytest.raises(UnsupportedModelError) as e:
        load_model(BloomConfig(**BLOOM))
    assert f"({' or '.join(padded)})" in str(e.value)


def test_load_from_path_and_config_not_mutated(tmp_path):
    cfg = tiny_config("qwen2", vocab_size=512)
    model = load_model(cfg)
    assert cfg._attn_implementation != "raypack_varlen"  # transformers 5 writes into the config it gets
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), attention="sdpa_varlen", dtype="float32")
    assert loaded.config._attn_implementation == "raypack_sdpa_varlen" and not loaded.config.use_cache
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    # from_pretrained alone gives eval mode, where transformers skips gradient checkpointing
    assert loaded.training and all(m.training for m in loaded.modules())


def test_a_raypack_model_config_is_not_guessed_at():
    """The caller unpacks a ModelConfig into arguments; load_model takes a name or a transformers config."""
    with pytest.raises(TypeError, match="expected a name, path or transformers config"):
        load_model(ModelConfig(name="tiny-llama"))
