"""Token mixers besides attention (raypack/model/mixers.py): which modules are known and how they
are found, the boundaries they get, the path they take, and what is refused around them. Their
exactness, family by family, is tests/unit/model/test_families.py's."""

from __future__ import annotations

import os
import pytest
import torch
import transformers
from checkpoints import saved, saved_config
from exactness import make_rows, summed_loss
from families import FAMILIES

from raypack.data.collate import collate_packed
from raypack.model import mixer_buckets, mixers
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


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "nemotron_h"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_known_mixers_are_refused_under_transformers_own_attention_naming_the_backend(family, attention):
    """model.attention=sdpa loads the model without raypack's mixers: a packed row would leak.
    What to change is the backend (the layers are exact under raypack's), not the strategy alone."""
    with pytest.raises(UnsupportedModelError) as e:
        check_model(tiny_config(family), attention=attention)
    assert f"has {KINDS[family]} layers, which transformers' own attention (model.attention=sdpa or eager) " \
           "leaves running over the whole packed row" in str(e.value)
    assert "use model.attention=auto (or sdpa_varlen, torch_varlen, flash_attn), or a padded strategy " \
           "(pad or pad_sorted)" in str(e.value)
    assert "layer_types" not in str(e.value)
    check_model(tiny_config(family), attention="auto")


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


def test_the_torch_path_runs_each_mixer_on_the_examples_bucketed_by_length():
    """BUCKETS calls per layer (ZeRO-3 gathers a layer's weights per call: ranks must agree on
    the count), each a padded batch of examples of about one length, every example a row
    starting at position 0, its padding after it; a bucket left empty is a call on one token."""
    torch.manual_seed(0)
    model = load_model("tiny-lfm2", attention="sdpa_varlen", dtype="float32")
    mixer = model.model.layers[0].conv
    seen = []
    mixer.in_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    rows, _ = make_rows(([5, 3], [4]), vocab=512)
    model(**collate_packed(rows))
    assert mixer_buckets.BUCKETS == 4
    assert seen == [torch.Size([1, 3, 64]), torch.Size([1, 4, 64]), torch.Size([1, 5, 64]), torch.Size([1, 1, 64])]


def _from_folder(family: str):
    """The family's layout (tests/families.py) saved in fp32 (save_pretrained, sharded) and loaded
    as users load a checkpoint, with from_pretrained (which kernelizes where the `kernels` package
    is installed, as transformers 5.25 installs it): packed, and the unpacked reference."""
    folder = str(saved_config(FAMILIES[family].build_config(family), family, dtype=torch.float32))
    return (load_model(folder, attention="sdpa_varlen", dtype="float32").eval(),
            load_model(folder, attention="eager", dtype="float32").eval())


def _slots_seen(model) -> list[int]:
    """Token slots (batch x length) each call of each mixer's output projection received."""
    seen = []
    for name in mixers.find(decoder(model)):
        mixer = decoder(model).get_submodule(name)
        proj = getattr(mixer, "out_proj", None) or mixer.o_proj
        proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[:-1].numel()))
    return seen


