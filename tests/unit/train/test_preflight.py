"""Checks before Ray starts that need a model or a tokenizer (tests/unit/commands/test_bad_inputs.py
covers the data classes through the command line)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers
from paths import REPO
from transformers import AutoTokenizer, BloomConfig

from raypack.config import ASSETS, Config, ModelConfig, PackConfig, TrainConfig, load
from raypack.data.encode import TokenizeError
from raypack.model.build import UnsupportedModelError, tiny_config
from raypack.data.listing import Sources
from raypack.model.adapters import AdapterError
from raypack.train.objectives.loss import UnsupportedLossError
from raypack.train.preflight import check_packed_model, preflight, source_formats


def test_a_model_that_cannot_pack_is_refused_for_packed_strategies_only(tmp_path):
    # with weights: a folder of a config alone is refused as no model (raypack/model/folder.py)
    config = BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=1024)
    transformers.BloomForCausalLM(config).save_pretrained(tmp_path / "bloom")
    overrides = [f"model.name={tmp_path / 'bloom'}", f"run.storage_path={tmp_path / 'runs'}"]
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM.*pad or pad_sorted"):
        preflight(load(None, [*overrides, "pack.strategy=bfd"]))
    assert preflight(load(None, [*overrides, "pack.strategy=pad"])).vocab_size == 1024


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    tiny_config("llama", vocab_size=500).save_pretrained(tmp_path / "small")  # the tokenizer has 768
    with pytest.raises(TokenizeError, match=r"has 768 tokens but model.name .* embeds 500"):
        preflight(load(None, [f"model.name={tmp_path / 'small'}", f"run.storage_path={tmp_path}"]))


def test_a_tokenizer_that_does_not_load_is_named(tmp_path):
    (tmp_path / "tok").mkdir()
    with pytest.raises(TokenizeError, match=r"tokenize.tokenizer '.*tok': can't load it"):
        preflight(load(None, [f"tokenize.tokenizer={tmp_path / 'tok'}", f"run.storage_path={tmp_path}"]))


def test_chat_data_needs_a_chat_template(tmp_path):
    bare = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(TokenizeError, match="no chat template"):
        preflight(load(None, [f"tokenize.tokenizer={tmp_path / 'bare'}", f"run.storage_path={tmp_path}"]))
    # completion data does not
    completion = str(ASSETS / "sample" / "completion.jsonl")
    preflight(load(None, [f"tokenize.tokenizer={tmp_path / 'bare'}", f"data.paths=[{completion}]", f"run.storage_path={tmp_path}"]))


def test_conversational_pairs_need_a_chat_template_before_ray(tmp_path):
    """Pairs whose chosen and rejected are messages are chat data: refused in preflight (JSONL and
    Parquet), not in a Ray Data task; pairs of strings need no template."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bare = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    turn = [{"role": "user", "content": "2+2?"}]
    chats = {"prompt": [turn], "chosen": [[{"role": "assistant", "content": "4"}]],
             "rejected": [[{"role": "assistant", "content": "5"}]]}
    (tmp_path / "chat.jsonl").write_text(json.dumps({k: v[0] for k, v in chats.items()}) + "\n")
    pq.write_table(pa.table(chats), tmp_path / "chat.parquet")
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "2+2?", "chosen": " 4", "rejected": " 5"}) + "\n")
    base = [f"tokenize.tokenizer={tmp_path / 'bare'}", f"run.storage_path={tmp_path / 'runs'}", "train.objective=dpo"]
    for name in ("chat.jsonl", "chat.parquet"):
        with pytest.raises(TokenizeError, match="no chat template"):
            preflight(load(None, [*base, f"data.paths=[{tmp_path / name}]"]))
    preflight(load(None, [*base, f"data.paths=[{tmp_path / 'text.jsonl'}]"]))


def test_formats_of_every_source_kind():
    sample = ASSETS / "sample"
    cfg = load(None, [f"data.paths=[{sample}]"])
    assert sorted(source_formats(cfg, Sources.of(cfg.data.paths)).values()) == [
        "chat", "completion", "instruction", "preference", "tokenized"]


# The packed-model check (check_packed_model): model traits against the run's strategy, backend and budget.

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


@pytest.fixture
def jamba(tmp_path):
    from families import FAMILIES

    FAMILIES["jamba"].build_config("jamba").save_pretrained(tmp_path / "jamba")
    return tmp_path / "jamba"


