"""The model's one description (raypack/model/facts.py): what it says of a dense, an MoE, a hybrid
and a vision-language model of the supported-models table, each fact checked against the model
transformers builds; one record per config object; and a worker's setup reading the model's
config once and building its meta-device structure once."""

from __future__ import annotations

import pytest
from torch import nn

from families import FAMILIES
from raypack.model import build, facts
from raypack.model.build import model_config
from raypack.model.facts import describe, read_tree
from raypack.model.routers import builds_routers, find_routers


def _layers(model: nn.Module) -> int:
    return len(facts.decoder(model).layers)


@pytest.mark.parametrize("key, experts, routed, kinds", [
    ("llama", 0, False, {}),
    ("mixtral", 4, True, {}),
    ("qwen3_5", 0, False, {"gated delta rule": 3}),
    # its config names 8 routed experts, and its layer pattern builds no MoE layer: the description
    # says what the config says; whether routers are built, the structure says (routers.builds_routers)
    ("nemotron_h", 8, False, {"Mamba-2": 2}),
])  # fmt: skip
def test_a_family_s_facts_are_what_transformers_builds(key, experts, routed, kinds):
    config = FAMILIES[key].build_config(key)
    f = describe(config)
    model = f.meta_model()
    text = config.get_text_config()
    assert (f.model_type, f.vlm, f.multimodal) == (config.model_type, False, False)
    assert (f.hidden, f.heads, f.vocab) == (text.hidden_size, text.num_attention_heads, text.vocab_size)
    assert f.layers == _layers(model) and f.head_dim == 16 and f.kv_heads == 2
    assert f.experts == experts and builds_routers(model) == routed
    if routed:  # the router scores as many experts as the description counts
        routers = find_routers(model, key)
        assert routers.modules[0].weight.shape[0] == f.experts and f.top_k == 2
        routers.remove()
    tree = f.meta_tree()
    found: dict[str, int] = {}
    for kind in tree.mixers.values():
        found[kind.name] = found.get(kind.name, 0) + 1
    assert found == kinds and tree.decoder is facts.decoder(model) and tree.tower is None
    assert f.layer_types == tuple(getattr(text, "layer_types", None) or ())


def test_a_vlm_s_facts_are_its_language_model_s_and_its_tower():
    config = model_config("tiny-qwen2_5_vl")
    f = describe(config)
    assert f.vlm and f.multimodal and f.vocab == config.text_config.vocab_size
    assert f.layers == config.text_config.num_hidden_layers and f.hidden == config.text_config.hidden_size
    tree = f.meta_tree()
    assert tree.tower is f.meta_model().model.visual and tree.mixers == {}
    assert tree.decoder is f.meta_model().model.language_model


def test_one_record_per_config_while_it_is_unchanged():
    """The same config object: the same record and one meta build; a config changed since (as the
    trait tests change layer_types on a built model's config) is described again."""
    config = model_config("tiny-qwen3_5")
    first = describe(config)
    assert describe(config) is first and first.meta_model() is first.meta_model()
    config.layer_types = ["full_attention", "full_attention"]
    again = describe(config)
    assert again is not first and again.layer_types == ("full_attention", "full_attention")
    assert describe(config, trust_remote_code=True) is not again


def test_a_built_model_keeps_the_description_it_was_built_from():
    f = describe(model_config("tiny-qwen3_moe"))
    model = build.load_model("tiny-qwen3_moe", attention="sdpa_varlen", facts=f)
    assert describe(model.config) is f
    assert read_tree(model).mixers == {} and f.experts == 4


def test_the_worker_s_setup_reads_the_config_once_and_builds_the_structure_once(monkeypatch, tmp_path):
    """loop.setup up to the engine, on a hybrid under `auto` checkpointing (the estimate reads its
    mixers from the structure) and packed rows (the build checks that structure): before the
    description, the config was read twice and the meta model built twice."""
    from types import SimpleNamespace

    from raypack.config import load
    from raypack.train import loop

    calls = {"config": 0, "meta": 0}
    read, built = build.model_config, facts.meta_model

    def counted_config(*args, **kwargs):
        calls["config"] += 1
        return read(*args, **kwargs)

    def counted_meta(*args, **kwargs):
        calls["meta"] += 1
        return built(*args, **kwargs)

    class Built(Exception):
        pass

    def stop(*args, **kwargs):  # the model is built: the next phase applies its kernels
        raise Built

    for module, name, fn in ((build, "model_config", counted_config), (loop, "model_config", counted_config),
                             (facts, "meta_model", counted_meta), (build, "meta_model", counted_meta),
                             (loop, "apply_kernels", stop)):
        monkeypatch.setattr(module, name, fn)
    cfg = load(None, ["model.name=tiny-qwen3_5", "model.gradient_checkpointing=auto", "pack.budget=64",
                      "train.num_workers=1"])
    data = SimpleNamespace(padded=False, vocab_size=1024, stats={})
    with pytest.raises(Built):
        loop.setup(cfg, data, world_size=1)
    assert calls == {"config": 1, "meta": 1}
