"""Every model family raypack is tried on: exact on packed rows, or refused before training.

For each family a tiny model (hidden 64, 2-4 layers) is built from a config. Families raypack
accepts must give, through its exact CPU path (`attention='sdpa_varlen'`) on two packed rows,
the same logits, summed loss and every parameter gradient as each example run alone under
transformers' own `eager` attention with the same weights, within 1e-5 relative in fp32 (the
packed and unpacked sums run in different orders; the largest error seen here is under 2e-6).
Families with a trait raypack can't keep exact must raise UnsupportedModelError naming it, on
the driver's meta-device check and in load_model; for those, the same comparison with the check
bypassed shows the trait really mixes examples, so no refusal here is spurious.

Windows (8) and chunks (8) are shorter than the examples (up to 21 tokens). Models run in eval
mode: MoE routers with jitter or sampling in training mode draw per token, which no two runs
share. Routers pick experts per token here (no capacity, no token dropping), so packing can't
change routing; router aux losses are not part of raypack's loss (token cross-entropy).

To check a family a newer transformers adds: add a row to FAMILIES.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers
from exactness import packed_vs_alone
from transformers import AutoModelForCausalLM

from raypack.config import PeftConfig
from raypack.model.adapters import apply_adapters
from raypack.model.attention import NAMES
from raypack.model.build import UnsupportedModelError, check_model, load_model

TOLERANCE = 1e-5
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    initializer_range=0.1, use_cache=False,
)  # fmt: skip
"""Sizes every family gets; a family's row overrides them (None drops a key its config lacks)."""
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=16)  # fmt: skip


@dataclass(frozen=True)
class Family:
    config: str
    """The transformers config class."""
    overrides: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    """None: must be exact. Else a regex the refusal must match (the trait it names)."""
    mixes: bool = True
    """For a refused family: show, with the check bypassed, that packing really is wrong."""
    module: str | None = None
    """transformers.models.<module>, when it isn't the row's id."""

    def build_config(self, family: str):
        module = importlib.import_module(f"transformers.models.{self.module or family}")
        cls = getattr(transformers, self.config, None) or getattr(module, self.config)
        kwargs = {**COMMON, **self.overrides}
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