UNEQUAL = ([200] + [3 + i % 10 for i in range(30)],)
"""One row: an example of 200 tokens and thirty of 3 to 12 (one padded batch: 31 x 200 slots)."""


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "nemotron_h", "lfm2", "kimi_linear"])
def test_a_row_of_very_unequal_examples_packs_exactly_on_about_its_tokens(family):
    """The logits, summed loss and every gradient against each example alone, on a row one
    padded batch would run as 31 x 200 = 6200 slots for its 425 tokens: the buckets run under
    1.5x the tokens through each mixer (the spare calls' one token each aside). From a saved
    folder, as users load theirs."""
    from exactness import AS_CLOSE, off_float64, packed_vs_alone

    torch.manual_seed(0)
    model, ref = _from_folder(family)
    seen = _slots_seen(model)
    errors = packed_vs_alone(model, ref, lengths=UNEQUAL)
    worst = max(errors, key=errors.get)
    if errors[worst] >= 2e-5 and worst.startswith("grad:"):  # fp32 rounding alone (test_families' row check)
        packed, alone = off_float64(model, ref, lengths=UNEQUAL)
        assert packed < AS_CLOSE * max(alone, 2e-5), (worst, errors[worst], packed, alone)
    else:
        assert errors[worst] < 2e-5, (worst, errors[worst])
    tokens, layers = sum(UNEQUAL[0]), len(mixers.find(decoder(model)))
    real = [n for n in seen if n > 1]
    assert sum(real) < 1.5 * tokens * layers, (sum(real), tokens, layers)
    assert len(seen) == layers * mixer_buckets.BUCKETS


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # a spare call's input needs no gradient
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_row_of_one_example_calls_each_mixer_as_often_as_a_row_of_thirty(family, frozen):
    """What ZeRO-3 needs of ranks that hold different examples: the same calls of every submodule
    of every mixer, in the same order, forward and backward. (Without the spare calls, two ranks
    under ZeRO-3 abort in gloo, "a distributed collective mismatch": tests/ray/train/test_loop.py's
    hybrid test, whose ranks hold rows of 1 to 3 examples.) `frozen`: the layers' weights frozen, as
    LoRA's base is, so a frozen linear's backward runs only where its input needs a gradient (a
    spare's input without one made ZeRO-3 gather fewer times: tests/ray/train/test_dpo.py's qwen3_5
    LoRA case aborted in gloo)."""
    torch.manual_seed(0)
    model = load_model(FAMILIES[family].build_config(family), attention="sdpa_varlen", dtype="float32")
    if frozen:  # only the embeddings train: the hidden states need gradients, no layer weight does
        embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in embeddings)
    calls = []
    for name in mixers.find(decoder(model)):
        for sub, module in decoder(model).get_submodule(name).named_modules():
            if not list(module.children()):  # the leaves, whose weights ZeRO-3 gathers
                module.register_forward_pre_hook(lambda m, args, sub=sub: calls.append(("forward", sub)))
                module.register_full_backward_pre_hook(lambda m, grad, sub=sub: calls.append(("backward", sub)))
    seen = {}
    for lengths in (([40],), ([3 + i % 7 for i in range(29)] + [40],)):
        calls.clear()
        batch = collate_packed(make_rows(lengths, vocab=512)[0])
        batch.pop("labels")
        model(**batch).logits.sum().backward()
        seen[len(lengths[0])] = list(calls)
    assert seen[1] == seen[30]
    assert sum(1 for c in seen[1] if c[0] == "backward") > 0


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_the_spare_calls_add_exactly_nothing_to_the_gradients(family, monkeypatch):
    """A row of one example makes BUCKETS - 1 spare calls: the loss and every gradient are
    bitwise those of the same row with no spare calls (BUCKETS 1). (A zero token's output is
    zero through these layers, and so are its weights' gradients; the zero gradient handed back,
    checked below, keeps that so for a layer where it would not be.)"""
    torch.manual_seed(0)
    model = load_model(FAMILIES[family].build_config(family), attention="sdpa_varlen", dtype="float32")
    rows, _ = make_rows(([37],), vocab=512)
    batch = collate_packed(rows)
    labels = batch.pop("labels")
    results = []
    for buckets in (mixer_buckets.BUCKETS, 1):
        monkeypatch.setattr(mixer_buckets, "BUCKETS", buckets)
        model.zero_grad(set_to_none=True)
        loss = summed_loss(model(**batch).logits, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss4, grads4), (loss1, grads1) = results
    assert torch.equal(loss4, loss1)
    assert grads4.keys() == grads1.keys() and grads4
    assert all(torch.equal(grads4[n], grads1[n]) for n in grads1)