@pytest.mark.parametrize("strategy", ["bfd", "flatten", "wrapped"])
def test_known_token_mixer_packs_only_under_raypacks_attention(lfm2, jamba, strategy):
    """LFM2's short convolution keeps a packed row's examples apart under raypack's attention
    backends, which install it (raypack/model/mixers.py); `sdpa` over packed rows leaves it free
    to mix. Jamba's Mamba-1, which raypack doesn't know, is refused under both."""
    check_packed_model(cfg_for(lfm2, strategy, attention="auto"))
    with pytest.raises(UnsupportedModelError, match=r"Lfm2ForCausalLM\) has short convolution layers, which "
                                                     r"transformers' own attention .*model.attention=auto.*\(pad or pad_sorted\)"):
        check_packed_model(cfg_for(lfm2, strategy, attention="sdpa"))
    for attention in ("auto", "sdpa"):
        with pytest.raises(UnsupportedModelError, match=r"JambaForCausalLM.*convolution over the sequence"):
            check_packed_model(cfg_for(jamba, strategy, attention=attention))


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


def test_adapters_are_checked_on_the_meta_model(tmp_path):
    """model.peft: target modules that don't exist, and an adapted head under the chunked loss, are
    refused before Ray starts; the same head trains with train.loss: full."""
    base = [f"run.storage_path={tmp_path}", "model.peft.method=lora"]
    with pytest.raises(AdapterError, match=r"model.peft.target_modules \['qkv'\].*not found"):
        preflight(load(None, [*base, "model.peft.target_modules=[qkv]"]))
    head = [*base, "model.peft.target_modules=[q_proj, lm_head]"]
    with pytest.raises(UnsupportedLossError, match=r"output head.*train.loss: full"):
        preflight(load(None, head))
    assert preflight(load(None, [*head, "train.loss=full"])).vocab_size == 768
    assert preflight(load(None, base)).vocab_size == 768


def test_router_loss_settings_are_checked_before_ray(tmp_path):
    """A router loss asked of a dense model, and one beside sequence parallelism, stop before Ray
    starts, naming the model; `auto` on a dense model, or 0, is no router loss at all."""
    from raypack.errors import InputError
    from raypack.model.routers import RouterNotFoundError

    base = [f"run.storage_path={tmp_path}"]
    with pytest.raises(RouterNotFoundError, match=r"model.name 'tiny-llama': train.router_aux_loss_coef=0.01, but it "
                                                  r"is not a mixture-of-experts model"):
        preflight(load(None, [*base, "train.router_aux_loss_coef=0.01"]))
    moe_sp = [*base, "model.name=tiny-qwen3_moe", "train.sequence_parallel=2"]
    with pytest.raises(InputError, match=r"model.name 'tiny-qwen3_moe': train.router_aux_loss_coef=0.001 with "
                                         r"train.sequence_parallel=2.*not combined across"):
        preflight(load(None, moe_sp))
    assert preflight(load(None, [*moe_sp, "train.router_aux_loss_coef=0"])).vocab_size == 768
    assert preflight(load(None, base)).vocab_size == 768  # auto on a dense model


def test_a_vlm_processor_that_does_not_fit_the_model_is_refused_before_ray(tmp_path):
    """Grids for LLaVA, whole pictures for Qwen2.5-VL: refused naming the folder; each with its own
    bundled processor passes."""
    from raypack.errors import InputError

    vlm = str(REPO / "jobs" / "configs" / "vlm_quickstart.yaml")
    llava, qwen = f"tokenize.tokenizer={ASSETS / 'llava_processor'}", f"tokenize.tokenizer={ASSETS / 'vlm_processor'}"
    runs = f"run.storage_path={tmp_path}"
    with pytest.raises(InputError, match=r"vlm_processor': its image processor gives image_grid_thw beside "
                                         r"pixel_values, but LlavaForConditionalGeneration takes neither"):
        preflight(load(vlm, ["model.name=tiny-llava", qwen, runs]))
    with pytest.raises(InputError, match=r"llava_processor': its image processor gives pixel_values alone, but "
                                         r"Qwen2_5_VLForConditionalGeneration takes image_grid_thw"):
        preflight(load(vlm, [llava, runs]))
    assert preflight(load(vlm, ["model.name=tiny-llava", llava, runs])).vision_model
