"""Every model family raypack is tried on, as a tiny config (hidden 64, 2-4 layers): the rows of
tests/unit/model/test_families.py (exact on packed rows, or refused) and of the
sequence-parallel checks (tests/unit/model/test_ulysses.py).

To check a family a newer transformers adds: add a row to FAMILIES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import transformers

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
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)  # fmt: skip
"""Gated delta rule layers: value heads grouped over key heads, as Qwen3.5 ships them."""
MAMBA2 = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8)
MAMBA2_BAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                    mamba_expand=1, mamba_chunk_size=8)  # fmt: skip
MAMBA2_ZAMBA = dict(n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, mamba_d_conv=4, mamba_expand=1, chunk_size=8)
DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=4, n_group=1, topk_group=1)
INDEXER = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)
"""Mamba-2 layers, in each config's own names: 4 heads of 16, state 8, 2 groups, chunks of 8."""


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
    split_refused: str | None = None
    """For a family that packs exactly: a regex the refusal of train.sequence_parallel > 1 must match."""
    tolerance: float = TOLERANCE
    """The largest relative error accepted; above TOLERANCE only where rounding is shown to be the cause."""

    def build_config(self, family: str):
        module = importlib.import_module(f"transformers.models.{self.module or family}")
        cls = getattr(transformers, self.config, None) or getattr(module, self.config)
        kwargs = {**COMMON, **self.overrides}
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