def test_a_spare_output_gets_a_zero_gradient_and_its_backward_runs():
    """mixers._Alongside: the output is the real one, untouched; the spare's backward runs (under
    ZeRO-3 it gathers weights there, as the real calls' do) and adds exactly zero."""
    real = torch.randn(5, requires_grad=True)
    weight = torch.randn(3, requires_grad=True)
    spare = (weight * 2 + 1).exp()  # a spare output that is far from zero
    out = mixers._Alongside.apply(real * 3, spare)
    assert torch.equal(out, real.detach() * 3)
    out.sum().backward()
    assert torch.equal(real.grad, torch.full((5,), 3.0))
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros(3))


def test_without_boundaries_the_layer_runs_as_transformers_wrote_it():
    """Generation and callers outside raypack's batches pass no cu_seq_lens_q: the row is one sequence."""
    torch.manual_seed(0)
    folder = str(saved("tiny-qwen3_5", dtype=torch.float32))
    model = load_model(folder, attention="sdpa_varlen", dtype="float32").eval()
    ref = load_model(folder, attention="eager", dtype="float32").eval()
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.model.layers[0].linear_attn(model.model.embed_tokens(ids)),
                                   ref.model.layers[0].linear_attn(ref.model.embed_tokens(ids)))  # fmt: skip


def test_the_start_line_says_which_path_runs():
    found = mixers.find(decoder(meta_model(tiny_config("qwen3_5"))))
    assert mixers.describe(found, "cpu") == ("1 gated delta rule layer (exact torch path, examples in padded batches "
                                             "by length: the CPU's; the kernels are CUDA's)")
    cuda = mixers.describe(found, "cuda")
    if mixers.path(next(iter(found.values())), "cuda") == "torch":
        assert "flash-linear-attention, causal-conv1d not installed: slower" in cuda, cuda
    else:
        assert "flash-linear-attention" in cuda


