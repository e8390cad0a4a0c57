"""Token mixers besides attention (raypack/model/mixers.py): which modules are known and how they
are found, the boundaries they get, the path they take, and what is refused around them. Their
exactness, family by family, is tests/unit/model/test_families.py's."""

from __future__ import annotations

import pytest
import torch
import transformers
from exactness import make_rows
from families import FAMILIES

from raypack.data.collate import collate_packed
from raypack.model import mixers
from raypack.model.build import check_model, load_model, meta_model, tiny_config
from raypack.model.traits import UnsupportedModelError, check_packable, decoder

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = {
    "qwen3_5": "gated delta rule", "qwen3_5_moe": "gated delta rule", "qwen3_next": "gated delta rule",
    "olmo_hybrid": "gated delta rule", "lfm2": "short convolution", "lfm2_moe": "short convolution",
    "lfm3": "short convolution", "nemotron_h": "Mamba-2", "bamba": "Mamba-2", "granitemoehybrid": "Mamba-2",
    "falcon_h1": "Mamba-2", "zamba2": "Mamba-2", "kimi_linear": "KDA", "bailing_hybrid": "KDA",
}  # fmt: skip


@pytest.mark.parametrize("family", KINDS)
def test_each_hybrid_family_has_one_kind_of_known_mixer(family):
    model = meta_model(FAMILIES[family].build_config(family))
    found = mixers.find(decoder(model))
    assert found and {kind.name for kind in found.values()} == {KINDS[family]}


@pytest.mark.parametrize("family", ["jamba", "recurrent_gemma"])
def test_mixers_raypack_does_not_know_stay_refused(family):
    """Mamba-1 (Jamba) and RecurrentGemma's RG-LRU match no kind: their convolutions and layer
    types are refused as before."""
    model = meta_model(FAMILIES[family].build_config(family))
    assert not mixers.find(decoder(model))
    with pytest.raises(UnsupportedModelError, match=r"which would mix the examples of a packed row"):
        check_packable(model, family)


def test_known_mixers_are_refused_under_transformers_own_attention():
    """model.attention=sdpa loads the model without raypack's mixers: a packed row would leak."""
    with pytest.raises(UnsupportedModelError, match=r"layer_types conv"):
        check_model(tiny_config("lfm2"), attention="sdpa")
    check_model(tiny_config("lfm2"), attention="auto")


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "lfm2"])
def test_sequence_parallel_and_compile_are_refused_before_training(family):
    with pytest.raises(UnsupportedModelError, match=r"train.sequence_parallel=2 splits.*train.sequence_parallel=1"):
        check_model(tiny_config(family), attention="auto", split=2)
    with pytest.raises(UnsupportedModelError, match=r"train.compile=false"):
        check_model(tiny_config(family), attention="auto", compiled=True)
    check_model(tiny_config("llama"), attention="auto", compiled=True)  # attention alone still compiles


def test_seq_idx_numbers_each_token_by_its_example():
    cu = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    assert mixers.seq_idx(cu, 8).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert mixers.seq_idx(cu, 8).dtype == torch.int32


def test_the_torch_path_runs_each_mixer_once_on_the_examples_as_a_padded_batch():
    """One call per layer (ZeRO-3 gathers a layer's weights per call: ranks must agree on the
    count), every example a row starting at position 0, its padding after it."""
    torch.manual_seed(0)
    model = load_model("tiny-lfm2", attention="sdpa_varlen", dtype="float32")
    mixer = model.model.layers[0].conv
    seen = []
    mixer.in_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    rows, _ = make_rows(([5, 3], [4]), vocab=512)
    model(**collate_packed(rows))
    assert seen == [torch.Size([3, 5, 64])]


def test_without_boundaries_the_layer_runs_as_transformers_wrote_it():
    """Generation and callers outside raypack's batches pass no cu_seq_lens_q: the row is one sequence."""
    torch.manual_seed(0)
    model = load_model("tiny-qwen3_5", attention="sdpa_varlen", dtype="float32").eval()
    ref = load_model("tiny-qwen3_5", attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.model.layers[0].linear_attn(model.model.embed_tokens(ids)),
                                   ref.model.layers[0].linear_attn(ref.model.embed_tokens(ids)))  # fmt: skip


def test_the_start_line_says_which_path_runs():
    found = mixers.find(decoder(meta_model(tiny_config("qwen3_5"))))
    assert mixers.describe(found, "cpu") == "1 gated delta rule layer (exact torch path, examples as a padded batch)"
    cuda = mixers.describe(found, "cuda")
    if mixers.path(next(iter(found.values())), "cuda") == "torch":
        assert "not installed: slower" in cuda and "fla" in cuda
    else:
        assert "flash-linear-attention" in cuda


def test_lora_all_linear_leaves_out_what_mamba_kernels_read_by_weight():
    """mamba-ssm's fused kernel reads out_proj's weight, bypassing an adapter (peft refuses
    out_proj on Nemotron-H and Falcon-H1 for this); the gated delta rule's projections all adapt."""
    model = meta_model(tiny_config("nemotron_h"))
    assert mixers.fused_linears(model) == ["model.layers.0.mixer.out_proj"]
    assert mixers.fused_linears(meta_model(tiny_config("qwen3_5"))) == []


def test_transformers_own_torch_path_refuses_what_raypack_runs():
    """Why raypack runs the examples itself on the CPU: transformers 5.24's gated delta rule,
    handed cu_seqlens without flash-linear-attention, refuses the packed row."""
    if mixers.path(mixers.KINDS[0], "cuda") == "kernels":
        pytest.skip("flash-linear-attention installed")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_5"), attn_implementation="eager")
    batch = collate_packed(make_rows(([5, 3],), vocab=512)[0])
    batch.pop("labels")
    with pytest.raises(ValueError, match=r"can't keep packed sequences apart"):
        model(**batch)


