"""A model on shared storage: `model.name=/mnt/...` and `tokenize.tokenizer=/mnt/...`, the same
path on every node, with HF_HUB_OFFLINE=1 so no node reaches the hub. Checked with a local folder
standing in for the mount, in a fresh process so that the offline switch is read at import as on
a cluster node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "raypack" / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory) -> Path:
    """A tiny random Llama and the bundled tokenizer, saved as `save_pretrained` lays them out."""
    from transformers import AutoTokenizer

    from raypack.model.build import load_model

    folder = tmp_path_factory.mktemp("mnt") / "models" / "tiny-llama"
    model = load_model("tiny-llama", attention="sdpa", dtype="float32", vocab_size=768)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def offline(code: str, cwd: Path) -> subprocess.CompletedProcess:
    # An empty HF_HOME: nothing can come from a cache either, only from the shared path.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "HF_HOME": str(cwd / "hf-home")}
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_model_and_tokenizer_load_from_a_shared_path_offline(shared_model, tmp_path):
    code = f"""
from raypack.config import load
from raypack.data.encode import load_tokenizer
from raypack.model.build import load_model
cfg = load({str(REPO / 'jobs/configs/tiny_cpu.yaml')!r}, ["model.name={shared_model}", "tokenize.tokenizer={shared_model}"])
tok = load_tokenizer(cfg.tokenize.tokenizer)
model = load_model(cfg.model.name, attention=cfg.model.attention, dtype=cfg.model.dtype)
ids = tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=True)
ids = ids["input_ids"] if hasattr(ids, "keys") else ids
import torch
out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])
print("OK", type(model).__name__, out.logits.shape[-1], model.config.use_cache)
"""
    result = offline(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-4:] == ["OK", "LlamaForCausalLM", "768", "False"]


def test_offline_mode_is_really_on(tmp_path):
    # The same process setup refuses a hub name it has no local copy of, without any network
    # call: what a node without hub access does when model.name is not a shared path.
    code = "from raypack.model.build import load_model; load_model('meta-llama/Llama-3.1-8B')"
    result = offline(code, tmp_path)
    assert result.returncode != 0
    # huggingface_hub's own words when HF_HUB_OFFLINE is on (a network failure reads otherwise).
    assert "outgoing traffic has been disabled" in result.stderr, result.stderr[-2000:]