def test_transformers_kernel_fallback_warnings_are_left_to_the_start_line():
    """transformers warns, once in every process that runs a hybrid's torch path (each worker), to
    install CUDA kernels (causal-conv1d, flash-linear-attention, mamba-ssm): a model raypack loads
    says nothing, the start line says which path runs. In a process of its own, as a worker is."""
    import subprocess
    import sys

    from paths import REPO

    script = """
import torch
from raypack.model.build import load_model
for family in ("qwen3_5", "nemotron_h", "lfm2"):
    model = load_model(f"tiny-{family}", attention="sdpa_varlen", dtype="float32")
    ids = torch.randint(3, 100, (1, 12))
    model(input_ids=ids, position_ids=torch.arange(12)[None]).logits.sum().backward()
print("ran")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout == "ran\n", out.stderr[-3000:]
    assert "falling back" not in out.stderr and "install" not in out.stderr, out.stderr


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


def test_a_mixer_hub_kernels_changed_is_refused_naming_what_changed():
    """transformers' kernelization (the `kernels` package; from_pretrained's default from 5.25, and
    again at every train() or eval()) removes the instance's forward of a layer decorated for hub
    kernels, raypack's packed forward with it, and puts hub kernels in place of the functions a
    layer calls. raypack loads without it; a model in which anything turned it back on is refused,
    in one line naming the layer and what changed. Here each trait is set by hand, as kernelize
    sets it (tests/unit/model/test_mixers.py's next test gets it from the `kernels` package)."""
    import types

    model = load_model(str(saved("tiny-qwen3_5", dtype=torch.float32)), attention="sdpa_varlen", dtype="float32")
    mixers.check_kept(model, "my-qwen")
    layer = model.model.layers[0].linear_attn
    packed = layer.__dict__.pop("forward")  # kernelize's _replace_forward, with no hub layer for the device
    with pytest.raises(UnsupportedModelError) as e:
        mixers.check_kept(model, "my-qwen")
    assert str(e.value) == ("my-qwen: transformers' hub kernels (the kernels package) changed its gated delta rule "
                            "layer model.layers.0.linear_attn (raypack's packed forward removed), and raypack can't "
                            "tell that they keep a packed row's examples apart; load it without them: set "
                            "USE_HUB_KERNELS=NO in the environment")
    layer.forward = packed
    hub = types.SimpleNamespace(forward=lambda *args, **kwargs: None)  # a private copy given a hub kernel's forward
    torch_only = types.SimpleNamespace()
    layer.__dict__["_kernel_funcs"] = {"torch_chunk_gated_delta_rule": hub, "causal_conv1d_fn": torch_only}
    with pytest.raises(UnsupportedModelError, match=r"\(torch_chunk_gated_delta_rule replaced\)"):
        mixers.check_kept(model, "my-qwen")
    layer.__dict__["_kernel_funcs"] = {"causal_conv1d_fn": torch_only}
    mixers.check_kept(model, "my-qwen")
    model._use_kernels = True  # what transformers' train() and eval() read to kernelize again
    with pytest.raises(UnsupportedModelError, match=r"with hub kernels on \(use_kernels\).*next train\(\) or eval"):
        mixers.check_kept(model, "my-qwen")


def test_from_pretrained_kernelized_would_drop_the_packed_forward(monkeypatch):
    """With the `kernels` package installed, from_pretrained as transformers 5.25 calls it by
    default kernelizes the model: on the CPU, Qwen3.5's gated delta rule layer loses raypack's
    packed forward, and the packed row's boundaries reach transformers' torch fallback, which
    refuses them inside the workers ("can't keep packed sequences apart"). raypack loads without
    hub kernels (mixer_kernels.HUB_KERNELS_OFF); asked to load with them, the load is refused."""
    pytest.importorskip("kernels")
    from raypack.model import mixer_kernels

    folder = str(saved("tiny-qwen3_5", dtype=torch.float32))
    assert mixers.HUB_KERNELS_OFF is mixer_kernels.HUB_KERNELS_OFF == {"use_kernels": False}
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if not getattr(plain, "use_kernels", False):
        pytest.skip(f"transformers {transformers.__version__} does not kernelize by default")
    model = load_model(folder, attention="sdpa_varlen", dtype="float32")
    assert not model.use_kernels
    assert mixer_kernels.swapped(model.model.layers[0].linear_attn, mixers._packed_forward) == []
    monkeypatch.setattr(mixers, "HUB_KERNELS_OFF", {})
    with pytest.raises(UnsupportedModelError, match=r"linear_attn \(raypack's packed forward removed\)"):
        load_model(folder, attention="sdpa_varlen", dtype="float32")


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


# --- what the CUDA kernels would do, guarded on the CPU ---------------------------------------------


def _stand_in(monkeypatch, family: str, calls: list):
    """mamba-ssm's fused training kernel as transformers binds it where mamba-ssm imports: it reads
    out_proj's weight itself (here its output is that weight applied to the projections, enough to
    show which weights it trains)."""
    import importlib

    import torch.nn.functional as F

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    def fused(zxbcdt, *args, outproj_weight=None, outproj_bias=None, **kwargs):
        calls.append(kwargs.get("seq_idx"))
        return F.linear(zxbcdt[..., :outproj_weight.shape[1]], outproj_weight, outproj_bias)

    monkeypatch.setattr(module, "mamba2_split_conv1d_scan_combined", fused)


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "zamba2"])
def test_lora_on_out_proj_keeps_the_mamba_layer_off_the_fused_kernel(family, monkeypatch):
    """Bamba, Granite 4 and Zamba 2 hand out_proj.weight to mamba-ssm's fused kernel in training
    (peft refuses out_proj only for Nemotron-H and Falcon-H1): an adapter there would never run.
    With out_proj in the target list, the layer takes its unfused forward instead (the fused
    stand-in is never called) and out_proj's adapter trains; with in_proj alone the fused kernel
    still runs (what every Mamba-2 layer gets under all-linear)."""
    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters

    torch.manual_seed(0)
    rows, _ = make_rows(([5, 3],), vocab=512)
    batch = collate_packed(rows)
    batch.pop("labels")
    for targets, fused in ((("in_proj", "out_proj"), False), (("in_proj",), True)):
        calls: list = []
        _stand_in(monkeypatch, family, calls)
        model = load_model(FAMILIES[family].build_config(family), attention="sdpa_varlen", dtype="float32")
        model = apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8, target_modules=targets))
        model.train()
        model(**batch).logits.sum().backward()
        assert bool(calls) == fused, targets
        out_proj = [p for n, p in model.named_parameters() if "out_proj.lora_B" in n and ".mamba" in n]
        assert bool(out_proj) == (not fused)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in out_proj)
        lora_in = [p for n, p in model.named_parameters() if "in_proj.lora_B" in n]
        assert lora_in and all(p.grad is not None for p in lora_in)
        # the mixers' own flag: their submodules (LoRA dropout) still train, and eval() still evaluates
        mixer = model.get_submodule(next(iter(mixers.find(model))))
        assert mixer.training is fused and mixer.in_proj.training
        model.eval()
        assert not mixer.training and not mixer.in_proj.training