WINDOW = {"sliding_window": 8}
FAMILIES: dict[str, Family] = {
    # dense, full attention
    "llama": Family("LlamaConfig"),
    "qwen3": Family("Qwen3Config"),
    "gemma": Family("GemmaConfig"),
    "phi3": Family("Phi3Config"),
    "phi": Family("PhiConfig"),
    "olmo": Family("OlmoConfig"),
    "olmo2": Family("Olmo2Config"),
    "granite": Family("GraniteConfig"),
    "cohere": Family("CohereConfig"),
    "glm4": Family("Glm4Config"),
    "gpt_neox": Family("GPTNeoXConfig"),
    "gpt2": Family("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
    "helium": Family("HeliumConfig"),
    "ernie4_5": Family("Ernie4_5Config"),
    "nemotron": Family("NemotronConfig"),
    "persimmon": Family("PersimmonConfig"),
    "diffllama": Family("DiffLlamaConfig"),
    # sliding windows shorter than the examples; Gemma2 also softcaps
    "mistral": Family("MistralConfig", WINDOW),
    "qwen2": Family("Qwen2Config", {**WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    "gemma2": Family("Gemma2Config", {**WINDOW, "query_pre_attn_scalar": 16}),
    "gemma3": Family("Gemma3TextConfig", {**WINDOW, "query_pre_attn_scalar": 16,
                                          "layer_types": ["sliding_attention", "full_attention"]}),  # fmt: skip
    "gemma3n": Family("Gemma3nTextConfig", {**WINDOW, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                                            "layer_types": ["sliding_attention", "full_attention"] * 2,
                                            "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 512,
                                            "laurel_rank": 8, "altup_num_inputs": 2,
                                            "activation_sparsity_pattern": [0.0] * 4}),  # fmt: skip
    "olmo3": Family("Olmo3Config", WINDOW),
    "cohere2": Family("Cohere2Config", WINDOW),
    "starcoder2": Family("Starcoder2Config", WINDOW),
    "exaone4": Family("Exaone4Config", {**WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    # MoE (routing per token)
    "mixtral": Family("MixtralConfig", {**MOE, **WINDOW}),
    "qwen2_moe": Family("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": Family("Qwen3MoeConfig", MOE),
    "olmoe": Family("OlmoeConfig", MOE),
    "granitemoe": Family("GraniteMoeConfig", MOE),
    "phimoe": Family("PhimoeConfig", MOE),
    # MLA (DeepSeek-V2/V3 also MoE with a dense first layer and shared experts)
    "deepseek_v2": Family("DeepseekV2Config", {**MOE, **MLA, "first_k_dense_replace": 1, "n_shared_experts": 1}),
    "deepseek_v3": Family("DeepseekV3Config", {**MOE, **MLA, "first_k_dense_replace": 1, "n_shared_experts": 1,
                                               "n_group": 2, "topk_group": 1}),  # fmt: skip
    "minicpm3": Family("MiniCPM3Config", MLA),
    # NoPE layers; Llama 4 also chunked attention (its RoPE layers) and MoE
    "smollm3": Family("SmolLM3Config", {"no_rope_layers": [1, 0]}),
    "llama4": Family("Llama4TextConfig", {**MOE, "intermediate_size_mlp": 128, "attention_chunk_size": 8,
                                          "no_rope_layers": [1, 0], "interleave_moe_layer_step": 1}),  # fmt: skip
    # attention sinks (s_aux), alternating sliding layers, MoE
    "gpt_oss": Family("GptOssConfig", {**MOE, **WINDOW}),
    # refused: token mixers other than attention, which see the whole row
    "lfm2": Family("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, refused=r"layer_types conv.*mix"),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", {**MOE, "layer_types": ["mamba", "attention"],
                                                          "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
                                                          "mamba_expand": 1}, refused=r"linear_attention"),  # fmt: skip
    "jamba": Family("JambaConfig", MOE, refused=r"convolution over the sequence"),
    "recurrent_gemma": Family("RecurrentGemmaConfig", refused=r"convolution over the sequence"),
    "qwen3_next": Family("Qwen3NextConfig", MOE, refused=r"linear_attention", mixes=False),  # its own check raises
    "bert": Family("BertConfig", {"is_decoder": False}, refused=r"bidirectional attention", mixes=False),
    # BERT as a decoder is causal
    "bert_decoder": Family("BertConfig", {"is_decoder": True}, module="bert"),
    # refused: attention that doesn't go through transformers' AttentionInterface (StableLM does
    # call the interface, but its class doesn't declare it, so transformers makes no promise)
    "stablelm": Family("StableLmConfig", refused=r"AttentionInterface", mixes=False),
    "falcon": Family("FalconConfig", {"head_dim": None, "num_kv_heads": 2, "new_decoder_architecture": True},
                     refused=r"AttentionInterface", mixes=False),  # fmt: skip
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all overhead: two threads on a shared 2-core host only fight (3x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _packed_model(config):
    """The family under raypack's exact path with no check: what a packed run would compute."""
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAMES["sdpa_varlen"]).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_or_refused(family):
    spec = FAMILIES[family]
    config = spec.build_config(family)
    torch.manual_seed(0)
    if spec.refused:
        with pytest.raises(UnsupportedModelError, match=spec.refused):
            check_model(config, attention="auto", device_type="cpu")
        with pytest.raises(UnsupportedModelError, match=r"\(pad or pad_sorted\)"):
            load_model(config, attention="sdpa_varlen", dtype="float32")
        if spec.mixes:
            model = _packed_model(config)
            ref = load_model(config, attention="eager", dtype="float32").eval()
            ref.load_state_dict(model.state_dict())
            assert packed_vs_alone(model, ref)["logits"] > 1e-3, "refused, yet packing looks exact"
        return

    model = load_model(config, attention="sdpa_varlen", dtype="float32").eval()
    assert model.config._attn_implementation == NAMES["sdpa_varlen"]
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family}: {worst} off by {errors[worst]:.2e} (all: {errors})"
    assert any(k.startswith("grad:") for k in errors)


LORA = PeftConfig(method="lora", r=4, alpha=8, target_modules=("all-linear",))


def _with_random_adapters(model):
    """`model` with LoRA on every linear layer but the head, B random: peft starts B at zero, and
    with B = 0 every lora_A gradient is zero, which any path would match."""
    wrapped = apply_adapters(model, LORA)
    g = torch.Generator().manual_seed(1)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    return wrapped


@pytest.mark.parametrize("family", [f for f, spec in FAMILIES.items() if not spec.refused])
def test_family_with_lora_is_exact(family):
    """LoRA on attention and MLP projections: every adapter gradient packed equals the gradient of
    the same examples run alone, and the base weights get none."""
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    model = _with_random_adapters(load_model(config, attention="sdpa_varlen", dtype="float32")).eval()
    ref = apply_adapters(load_model(config, attention="eager", dtype="float32"), LORA).eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} + LoRA: {worst} off by {errors[worst]:.2e}"
    graded = {k.removeprefix("grad:") for k in errors if k.startswith("grad:")}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert graded == adapters and any("lora_A" in n for n in graded), f"{family}: gradients reached {graded - adapters}"
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
