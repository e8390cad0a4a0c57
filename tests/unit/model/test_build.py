"""Loading models for packed training: tiny configs, paths, refusals, no shared config objects."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import BloomConfig

from raypack.config import ModelConfig
from raypack.data.strategies import STRATEGIES
from raypack.model.build import ModelNotFoundError, UnsupportedModelError, load_model, model_config, tiny_config

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
    assert loaded.config._attn_implementation == "raypack_exact_varlen" and not loaded.config.use_cache
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    # from_pretrained alone gives eval mode, where transformers skips gradient checkpointing
    assert loaded.training and all(m.training for m in loaded.modules())


def test_a_raypack_model_config_is_not_guessed_at():
    """The caller unpacks a ModelConfig into arguments; load_model takes a name or a transformers config."""
    with pytest.raises(TypeError, match="expected a name, path or transformers config"):
        load_model(ModelConfig(name="tiny-llama"))


def test_output_router_logits_warns_no_more_and_tiny_qwen3_moe_builds():
    """The router loss is raypack's own now (raypack/train/objectives/router_loss.py): no warning that it isn't."""
    import warnings

    cfg = tiny_config("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_model(transformers.MixtralConfig(**{k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}, vocab_size=512,
                   num_local_experts=2, output_router_logits=True))  # fmt: skip
    model = load_model("tiny-qwen3_moe", dtype="float32")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_hub_name_the_hub_cant_give_fails_at_once_and_says_how(monkeypatch, hub):
    """Without a hub, huggingface_hub retries a config it hasn't cached for ~50 s; raypack asks
    the hub once (here an endpoint that refuses connections, without leaving the machine), then
    only the local cache, and names HF_HUB_OFFLINE either way."""
    import time

    import huggingface_hub.constants

    if hub == "offline":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as e:
        model_config("no-such-org/no-such-model")
    assert time.monotonic() - start < 5
    msg = str(e.value)
    assert msg.startswith("model.name 'no-such-org/no-such-model': not a local folder, not in the Hugging Face cache (")
    if hub == "offline":
        assert msg.endswith("and HF_HUB_OFFLINE is set, so the hub is not asked")
    else:
        assert "and the hub (http://127.0.0.1:9) can't be reached (" in msg
        assert msg.endswith("with HF_HUB_OFFLINE=1 an unreachable hub fails at once, without a request")


def test_a_hub_that_answers_is_asked_as_before_and_a_bad_path_not_at_all(monkeypatch, tmp_path):
    import huggingface_hub.constants

    from raypack.model import build

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    asked = []
    monkeypatch.setattr(build, "get_session", lambda: type("Answers", (), {"head": lambda *a, **k: asked.append(a)})())
    calls = []
    monkeypatch.setattr(build.AutoConfig, "from_pretrained", lambda name, **kw: calls.append(kw) or tiny_config("llama"))
    model_config("some-org/some-model")
    assert len(asked) == 1 and calls[-1]["local_files_only"] is False
    model_config(str(tmp_path))  # a local folder: no hub request
    assert len(asked) == 1 and calls[-1]["local_files_only"] is False
    with pytest.raises(ModelNotFoundError, match=r"'\./models/nope': no such folder, and not a hub name \(org/model\)$"):
        model_config("./models/nope")
    assert len(asked) == 1 and len(calls) == 2
