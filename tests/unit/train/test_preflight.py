"""Checks before Ray starts that need a model or a tokenizer (tests/unit/commands/test_bad_inputs.py
covers the data classes through the command line)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, BloomConfig

from raypack.config import ASSETS, load
from raypack.data.encode import TokenizeError
from raypack.model.build import UnsupportedModelError, tiny_config
from raypack.train.preflight import preflight, source_formats


def test_a_model_that_cannot_pack_is_refused_for_packed_strategies_only(tmp_path):
    BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=1024).save_pretrained(tmp_path / "bloom")
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


def test_formats_of_every_source_kind():
    sample = ASSETS / "sample"
    cfg = load(None, [f"data.paths=[{sample}]"])
    assert sorted(source_formats(cfg).values()) == ["chat", "completion", "instruction", "tokenized"]