def test_an_adapter_on_a_convolution_the_layer_reads_by_weight_is_refused():
    """Every path (kernels and torch fallback alike) hands the mixer's conv1d.weight to a
    function: a LoRA layer on it never runs. peft refuses it for Nemotron-H and Falcon-H1, and
    elsewhere only for ranks that don't divide its groups; raypack refuses it, naming the module.
    Shown first with peft alone: the adapter gets no gradient."""
    from peft import get_peft_model

    from raypack.config import PeftConfig
    from raypack.model.adapters import AdapterError, apply_adapters, lora_config

    torch.manual_seed(0)
    config = FAMILIES["bamba"].build_config("bamba")
    cfg = PeftConfig(method="lora", r=96, alpha=8, target_modules=("in_proj", "conv1d"))  # 96: conv1d's groups
    model = get_peft_model(load_model(config, attention="sdpa_varlen", dtype="float32"), lora_config(cfg))
    batch = collate_packed(make_rows(([5, 3],), vocab=512)[0])
    batch.pop("labels")
    model(**batch).logits.sum().backward()
    conv = [p for n, p in model.named_parameters() if "conv1d.lora_" in n]
    assert conv and all(p.grad is None for p in conv)
    with pytest.raises(AdapterError, match=r"model.peft.target_modules \['in_proj', 'conv1d'\] on tiny-bamba: reaches "
                                           r"model.layers.0.mamba.conv1d, whose weight the Mamba-2 layer hands its "
                                           r"convolution itself.*leave it out"):
        apply_adapters(meta_model(config), cfg, "tiny-bamba")


@pytest.fixture
def kernels_here(monkeypatch):
    """Stand-in kernel packages put in sys.modules (where importlib finds them, as transformers
    would); returns `install(name, **attributes)`. The signature checks are read afresh."""
    import sys
    import types

    def install(name: str, **attributes):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            dotted = ".".join(parts[:i])
            if dotted not in sys.modules or not getattr(sys.modules[dotted], "_stand_in", False):
                module = types.ModuleType(dotted)
                module._stand_in = True
                monkeypatch.setitem(sys.modules, dotted, module)
                if i > 1:
                    setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
        for key, value in attributes.items():
            setattr(sys.modules[name], key, value)
        monkeypatch.setitem(mixers._PACKAGES, parts[0], True)

    mixers.kernels_problem.cache_clear()
    yield install
    mixers.kernels_problem.cache_clear()


def _conv_with_seq_idx(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                       final_states_out=None, activation=None):  # causal-conv1d 1.4+'s signature
    pass


def _conv_without(x, weight, bias=None, activation=None):  # causal-conv1d before seq_idx
    pass


