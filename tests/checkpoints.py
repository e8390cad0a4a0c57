"""Tiny models saved as published checkpoints are, for the tests to load as users load theirs.

A user's model is a `save_pretrained` folder (bf16, sharded safetensors) read with
`from_pretrained`; a model built from its config skips the loading path entirely (meta-device
builds, hub-kernel wrappers, dtype handling), and the torch engine once passed every test built
that way while failing on every saved folder. So the training tests name a folder:

    from checkpoints import saved
    cfg.model.name = str(saved("tiny-llama", vocab_size=97))   # a folder, as a user's model.name

Each folder is written once (seeded init, cast to bf16, shards of SHARD_BYTES) under
.cache/tiny-checkpoints/<name>-<key>, keyed by everything that decides its bytes (the config's
JSON, transformers' and torch's versions), and replaced whole (tmp + rename), so Ray workers and
concurrent test processes may all ask for it: the first writes, the rest read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from paths import REPO

ROOT = REPO / ".cache" / "tiny-checkpoints"
SHARD_BYTES = 100_000
"""Small enough that every tiny model is saved in several shards (model.safetensors.index.json),
as every published checkpoint above a few GB is."""


def config_of(name: str, vocab_size: int = 1024, **overrides: Any):
    """The config `load_model(name)` builds from (`tiny-<family>` or a tiny VLM), with `overrides`."""
    from raypack.model.build import model_config

    config = model_config(name, vocab_size=vocab_size)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def saved(name: str = "tiny-llama", *, vocab_size: int = 1024, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          **overrides: Any) -> Path:
    """The folder of `name`'s tiny model (random init from `seed`), saved in `dtype` and sharded."""
    return saved_config(config_of(name, vocab_size, **overrides), name, dtype=dtype, seed=seed)


def saved_config(config, name: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """The folder of a model built from `config` (random init from `seed`), saved as `saved` saves
    one; `name` starts the folder's name (the layouts of tests/families.py, named by family)."""
    import transformers

    key = hashlib.sha256("\n".join([config.to_json_string(), str(dtype), str(seed), transformers.__version__,
                                    torch.__version__]).encode()).hexdigest()[:12]  # fmt: skip
    folder = ROOT / f"{name}-{key}"
    if (folder / "config.json").exists():
        return folder
    ROOT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ROOT, prefix=f".{name}-"))
    try:
        _build(config, seed).to(dtype).save_pretrained(tmp, max_shard_size=SHARD_BYTES)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process saved it first: theirs is the same bytes
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build(config, seed: int):
    """transformers' own model of `config`, initialised from `seed` in fp32 (as `load_model` builds a tiny one)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from raypack.model.facts import describe

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if describe(config).vlm else AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32)


TOKENIZER_VOCAB = 768
"""The bundled tokenizer's size (raypack/assets/tokenizer): the vocabulary a tiny model gets when
a config names `tiny-<family>` (raypack/data/prepare.py), and so the saved folders' here."""


def as_user(name: str = "tiny-llama", **overrides: Any) -> list[str]:
    """The config overrides that train `name` as a user trains a published model: its saved folder,
    read in bf16 (`model.dtype: bfloat16`, what a GPU run computes in)."""
    return [f"model.name={saved(name, vocab_size=TOKENIZER_VOCAB, **overrides)}", "model.dtype=bfloat16"]
