"""A model folder's broken weights, refused from the safetensors headers before Ray starts
(raypack/model/folder.py): one line naming the file. The folders are tests/checkpoints.py's,
saved as published checkpoints are (bf16, sharded), then broken as copies and downloads break."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import saved

from raypack.model.build import model_config
from raypack.model.facts import describe
from raypack.model.folder import CheckpointError, check_folder

VOCAB = 97


def copy_of(tmp_path, name="tiny-llama", **kwargs):
    folder = tmp_path / name
    shutil.copytree(saved(name, vocab_size=VOCAB, **kwargs), folder)
    return folder


def check(folder, dtype=torch.bfloat16):
    config = model_config(str(folder))
    check_folder(str(folder), config, dtype, describe(config).meta_model())


def shards(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3_moe", "tiny-qwen2_5_vl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_saved_folder_passes_in_any_dtype_holding_its_range(tmp_path, name, dtype):
    """Dense, MoE (experts saved one by one, fused as transformers loads them) and a VLM (its
    language model under another prefix on disk): renamed tensors are left to transformers."""
    folder = saved(name, vocab_size=VOCAB)
    assert len(set(shards(folder).values())) > 1  # sharded, as published checkpoints are
    check(folder, dtype)


def test_a_folder_without_weights(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(saved("tiny-llama", vocab_size=VOCAB) / "config.json", folder)
    with pytest.raises(CheckpointError, match=rf"^model.name '{folder}': no weights in the folder \(none of "
                                              r"model.safetensors, model.safetensors.index.json, .*\)$"):  # fmt: skip
        check(folder)


def test_an_index_naming_a_shard_that_is_not_there(tmp_path):
    folder = copy_of(tmp_path)
    missing = sorted(set(shards(folder).values()))[-1]
    (folder / missing).unlink()
    with pytest.raises(CheckpointError, match=rf"^{folder}/model.safetensors.index.json: names the shard "
                                              rf"{missing}, which is not in the folder$"):  # fmt: skip
        check(folder)


def test_an_index_putting_a_tensor_in_a_shard_without_it(tmp_path):
    folder = copy_of(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first, *others = sorted(set(index["weight_map"].values()))
    tensor = next(t for t, shard in index["weight_map"].items() if shard == first)
    index["weight_map"][tensor] = others[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"puts {tensor} in {others[0]}, which doesn't hold it$"):
        check(folder)


def test_a_shard_cut_short(tmp_path):
    folder = copy_of(tmp_path)
    shard = folder / sorted(set(shards(folder).values()))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size - 10])
    with pytest.raises(CheckpointError, match=rf"^{shard}: cut short \({size - 10} bytes where its header needs "
                                              rf"{size}\)$"):  # fmt: skip
        check(folder)
    shard.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match=rf"^{shard}: not a safetensors file \(its header is missing"):
        check(folder)


def test_weights_of_another_config(tmp_path):
    """config.json edited (or copied from another size): the embedding's rows differ."""
    folder = copy_of(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB + 3}))
    with pytest.raises(CheckpointError, match=rf"model.embed_tokens.weight is \[{VOCAB}, 64\] where config.json's "
                                              rf"model has \[{VOCAB + 3}, 64\]( \(and 1 more tensors\))?: these "
                                              "weights are not this config's$"):  # fmt: skip
        check(folder)


def test_float16_is_refused_on_weights_stored_in_a_wider_range(tmp_path):
    """bf16 weights may exceed float16's 65504; a float16 folder loads in float16."""
    with pytest.raises(CheckpointError, match=r"^model.dtype float16: .*model-0000\d-of-0000\d.safetensors stores its "
                                              r"weights in bfloat16, whose range float16 can't hold .*; use "
                                              r"model.dtype bfloat16 or float32$"):  # fmt: skip
        check(saved("tiny-llama", vocab_size=VOCAB), torch.float16)
    check(saved("tiny-llama", vocab_size=VOCAB, dtype=torch.float16), torch.float16)