def test_a_convolution_kernel_without_seq_idx_falls_back_to_the_exact_torch_path(kernels_here, monkeypatch):
    """transformers passes causal_conv1d_fn only the keywords its signature names: one without
    seq_idx would get the packed row with the boundaries dropped. The kernels path is taken only
    where it names seq_idx; the start line says why not, on one line."""
    short_conv = mixers.KINDS[2]
    kernels_here("causal_conv1d", causal_conv1d_fn=_conv_with_seq_idx)
    assert mixers.path(short_conv, "cuda") == "kernels"
    assert mixers.path(short_conv, "cpu") == "torch"
    mixers.kernels_problem.cache_clear()
    kernels_here("causal_conv1d", causal_conv1d_fn=_conv_without)
    assert mixers.path(short_conv, "cuda") == "torch"
    found = mixers.find(decoder(meta_model(tiny_config("lfm2"))))
    line = mixers.describe(found, "cuda")
    assert "\n" not in line
    assert line == ("1 short convolution layer (exact torch path, examples in padded batches by length: slower; "
                    "not the kernels: causal_conv1d's causal_conv1d_fn takes no seq_idx, so transformers would drop "
                    "the boundaries)")  # no causal-conv1d distribution here to name a version
    from raypack.model import mixer_kernels

    versions = {"causal-conv1d": "1.1.0"}
    monkeypatch.setattr(mixer_kernels.importlib.metadata, "version", lambda dist: versions[dist] if dist in versions
                        else (_ for _ in ()).throw(mixer_kernels.importlib.metadata.PackageNotFoundError(dist)))
    mixers.kernels_problem.cache_clear()
    assert mixers.kernels_problem(short_conv).startswith("causal-conv1d 1.1.0's causal_conv1d_fn takes no seq_idx")


def test_a_catch_all_kwargs_does_not_count_as_taking_the_boundaries(kernels_here):
    """`**kwargs` in a kernel's signature is filtered out by transformers like any unnamed keyword."""
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kwargs):
        pass

    kernels_here("causal_conv1d", causal_conv1d_fn=_conv_with_seq_idx)
    kernels_here("fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule)
    gated_delta = mixers.KINDS[0]
    assert mixers.path(gated_delta, "cuda") == "torch"
    assert "chunk_gated_delta_rule takes no cu_seqlens" in mixers.kernels_problem(gated_delta)

    def with_cu_seqlens(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        pass

    mixers.kernels_problem.cache_clear()
    kernels_here("fla.ops.gated_delta_rule", chunk_gated_delta_rule=with_cu_seqlens)
    assert mixers.path(gated_delta, "cuda") == "kernels"


def test_mamba_kernels_are_checked_fused_and_unfused(kernels_here):
    """A Mamba-2 layer calls mamba-ssm's fused kernel in training and its chunked scan in eval
    (and off the fused path): both must take seq_idx, and the convolution too."""
    mamba = mixers.KINDS[1]

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
        pass

    def fused_without(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                      dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                      outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True):
        pass

    kernels_here("causal_conv1d", causal_conv1d_fn=_conv_with_seq_idx)
    kernels_here("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=scan,
                 mamba_split_conv1d_scan_combined=fused_without)
    assert mixers.path(mamba, "cuda") == "torch"
    assert "mamba_split_conv1d_scan_combined takes no seq_idx" in mixers.kernels_problem(mamba)
    mixers.kernels_problem.cache_clear()
    kernels_here("mamba_ssm.ops.triton.ssd_combined", mamba_split_conv1d_scan_combined=lambda *a, seq_idx=None: None)
    assert mixers.path(mamba, "cuda") == "kernels"
    mixers.kernels_problem.cache_clear()
    kernels_here("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=None)
    assert "has no mamba_chunk_scan_combined" in mixers.kernels_problem(mamba)


def test_kda_is_exact_over_several_of_its_chunks():
    """transformers' torch KDA scans in chunks of 64 tokens (a default its layers don't change):
    examples longer than one chunk, and one of a single token, through the recurrence between chunks."""
    from exactness import packed_vs_alone

    torch.manual_seed(0)
    model, ref = _from_folder("kimi_linear")
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