def test_a_published_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5 checkpoints name Qwen3_5ForConditionalGeneration (a vision tower beside the text
    model): raypack loads the text model (Qwen3_5ForCausalLM, transformers' causal-LM class for the
    config) with the checkpoint's weights and its mixers installed; the tower is not loaded."""
    from families import GDN

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, layer_types=["linear_attention", "full_attention"],
                **GDN)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    published = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                        vision_config=vision))
    published.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), attention="sdpa_varlen", dtype="float32")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    source = published.model.language_model.layers[0].linear_attn
    assert torch.equal(model.model.layers[0].linear_attn.in_proj_qkv.weight, source.in_proj_qkv.weight)
    assert getattr(model.model.layers[0].linear_attn, "_raypack_packed", False)


@pytest.mark.parametrize("family,adapted", [
    ("qwen3_5", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]),
    ("lfm2", ["in_proj", "out_proj"]),
    ("nemotron_h", ["in_proj"]),
    ("kimi_linear", ["q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"]),
])  # fmt: skip
def test_lora_all_linear_reaches_the_mixers_projections(family, adapted):
    """peft's own all-linear, as raypack applies it: every projection of the mixer is a LoRA layer
    (Mamba-2's out_proj aside, see above); the convolution and the decay parameters train no adapter."""
    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters, is_adapted

    model = apply_adapters(load_model(f"tiny-{family}", attention="sdpa_varlen", dtype="float32"),
                           PeftConfig(method="lora", r=4, alpha=8, target_modules=("all-linear",)))  # fmt: skip
    text = decoder(model.base_model.model)
    mixer = text.get_submodule(next(iter(mixers.find(text))))
    assert [p for p in adapted if is_adapted(getattr(mixer, p))] == adapted
    assert not any(p.requires_grad for n, p in mixer.named_parameters() if "lora_" not in n)


def test_boundaries_come_from_the_host_copy_the_step_kept():
    """A batch moved to the device by the step (prefetch.to_device) carries its host cu_seq_lens_q:
    the mixers read that, never the device tensor (here a meta tensor, which has no values)."""
    from raypack.model.exact import keep_host_copy

    host = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    moved = torch.empty(4, dtype=torch.int32, device="meta")
    keep_host_copy(moved, host)
    assert mixers._segments(moved, 8) == [4, 3, 1]


def test_a_gpu_only_kernel_package_on_a_cpu_run_is_refused_before_training(monkeypatch):
    """transformers binds Qwen3.5's gated delta rule to fla's Triton kernels once fla imports, on
    any device; on the CPU they fail mid-forward ("0 active drivers"). Refused up front instead,
    packed or padded; on CUDA, and without fla, the same model is accepted."""
    from raypack.model.build import check_model

    config = FAMILIES["qwen3_5"].build_config("qwen3_5")
    monkeypatch.setitem(mixers._PACKAGES, "fla", True)
    for packed in (True, False):
        with pytest.raises(UnsupportedModelError, match=r"my-qwen: its gated delta rule layers would run on the CPU, "
                                                        r"and flash-linear-attention \(fla\) is installed"):
            check_model(config, device_type="cpu", name="my-qwen", packed=packed)
    check_model(config, device_type="cuda", name="my-qwen")
    check_model(FAMILIES["nemotron_h"].build_config("nemotron_h"), device_type="cpu")  # Mamba-2: no fla
    monkeypatch.setitem(mixers._PACKAGES, "fla", False)
    check_model(config, device_type="cpu", name="my-qwen")


def test_kda_is_exact_over_several_of_its_chunks():
    """transformers' torch KDA scans in chunks of 64 tokens (a default its layers don't change):
    examples longer than one chunk, and one of a single token, through the recurrence between chunks."""
    from exactness import packed_vs_alone

    torch.manual_seed(0)
    config = FAMILIES["kimi_linear"].build_config("kimi_linear")
    model = load_model(config, attention="sdpa_varlen", dtype="float32").eval()
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref, lengths=([150, 1], [70, 40]))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 2e-5, (worst, errors[worst])


def test_kda_kernels_get_the_boundaries_as_fla_takes_them(monkeypatch):
    """On CUDA with its kernels, the row goes through whole: seq_idx for causal-conv1d and, since
    transformers' KDA layer hands fla's chunk_kda the forward's keyword arguments as they come (it
    takes cu_seqlens, not cu_seq_lens_q), cu_seqlens in int64, and on the host where the step kept
    a copy. Checked here on the layer's call, the kernels faked (no GPU)."""
    from raypack.model.exact import keep_host_copy

    kind = next(k for k in mixers.KINDS if k.name == "KDA")
    monkeypatch.setattr(mixers, "path", lambda kind, device_type: "kernels")
    seen = {}

    def layer(hidden_states, cache=None, attention_mask=None, **kwargs):
        seen.update(kwargs)
        return hidden_states

    cu = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    keep_host_copy(cu, cu.clone())
    mixers._packed_forward(layer, kind, torch.zeros(1, 8, 4), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert seen["cu_seqlens"].dtype == torch.int64 and seen["cu_seqlens"].tolist() == [0, 4, 7, 8]
    assert seen["cu_seqlens_cpu"].tolist() == [0, 4, 7, 8] and seen["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    gated = next(k for k in mixers.KINDS if k.name == "gated delta rule")
    seen.clear()
    mixers._packed_forward(layer, gated, torch.zeros(1, 8, 4), cu_seq_lens_q=cu)
    assert "cu_seqlens" not in seen  # transformers' Qwen3.5 layer derives it itself
