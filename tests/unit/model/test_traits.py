"""Model traits that decide whether packed rows are exact: each rule refuses on its own, names
what still works, and accepts what it should (a vision tower, the backend that handles a trait)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from exactness import make_rows, rel_err

from raypack.data.collate import collate_packed
from raypack.model.build import check_model, load_model, tiny_config
from raypack.model.traits import UnsupportedModelError, check_packable

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)  # fmt: skip
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2)


def meta_llama(**overrides):
    cfg = tiny_config("llama", **overrides)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def test_plain_model_is_accepted():
    check_packable(meta_llama(), "tiny-llama")


class Scorer(torch.nn.Module):
    """A module that works along the sequence: it takes the mask (a sparse-attention indexer's shape)."""

    def forward(self, hidden_states, attention_mask):
        return hidden_states


def _indexed(model):
    model.config.layer_types = ["full_attention", "indexed_attention"]
    model.model.layers[1].self_attn.add_module("scorer", Scorer())


@pytest.mark.parametrize(
    "change,trait",
    [
        (_indexed, r"layer_types indexed_attention \(layers\.1\.self_attn\.scorer: Scorer takes the attention_mask"),
        (lambda m: m.model.layers[0].add_module("mixer", torch.nn.Conv1d(8, 8, 3, groups=8)), r"convolution.*layers\.0\.mixer"),
        (lambda m: m.model.layers[1].register_parameter("A_log", torch.nn.Parameter(torch.zeros(4))), r"state-space.*layers\.1"),
        (lambda m: setattr(m.model.layers[0].self_attn, "is_causal", False), r"bidirectional attention.*layers\.0\.self_attn"),
    ],
    ids=["layer_types", "conv1d", "ssm", "bidirectional"],
)  # fmt: skip
def test_each_token_mixer_rule_refuses_alone(change, trait):
    model = meta_llama()
    change(model)
    with pytest.raises(UnsupportedModelError, match=trait) as e:
        check_packable(model, "tiny-llama")
    assert "tiny-llama (LlamaForCausalLM)" in str(e.value) and "(pad or pad_sorted)" in str(e.value)


def test_vision_tower_is_not_the_decoder():
    """Gemma 3 checkpoints load as Gemma3ForConditionalGeneration, with a bidirectional SigLIP
    tower that never sees a packed row: only the text decoder is searched."""
    check_model(transformers.Gemma3Config(), attention="auto", device_type="cpu")


def gpt_oss():
    return transformers.GptOssConfig(**TINY, **MOE, sliding_window=8)


def test_sinks_exact_on_cpu_refused_on_cuda_kernels():
    check_model(gpt_oss(), attention="auto", device_type="cpu")
    check_model(gpt_oss(), attention="sdpa_varlen", device_type="cuda")
    for attention in ("auto", "torch_varlen", "flash_attn"):
        with pytest.raises(UnsupportedModelError, match=r"GptOssConfig .*attention sinks.*sdpa_varlen.*pad or pad_sorted"):
            check_model(gpt_oss(), attention=attention, device_type="cuda")


def test_softcap_and_dropout_refused_only_where_a_backend_lacks_them():
    gemma2 = transformers.Gemma2Config(**TINY, query_pre_attn_scalar=16)
    assert gemma2.attn_logit_softcapping
    with pytest.raises(UnsupportedModelError, match=r"softcapping.*flash-attn"):
        check_model(gemma2, attention="torch_varlen", device_type="cuda")
    # auto may pick flash-attn on the worker, which softcaps: the worker's own check decides
    check_model(gemma2, attention="auto", device_type="cuda")
    check_model(gemma2, attention="flash_attn", device_type="cuda")
    check_model(gemma2, attention="sdpa_varlen", device_type="cuda")
    with pytest.raises(UnsupportedModelError, match=r"attention dropout \(0.1\)"):
        check_model(tiny_config("llama", attention_dropout=0.1), attention="torch_varlen", device_type="cuda")


def llama4(floor_scale):
    return transformers.Llama4TextConfig(
        **TINY, **MOE, intermediate_size_mlp=128, attention_chunk_size=8, no_rope_layers=[1, 0], floor_scale=floor_scale,
        initializer_range=0.1, use_cache=False,
    )  # fmt: skip


def test_row_position_temperature_is_refused_when_rows_reach_floor_scale():
    """Llama 4 scales NoPE queries by log1p(floor((row position + 1) / floor_scale)): exact only
    while rows are shorter than floor_scale. Refused before training when the budget says so,
    and at the forward of any longer row otherwise."""
    check_model(llama4(16), max_row_tokens=15)
    with pytest.raises(UnsupportedModelError, match=r"floor_scale 16.*budget below 16"):
        check_model(llama4(16), max_row_tokens=16)
    model = load_model(llama4(16), attention="sdpa_varlen", dtype="float32")
    short = collate_packed(make_rows(([6, 5, 4],), vocab=512)[0])  # 15 tokens
    model(**short)
    with pytest.raises(UnsupportedModelError, match=r"Llama4TextAttention.*NoPE.*50 tokens.*floor_scale=16"):
        model(**collate_packed(make_rows(vocab=512)[0]))


def test_row_position_temperature_really_mixes_rows():
    """Why the refusal above: transformers' own attention over the same packed row (its
    position_ids keep examples apart) still scales later examples as if they began the row."""
    torch.manual_seed(0)
    model = load_model(llama4(16), attention="eager", dtype="float32").eval()
    rows, examples = make_rows(vocab=512)
    batch = collate_packed(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=ids[None]).logits[0] for ids, _ in examples])
        wide = load_model(llama4(8192), attention="eager", dtype="float32").eval()
        wide.load_state_dict(model.state_dict())
        packed_wide = wide(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone_wide = torch.cat([wide(input_ids=ids[None]).logits[0] for ids, _ in examples])
    assert rel_err(packed, alone) > 1e-3
    assert rel_err(packed_wide, alone_wide) < 1e-5  # the same row is exact below floor_scale


def test_check_model_builds_no_weights():
    """The driver's check runs on the meta device: a 70B config costs seconds and no memory."""
    cfg = copy.deepcopy(transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=4,
                                                 num_attention_heads=64, num_key_value_heads=8))  # fmt: skip
    check_model(cfg, attention="auto", device_type="cuda")


