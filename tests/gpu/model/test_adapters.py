"""LoRA and QLoRA on CUDA: adapter gradients on packed rows against each example alone, with the
varlen kernels in bf16, and QLoRA's 4-bit base (bitsandbytes) under the same check.

Both are marked `gpu` (skipped without CUDA); QLoRA also skips without bitsandbytes.
"""

from __future__ import annotations

import pytest
import torch
from exactness import packed_vs_alone, random_lora_b

from raypack.config import PeftConfig
from raypack.model.adapters import apply_adapters, frozen_digest, quantization_config
from raypack.model.build import load_model, tiny_config

pytestmark = pytest.mark.gpu

LENGTHS = ([300, 41, 1, 150], [500, 77])
LORA = PeftConfig(method="lora", r=8, alpha=16)
SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512)


def _adapter_errors(errors):
    return {k: v for k, v in errors.items() if k.startswith("grad:") and "lora_" in k}


@pytest.mark.parametrize("attention", ["auto", "sdpa_varlen"])
def test_lora_bf16_varlen_matches_examples_alone(attention):
    torch.manual_seed(0)
    config = tiny_config("llama", **SIZES)
    model = random_lora_b(apply_adapters(load_model(config, attention=attention, dtype="bfloat16").cuda(), LORA), scale=0.05)
    ref = apply_adapters(load_model(config, attention="eager", dtype="bfloat16").cuda(), LORA)
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model.eval(), ref.eval(), lengths=LENGTHS, device="cuda")
    grads = _adapter_errors(errors)
    assert grads and errors["logits"] < 2e-2 and max(grads.values()) < 5e-2, errors


def test_qlora_adapters_are_exact_and_the_4bit_base_is_untouched(tmp_path):
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    load_model(tiny_config("llama", **SIZES), dtype="bfloat16").save_pretrained(tmp_path / "base")
    quant = quantization_config(torch.bfloat16)
    model = random_lora_b(apply_adapters(load_model(str(tmp_path / "base"), dtype="bfloat16", quantization=quant), LORA), scale=0.05)
    ref = apply_adapters(load_model(str(tmp_path / "base"), attention="eager", dtype="bfloat16", quantization=quant), LORA)
    # the same checkpoint quantizes the same way; the adapters are what differs
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    before = frozen_digest(model)
    errors = packed_vs_alone(model.eval(), ref.eval(), lengths=LENGTHS, device="cuda")
    grads = _adapter_errors(errors)
    assert grads and errors["logits"] < 2e-2 and max(grads.values()) < 5e-2, errors
    assert frozen_digest(model) == before
    assert any(p.dtype == torch.uint8 for p in model.parameters()), "the base was not quantized"