WINDOW = {"sliding_window": 8}
HYBRID = {"split_refused": r"sequence_parallel.*state passed along"}
"""A convolution or recurrence over the row can't follow it split across ranks."""
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
    # its decoder layers drop the attention kwargs: cu_seqlens are derived from position_ids
    "nemotron": Family("NemotronConfig", split_refused=r"don't pass the forward's attention keyword arguments"),
    "persimmon": Family("PersimmonConfig"),
    "diffllama": Family("DiffLlamaConfig"),
    # 2025-2026 dense releases
    "seed_oss": Family("SeedOssConfig"),
    "arcee": Family("ArceeConfig"),
    "hunyuan_v1_dense": Family("HunYuanDenseV1Config"),
    "ministral3": Family("Ministral3Config"),
    # xIELU's alpha_p is one scalar whose gradient sums every token's term; with seed 0 layer 1's
    # cancels to 1.4e-3 (the others are ~1), where packed and alone differ by 4.5e-5 and two
    # unpacked runs that differ only in rounding (eager against sdpa attention) by 1.7e-4
    # (seeds 1 and 2: under 1e-6 for both).
    "apertus": Family("ApertusConfig", tolerance=5e-5),
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
    "gemma4": Family("Gemma4TextConfig", {**WINDOW, "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16}),
    "ministral": Family("MinistralConfig", WINDOW),
    "cwm": Family("CwmConfig", WINDOW),
    # MoE (routing per token)
    "mixtral": Family("MixtralConfig", {**MOE, **WINDOW}),
    "qwen2_moe": Family("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": Family("Qwen3MoeConfig", MOE),
    "olmoe": Family("OlmoeConfig", MOE),
    "granitemoe": Family("GraniteMoeConfig", MOE),
    "phimoe": Family("PhimoeConfig", MOE),
    "ernie4_5_moe": Family("Ernie4_5_MoeConfig", {**MOE, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
                                                  "moe_layer_start_index": 0}),  # fmt: skip
    "minimax_m2": Family("MiniMaxM2Config", MOE),
    "hunyuan_v1_moe": Family("HunYuanMoEV1Config", MOE),
    "exaone_moe": Family("ExaoneMoeConfig", MOE),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", MOE),
    "dots1": Family("Dots1Config", {**MOE, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                                    "topk_group": 1}),  # fmt: skip
    # GLM-4.5: DeepSeek-V3's sigmoid router with a bias-corrected top-k, a dense first layer
    "glm4_moe": Family("Glm4MoeConfig", {**MOE, "first_k_dense_replace": 1, "n_shared_experts": 1,
                                         "num_hidden_layers": 3}),  # fmt: skip
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
    # hybrids: token mixers other than attention, each example through the layer alone
    # (raypack/model/mixers.py); examples (up to 21 tokens) longer than the scans' chunks (8)
    "qwen3_5": Family("Qwen3_5TextConfig", {**GDN, "layer_types": ["linear_attention", "full_attention"]}, **HYBRID),
    # A_log's gradient sums every token's decay term with cancellation, in the gated delta rule's
    # fp32 (whatever the model's dtype), and amplifies rounding elsewhere: the experts' grouped
    # matmul rounds by group size, so the packed row (one group per expert) and the examples alone
    # differ there by up to 1.8e-5 (3.7e-6 with eager experts, 8e-7 and 9e-7 with seeds 1 and 2).
    # Two unpacked runs differing only in rounding (eager against sdpa attention, examples of up
    # to 500 tokens, hidden 256) differ in it by 3.5e-5.
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", {**GDN, **MOE, "shared_expert_intermediate_size": 32,
                                                   "layer_types": ["linear_attention", "full_attention"]},
                          tolerance=5e-5, **HYBRID),  # fmt: skip
    "qwen3_next": Family("Qwen3NextConfig", {**GDN, **MOE, "layer_types": ["linear_attention", "full_attention"]},
                         **HYBRID),  # fmt: skip
    "lfm2": Family("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, **HYBRID),
    "lfm2_moe": Family("Lfm2MoeConfig", {**MOE, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
                       **HYBRID),  # fmt: skip
    "lfm3": Family("Lfm3Config", {"layer_types": ["conv", "full_attention"]}, **HYBRID),
    "nemotron_h": Family("NemotronHConfig", {**MAMBA2, "layers_block_type": ["mamba", "attention"],
                                             "num_hidden_layers": None}, **HYBRID),  # fmt: skip
    "bamba": Family("BambaConfig", {**MAMBA2_BAMBA, "attn_layer_indices": [1]}, **HYBRID),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", {**MOE, **MAMBA2_BAMBA, "layer_types": ["mamba", "attention"]},
                               **HYBRID),  # fmt: skip
    "falcon_h1": Family("FalconH1Config", {**MAMBA2_BAMBA, "mamba_d_ssm": 64}, **HYBRID),
    "zamba2": Family("Zamba2Config", {**MAMBA2_ZAMBA, "layers_block_type": ["mamba", "hybrid"]}, **HYBRID),
    "olmo_hybrid": Family("OlmoHybridConfig", {**GDN, "layer_types": ["linear_attention", "full_attention"]},
                          **HYBRID),  # fmt: skip
    # refused: token mixers raypack doesn't keep exact, which see the whole row
    "jamba": Family("JambaConfig", MOE, refused=r"convolution over the sequence"),
    # Kimi-Linear's and Bailing's KDA (a delta rule with per-channel decay and three convolutions)
    "kimi_linear": Family("KimiLinearConfig", {**MOE, **MLA, "linear_num_heads": 4, "linear_head_dim": 16,
                                               "layer_types": ["linear_attention", "full_attention"]},
                          refused=r"linear_attention"),  # fmt: skip
    "bailing_hybrid": Family("BailingHybridConfig", {**MOE, **MLA,
                                                     "layer_types": ["linear_attention", "full_attention"]},
                             refused=r"linear_attention"),  # fmt: skip
    # sparse attention over compressed keys (an indexer picks blocks): not raypack's attention.
    # mixes=False: Qwen4-exp's gated delta rule's torch path refuses cu_seqlens itself; DeepSeek-V4's
    # compressed keys lie beyond the row, which raypack's attention can't even run
    "qwen4_exp": Family("Qwen4ExpTextConfig", {**GDN, **MOE, **INDEXER,
                                               "layer_types": ["linear_attention", "indexed_attention"]},
                        refused=r"indexed_attention", mixes=False),  # fmt: skip
    "deepseek_v4": Family("DeepseekV4Config", {**MOE, "layer_types": ["heavily_compressed_attention",
                                                                      "compressed_sparse_attention"]},
                          refused=r"compressed", mixes=False),  # fmt: skip
    # DeepSeek Sparse Attention: a lightning indexer picks each query's top-k keys over the row.
    # mixes=False: the indexer scores against the 4D mask, which a packed row doesn't carry
    "deepseek_v32": Family("DeepseekV32Config", {**MOE, **MLA, **DSA, "first_k_dense_replace": 1, "n_shared_experts": 1},
                           refused=r"indexed_attention", mixes=False),  # fmt: skip
    "glm_moe_dsa": Family("GlmMoeDsaConfig", {**MOE, **MLA, **DSA, "first_k_dense_replace": 1, "n_shared_experts": 1},
                          refused=r"indexed_attention", mixes=False),  # fmt: skip
    "recurrent_gemma": Family("RecurrentGemmaConfig", refused=r"convolution over the sequence"),
    "bert": Family("BertConfig", {"is_decoder": False}, refused=r"bidirectional attention", mixes=False),
    # BERT as a decoder is causal
    "bert_decoder": Family("BertConfig", {"is_decoder": True}, module="bert"),
    # refused: attention that doesn't go through transformers' AttentionInterface (StableLM does
    # call the interface, but its class doesn't declare it, so transformers makes no promise)
    "stablelm": Family("StableLmConfig", refused=r"AttentionInterface", mixes=False),
    "falcon": Family("FalconConfig", {"head_dim": None, "num_kv_heads": 2, "new_decoder_architecture": True},
                     refused=r"AttentionInterface", mixes=False),  # fmt: skip
}