@pytest.mark.parametrize("kind", ["mlp", "moe", "a_kind_transformers_adds_later"])
def test_a_layer_type_raypack_has_not_seen_is_judged_by_its_modules(kind):
    """A layer whose `layer_types` entry names no attention raypack implements, holding attention it
    routes and an MLP: nothing in it mixes tokens unchecked, whatever its name."""
    model = meta_llama()
    model.config.layer_types = ["full_attention", kind]
    check_packable(model, "tiny-llama")


def test_a_layer_type_with_no_layer_to_read_is_refused_by_name():
    """Where the entries don't line up with the decoder's layers, only the name is there to judge."""
    model = meta_llama()
    model.config.layer_types = ["full_attention", "full_attention", "mlp"]
    with pytest.raises(UnsupportedModelError, match=r"layer_types mlp, which would mix"):
        check_packable(model, "tiny-llama")


def test_a_forward_that_keeps_the_boundaries_from_its_mixers_is_refused_and_one_without_positions_is_not():
    """A Mamba-2 model whose forward calls the backbone without its keyword arguments (as
    transformers' own Mamba2ForCausalLM did up to 5.24): its mixers are raypack's Mamba-2 kind, and
    its stack has no attention to route, but cu_seq_lens_q never reaches them. Refused, naming
    that. Its forward takes no position_ids, which a stack with nothing that reads positions
    doesn't need, unless it takes no keyword arguments at all (where the boundaries ride)."""
    from raypack.model import mixers
    from raypack.model.build import meta_model
    from raypack.model.traits import decoder, drops_boundaries, routes_attention

    class Dropping(transformers.Mamba2ForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            return self.lm_head(self.backbone(input_ids=input_ids).last_hidden_state)

    class Passing(transformers.Mamba2ForCausalLM):  # as 5.25's
        def forward(self, input_ids=None, labels=None, **kwargs):
            return self.lm_head(self.backbone(input_ids=input_ids, **kwargs).last_hidden_state)

    class Closed(transformers.Mamba2ForCausalLM):
        def forward(self, input_ids=None, labels=None):
            return self.lm_head(self.backbone(input_ids=input_ids).last_hidden_state)

    config = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=8,
                                       n_groups=2, vocab_size=512, chunk_size=8)  # fmt: skip
    with torch.device("meta"):
        model, passing, closed = Dropping(config), Passing(config), Closed(config)
    assert {k.name for k in mixers.find(decoder(model)).values()} == {"Mamba-2"}
    assert routes_attention(model) and drops_boundaries(model) == "backbone"
    only = r"rows: its forward calls self\.backbone without its keyword arguments, [^;]*\. Use"
    with pytest.raises(UnsupportedModelError, match=only):
        check_packable(model, "mamba2")  # the one reason: no position_ids is none here
    check_packable(passing, "mamba2")
    with pytest.raises(UnsupportedModelError, match=r"its forward takes no position_ids"):
        check_packable(closed, "mamba2")
    assert drops_boundaries(meta_model(tiny_config("nemotron_h"))) is None


def test_nemotron_h_as_released_and_with_no_attention_layer_is_accepted():
    """The issue's config (an MLP-only layer, `-` in hybrid_override_pattern, between Mamba-2 and
    attention layers, and an MoE layer) and a stack with no attention layer, before training;
    tests/unit/model/test_families.py trains both layouts exactly (nemotron_h, nemotron_h-recurrent)."""
    check_model(transformers.NemotronHConfig(layers_block_type=["mamba", "mlp", "attention", "moe"]), attention="auto")
    check_model(transformers.NemotronHConfig(hybrid_override_pattern="M-ME"), attention="auto")
