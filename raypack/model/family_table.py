"""The rows of the supported-models table (raypack/model/families.py reads them), and the record
each is written in: every family raypack is tried on, at hidden 64 and 2-6 layers, in the layouts
its published checkpoints use.

A row's id is the transformers model type; `<type>-<name>` is a further published layout of it.
Where a layout is a config class's defaults, transformers documents those defaults as the named
checkpoint's (its `auto_docstring(checkpoint=...)`), so the class is the source. MTP layers
(DeepSeek-V3, GLM-4.5, Qwen3.5, Qwen3-Next, Bailing) are not built by transformers 5.24 (their
weights are skipped on load): they train nothing, and no row can test them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import transformers
from packaging.version import Version

TOLERANCE = 1e-5
"""The largest relative error accepted between a packed row and its examples alone (fp32)."""

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    initializer_range=0.1, use_cache=False,
)  # fmt: skip
"""Sizes every family gets; a family's row overrides them (None drops a key its config lacks)."""


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
    """transformers.models.<module>, when it isn't the row's id before any `-<layout>`."""
    split_refused: str | None = None
    """For a family that packs exactly: a regex the refusal of train.sequence_parallel > 1 must match."""
    tolerance: float = TOLERANCE
    """The largest relative error accepted; above TOLERANCE only where rounding is shown to be the cause."""
    layout: str = ""
    """The layer layout the row builds, in words (the supported-models page's)."""
    source: str = ""
    """Where that layout comes from: the config class's defaults (which transformers documents as a
    checkpoint's), a model card, or why the row is no published layout."""

    def module_name(self, key: str) -> str:
        return self.module or key.split("-")[0]

    def build_config(self, key: str):
        module = importlib.import_module(f"transformers.models.{self.module_name(key)}")
        cls = getattr(transformers, self.config, None) or getattr(module, self.config)
        kwargs = {**COMMON, **self.overrides}
        return cls(**{k: v for k, v in kwargs.items() if v is not None})



MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=16)  # fmt: skip
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)  # fmt: skip
"""Gated delta rule layers: value heads grouped over key heads, as Qwen3.5 ships them."""
MAMBA2 = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8)
MAMBA2_BAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                    mamba_expand=1, mamba_chunk_size=8)  # fmt: skip
MAMBA2_ZAMBA = dict(n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, mamba_d_conv=4, mamba_expand=1, chunk_size=8,
                    head_dim=32)  # fmt: skip
"""Mamba-2 layers, in each config's own names: 4 heads of 16, state 8, 2 groups, chunks of 8 (and
Zamba 2's shared attention on twice the hidden size, as its checkpoints: heads of 2 x 64 / 4)."""
DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=4, n_group=1, topk_group=1)
INDEXER = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)
KDA = dict(linear_num_heads=4, linear_head_dim=16)
WINDOW = {"sliding_window": 8}
_MAMBA2_DROPS = Version(transformers.__version__) < Version("5.25")
"""Whether the installed Mamba2ForCausalLM drops the row's boundaries (the `mamba2` row)."""

HYBRID = {"split_refused": r"sequence_parallel.*state passed along"}
"""A convolution or recurrence over the row can't follow it split across ranks."""
LA, FA = "linear_attention", "full_attention"
THREE_TO_ONE = [LA, LA, LA, FA]
"""Three linear-attention (gated delta rule or KDA) layers to one attention layer: Qwen3.5's,
Qwen3-Next's and OLMo-hybrid's `full_attention_interval` 4, Kimi-Linear's KDA to MLA."""

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
    "mixtral": Family("MixtralConfig", MOE, layout="every layer MoE (8 experts, top 2), no sliding window",
                      source="MixtralConfig defaults (mistralai/Mixtral-8x7B-v0.1)"),
    "qwen2_moe": Family("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32},
                        layout="every layer MoE and a gated shared expert",
                        source="Qwen2MoeConfig defaults (Qwen/Qwen1.5-MoE-A2.7B)"),
    "qwen3_moe": Family("Qwen3MoeConfig", {**MOE, "norm_topk_prob": True},
                        layout="every layer MoE (decoder_sparse_step 1), no shared expert, top-k renormalized",
                        source="Qwen3MoeConfig defaults (Qwen/Qwen3-30B-A3B-Base); norm_topk_prob from its config.json"),
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
                                         "num_hidden_layers": 3},
                       layout="a dense first layer, then MoE with one shared expert; 1 MTP layer (not built)",
                       source="Glm4MoeConfig defaults (zai-org/GLM-4.5: first_k_dense_replace 1, n_shared_experts 1, "
                              "num_mtp_layers 1)"),  # fmt: skip
    # MLA (DeepSeek-V2/V3 also MoE with dense first layers and shared experts)
    "deepseek_v2": Family("DeepseekV2Config", {**MOE, **MLA, "first_k_dense_replace": 1, "n_shared_experts": 2},
                          layout="MLA; a dense first layer, then MoE with two shared experts",
                          source="deepseek-ai/DeepSeek-V2-Lite's config.json (first_k_dense_replace 1, n_shared_experts 2)"),
    "deepseek_v3": Family("DeepseekV3Config", {**MOE, **MLA, "first_k_dense_replace": 2, "n_shared_experts": 1,
                                               "n_group": 2, "topk_group": 1, "num_hidden_layers": 3},
                          layout="MLA; dense first layers, then MoE with one shared expert and grouped top-k; "
                                 "1 MTP layer (not built)",
                          source="DeepseekV3Config defaults (61 layers, first_k_dense_replace 3, n_shared_experts 1, "
                                 "n_group 8 / topk_group 4, num_mtp_layers 1)"),  # fmt: skip
    "minicpm3": Family("MiniCPM3Config", MLA),
    # NoPE layers; Llama 4 also chunked attention (its RoPE layers) and MoE
    "smollm3": Family("SmolLM3Config", {"no_rope_layers": [1, 0]}),
    "llama4": Family("Llama4TextConfig", {**MOE, "intermediate_size_mlp": 128, "attention_chunk_size": 8,
                                          "no_rope_layers": [1, 0], "interleave_moe_layer_step": 1},
                     layout="every layer MoE with a shared expert; chunked attention beside NoPE layers",
                     source="Llama4TextConfig defaults (meta-llama/Llama-4-Scout-17B-16E)"),  # fmt: skip
    "llama4-maverick": Family("Llama4TextConfig", {**MOE, "intermediate_size_mlp": 128, "attention_chunk_size": 8,
                                                   "num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
                                                   "interleave_moe_layer_step": 2},
                              layout="dense and MoE layers alternating (interleave_moe_layer_step 2)",
                              source="Llama 4 Maverick: MoE in every other block (Megatron-LM's moe-layer-freq "
                                     "`[0,1]*24` for meta-llama/Llama-4-Maverick-17B-128E)"),  # fmt: skip
    # attention sinks (s_aux), alternating sliding layers, MoE
    "gpt_oss": Family("GptOssConfig", {**MOE, **WINDOW},
                      layout="sliding and full attention alternating, sinks, every layer MoE",
                      source="GptOssConfig defaults (openai/gpt-oss-20b)"),
    # hybrids: token mixers other than attention, each example through the layer alone
    # (raypack/model/mixers.py); examples (up to 21 tokens) longer than the scans' chunks (8)
    # A_log's gradient sums every token's decay term with cancellation, in the gated delta rule's
    # fp32 (whatever the model's dtype), and amplifies rounding elsewhere. With three such layers
    # (seed 0) the packed row and the examples alone differ in it by 1.2e-5 (Qwen3.5) and 1.3e-5
    # (Qwen3-Next), seeds 1 and 2 up to 1.8e-5; the examples alone under eager and under sdpa
    # attention, which differ only in rounding, by up to 1.3e-5 and 8.4e-6. In Qwen3.5-MoE the
    # experts' grouped matmul rounds by group size too, so the packed row (one group per expert)
    # and the examples alone differ there by up to 1.8e-5 (3.7e-6 with eager experts); two unpacked
    # runs differing only in rounding (examples of up to 500 tokens, hidden 256) by 3.5e-5.
    "qwen3_5": Family("Qwen3_5TextConfig", {**GDN, "num_hidden_layers": 4, "layer_types": THREE_TO_ONE},
                      layout="gated delta rule and attention 3:1; 1 MTP layer (not built)",
                      source="Qwen3_5TextConfig defaults (Qwen/Qwen3.5-27B: full_attention_interval 4)", tolerance=5e-5,
                      **HYBRID),  # fmt: skip
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", {**GDN, **MOE, "shared_expert_intermediate_size": 32,
                                                   "num_hidden_layers": 4, "layer_types": THREE_TO_ONE},
                          layout="gated delta rule and attention 3:1, every layer MoE with a shared expert",
                          source="Qwen3_5MoeTextConfig defaults (Qwen/Qwen3.5-35B-A3B)", tolerance=5e-5,
                          **HYBRID),  # fmt: skip
    "qwen3_next": Family("Qwen3NextConfig", {**GDN, **MOE, "shared_expert_intermediate_size": 32,
                                             "num_hidden_layers": 4, "layer_types": THREE_TO_ONE},
                         layout="gated delta rule and attention 3:1, every layer MoE with a shared expert",
                         source="Qwen3NextConfig defaults (Qwen/Qwen3-Next-80B-A3B-Instruct)", tolerance=5e-5,
                         **HYBRID),  # fmt: skip
    "olmo_hybrid": Family("OlmoHybridConfig", {**GDN, "num_hidden_layers": 4, "layer_types": THREE_TO_ONE},
                          layout="gated delta rule and attention 3:1",
                          source="OlmoHybridConfig defaults (allenai/Olmo-Hybrid-7B)", **HYBRID),
    "lfm2": Family("Lfm2Config", {"num_hidden_layers": 4, "layer_types": ["conv", "conv", FA, "conv"]},
                   layout="short convolutions with attention among them, tied embeddings",
                   source="LFM2-1.2B: attention at layers 2, 5, 8, 10, 12, 14 of 16 (full_attn_idxs), "
                          "tie_embedding (Lfm2Config's default)", **HYBRID),  # fmt: skip
    "lfm2_moe": Family("Lfm2MoeConfig", {**MOE, "num_hidden_layers": 4, "layer_types": ["conv", "conv", FA, "conv"],
                                         "num_dense_layers": 2},
                       layout="short convolutions and attention about 3:1, two dense first layers, then MoE; tied",
                       source="Lfm2MoeConfig defaults (LiquidAI/LFM2-8B-A1B: num_dense_layers 2); Liquid's "
                              "LFM2-24B-A2B post: the 8B's recipe, attention to convolution about 1:3",
                       **HYBRID),  # fmt: skip
    "lfm3": Family("Lfm3Config", {**WINDOW, "num_hidden_layers": 4,
                                  "layer_types": ["conv", FA, "conv", "sliding_attention"]},
                   layout="short convolutions alternating with full and sliding attention, tied",
                   source="Lfm3Config defaults (LiquidAI/LFM3-1.7B)", **HYBRID),  # fmt: skip
    "nemotron_h": Family("NemotronHConfig", {**MAMBA2, "layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp"],
                                             "num_hidden_layers": None},
                         layout="Mamba-2 layers, MLP-only layers between them, one attention layer",
                         source="Nemotron-H 4B/8B: hybrid_override_pattern `M-M-M-M*-M-M-...` (M Mamba-2, - MLP, "
                                "* attention; Megatron-Bridge's Nemotron-H docs)", **HYBRID),  # fmt: skip
    "nemotron_h-nano3": Family("NemotronHConfig", {**MAMBA2, **MOE, "n_shared_experts": 1,
                                                   "moe_shared_expert_intermediate_size": 32, "num_hidden_layers": None,
                                                   "layers_block_type": ["mamba", "moe", "mamba", "attention", "moe"]},
                               layout="Mamba-2 and MoE layers alternating (one shared expert), one attention layer",
                               source="NemotronHConfig defaults (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16); its "
                                      "model card: 23 Mamba-2 and 23 MoE layers (128 experts + 1 shared), 6 attention",
                               **HYBRID),  # fmt: skip
    "nemotron_h-recurrent": Family("NemotronHConfig", {**MAMBA2, **MOE, "num_hidden_layers": None,
                                                       "moe_shared_expert_intermediate_size": 32,
                                                       "layers_block_type": ["mamba", "mlp", "mamba", "moe"]},
                                   layout="no attention layer: Mamba-2 layers between MLP and MoE layers",
                                   source="not a published checkpoint: a stack of mixers with nothing to route",
                                   **HYBRID),  # fmt: skip
    "bamba": Family("BambaConfig", {**MAMBA2_BAMBA, "num_hidden_layers": 4, "attn_layer_indices": [2]},
                    layout="Mamba-2 layers with a few attention layers among them, untied",
                    source="ibm-fms/Bamba-9B model card: 32 layers, 29 Mamba-2 and 3 attention, untied embeddings",
                    **HYBRID),  # fmt: skip
    "granitemoehybrid": Family("GraniteMoeHybridConfig", {**MOE, **MAMBA2_BAMBA, "num_hidden_layers": 4,
                                                          "shared_intermediate_size": 32, "tie_word_embeddings": True,
                                                          "layer_types": ["mamba", "mamba", "mamba", "attention"]},
                               layout="Mamba-2 and attention about 9:1, MoE beside a shared MLP in every layer, tied",
                               source="Granite 4.0-H-Small and -H-Tiny model cards: hybrid Mamba-2/transformer, "
                                      "fine-grained MoE with shared experts, shared input/output embeddings",
                               **HYBRID),  # fmt: skip
    "granitemoehybrid-micro": Family("GraniteMoeHybridConfig", {**MAMBA2_BAMBA, "num_local_experts": 0,
                                                                "shared_intermediate_size": 128, "num_hidden_layers": 4,
                                                                "tie_word_embeddings": True,
                                                                "layer_types": ["mamba", "mamba", "mamba", "attention"]},
                                     layout="Mamba-2 and attention, a dense MLP (no experts), tied",
                                     source="Granite 4.0-H-Micro model card: hybrid, dense feed-forward (no MoE)",
                                     **HYBRID),  # fmt: skip
    "falcon_h1": Family("FalconH1Config", {**MAMBA2_BAMBA, "mamba_d_ssm": 64},
                        layout="every layer attention and Mamba-2 in parallel",
                        source="FalconH1Config defaults (tiiuae/Falcon-H1-1.5B-Deep-Instruct)", **HYBRID),
    "zamba2": Family("Zamba2Config", {**MAMBA2_ZAMBA, "num_hidden_layers": 5, "tie_word_embeddings": True,
                                      "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "hybrid"]},
                     layout="Mamba-2 layers, every few a hybrid layer with the one shared attention block, tied",
                     source="Zamba2Config defaults (Zyphra/Zamba2-2.7B: hybrid every 6th layer, num_mem_blocks 1)",
                     **HYBRID),  # fmt: skip
    "zamba2-blocks": Family("Zamba2Config", {**MAMBA2_ZAMBA, "num_hidden_layers": 5, "tie_word_embeddings": True,
                                             "num_mem_blocks": 2, "use_shared_attention_adapter": True,
                                             "num_key_value_heads": None,  # its adapters add to k and v: no GQA
                                             "adapter_rank": 8, "use_mem_rope": True,
                                             "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"]},
                            layout="two shared attention blocks taken in turn, per-layer adapters on them, RoPE",
                            source="not one checkpoint's config: Zamba2Config's num_mem_blocks, "
                                   "use_shared_attention_adapter and use_mem_rope, which the 1.2B and 7B set",
                            **HYBRID),  # fmt: skip
    # KDA (a delta rule with a per-channel decay: raypack/model/mixers.py), MLA, MoE with a shared expert
    "kimi_linear": Family("KimiLinearConfig", {**MOE, **MLA, **KDA, "q_lora_rank": None, "num_hidden_layers": 4,
                                               "layer_types": THREE_TO_ONE,
                                               "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
                          layout="KDA and MLA 3:1, a dense first layer, then MoE with one shared expert",
                          source="KimiLinearConfig defaults (moonshotai/Kimi-Linear-48B-A3B-Instruct)", **HYBRID),
    # head_dim: Bailing's KDA heads are its attention heads (linear_head_dim = head_dim)
    "bailing_hybrid": Family("BailingHybridConfig", {**MOE, **MLA, "head_dim": 16, "num_hidden_layers": 4,
                                                     "layer_group_size": 4, "first_k_dense_replace": 2,
                                                     "n_shared_experts": 1, "n_group": 2, "topk_group": 1},
                             layout="groups of KDA layers closed by an MLA layer (5:1 published, 3:1 at this size; "
                                    "safe gate), two dense first layers, then MoE with a shared expert and grouped "
                                    "top-k; 1 MTP layer (not built)",
                             source="BailingHybridConfig defaults (inclusionAI/Ling-3.0-Flash: layer_group_size 6, "
                                    "first_k_dense_replace 2, kda_safe_gate)", **HYBRID),  # fmt: skip
    # refused: token mixers raypack doesn't keep exact, which see the whole row
    "jamba": Family("JambaConfig", MOE, refused=r"convolution over the sequence"),
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
    # pure Mamba-2: raypack's mixers, nothing to route and no positions to read. Up to transformers
    # 5.24 Mamba2ForCausalLM calls its backbone without the forward's keyword arguments, so the row's
    # boundaries never reach the mixers (test_traits.py): refused there, exact from 5.25
    "mamba2": Family("Mamba2Config", {"num_heads": 8, "state_size": 8, "n_groups": 2, "chunk_size": 8},
                     refused=r"calls self\.backbone without its keyword arguments" if _MAMBA2_DROPS else None,
                     layout="every layer Mamba-2, no attention", source="Mamba2Config", **HYBRID),  # fmt: skip
    "bert": Family("BertConfig", {"is_decoder": False}, refused=r"bidirectional attention", mixes=False),
    # BERT as a decoder is causal
    "bert_decoder": Family("BertConfig", {"is_decoder": True}, module="bert"),
    # refused: attention that doesn't go through transformers' AttentionInterface (StableLM does
    # call the interface, but its class doesn't declare it, so transformers makes no promise)
    "stablelm": Family("StableLmConfig", refused=r"AttentionInterface", mixes=False),
    "falcon": Family("FalconConfig", {"head_dim": None, "num_kv_heads": 2, "new_decoder_architecture": True},
                     refused=r"AttentionInterface", mixes=False),  # fmt: skip
}
"""Every row; keys are what tests, the docs page and `raypack plan` call them."""
