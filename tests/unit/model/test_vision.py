"""Vision-language families on packed rows: exact for both towers, or refused before training.

For each family in tests/vision_families.py a tiny model (hidden 64, 2 layers, a 2-layer vision
tower) is built from a config. Three examples (one image; text only; two images of different
sizes) go into one packed row with raypack's positions and collate, through raypack's exact CPU
path in the language model and the tower's own sdpa. Each example is also run alone through the
model's own forward under `eager` attention everywhere, which builds its own positions
(`get_rope_index` for mRoPE) from the example's grids. The logits, the summed loss and every
gradient (vision tower, projector, language model) agree within 1e-5 relative in fp32.

Refused families must raise UnsupportedModelError naming the trait, and with the check
bypassed packing must really differ, so no refusal is spurious. The negative controls show the
check can fail: positions a naive packer would build leave Qwen2.5-VL far off.
"""

from __future__ import annotations

import pytest
import torch
from vision_families import CHECKPOINTED, VLM_FAMILIES, alone_inputs, make_examples, vlm_packed_vs_alone, with_positions

from raypack.data.vision_collate import collate_vision_packed
from raypack.model.traits import UnsupportedModelError
from raypack.model.vision import build_vlm, check_vlm_packable, example_positions, freeze, is_vlm, uses_mrope

pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-5


def _pair(spec, attention="sdpa_varlen", check=True):
    config = spec.build_config()
    torch.manual_seed(0)
    model = build_vlm(config, attention, check=check).eval()
    ref = build_vlm(config, "eager").eval()
    ref.load_state_dict(model.state_dict())
    return config, model, ref


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_vlm_family_is_exact_or_refused(family):
    spec = VLM_FAMILIES[family]
    if spec.refused:
        with pytest.raises(UnsupportedModelError, match=spec.refused):
            build_vlm(spec.build_config(), "sdpa_varlen")
        config, model, ref = _pair(spec, check=False)
        examples = make_examples(spec, config)
        errors = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
        assert errors["logits"] > 1e-3, "refused, yet packing looks exact"
        return
    config, model, ref = _pair(spec)
    assert is_vlm(config)
    examples = make_examples(spec, config)
    batch = collate_vision_packed(with_positions(model, examples))
    assert batch["pixel_values"].numel() == sum(e["pixel_values"].numel() for e in examples if e["pixel_values"] is not None)
    errors = vlm_packed_vs_alone(model, ref, examples, batch)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family}: {worst} off by {errors[worst]:.2e} (all: {errors})"
    assert {"grad:vision", "grad:projector", "grad:language"} <= errors.keys(), f"{family}: a tower got no gradient"


MROPE = [f for f, s in VLM_FAMILIES.items() if not s.refused and s.layout == "patches"]


@pytest.mark.parametrize("family", MROPE)
def test_mrope_positions_are_the_models_own_per_example(family):
    """Rows 1-3 restart per example and are what get_rope_index gives the example alone; row 0
    is the text position (boundaries). Image tokens share temporal positions (not 0..n-1)."""
    spec = VLM_FAMILIES[family]
    config, model, _ = _pair(spec)
    assert uses_mrope(model)
    examples = make_examples(spec, config)
    pos = collate_vision_packed(with_positions(model, examples))["position_ids"]
    assert pos.shape == (4, 1, sum(len(e["input_ids"]) for e in examples))
    offset = 0
    for e in examples:
        n = len(e["input_ids"])
        mine = pos[:, 0, offset : offset + n]
        assert torch.equal(mine[0], torch.arange(n))
        assert torch.equal(mine, example_positions(model, e["input_ids"], e["image_grid_thw"]))
        if e["image_grid_thw"] is not None:
            assert not torch.equal(mine[1], mine[0]), "image tokens got text positions"
        offset += n


@pytest.mark.parametrize("naive", ["text_positions", "no_restart"])
def test_naive_mrope_packing_is_caught(naive):
    """What peers' bug reports describe: text positions for the image tokens, or a row 0 that
    doesn't restart per example (the examples attend to each other). The check sees both.

    (get_rope_index over the whole packed row is not among them: it shifts each example's three
    rows by one constant, which rotary attention cancels, so with row 0 restarting it is exact.)"""
    spec = VLM_FAMILIES["qwen2_5_vl"]
    config, model, ref = _pair(spec)
    examples = make_examples(spec, config)
    batch = collate_vision_packed(with_positions(model, examples))
    text = batch["position_ids"][0]
    if naive == "text_positions":
        batch["position_ids"] = torch.cat([text[None], text[None].expand(3, -1, -1)])
    else:
        total = text.shape[-1]
        row = torch.arange(total)[None, None]
        batch["position_ids"] = torch.cat([row, batch["position_ids"][1:]])
        cu = torch.tensor([0, total], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=total, max_length_k=total)
    assert vlm_packed_vs_alone(model, ref, examples, batch)["logits"] > 1e-3


def test_vision_tower_attention_is_never_the_language_models():
    """The tower attends bidirectionally within an image: raypack's causal varlen attention must
    never run it (it would refuse is_causal=False), and the language model must run raypack's.
    A grid tower that takes host plans runs raypack's bidirectional tower attention; the others
    keep transformers' sdpa."""
    from raypack.model.vision_tower import TOWER_ATTENTION

    model = build_vlm(VLM_FAMILIES["qwen2_5_vl"].build_config(), "sdpa_varlen")
    assert {m.config._attn_implementation for m in model.model.visual.modules() if hasattr(m, "config")} == {
        TOWER_ATTENTION}
    assert model.config.text_config._attn_implementation.startswith("raypack_")
    for family in ("glm4v", "llava_clip"):
        model = build_vlm(VLM_FAMILIES[family].build_config(), "sdpa_varlen")
        assert model.config.vision_config._attn_implementation == "sdpa", family


def test_language_model_traits_are_still_refused():
    """A VLM whose language model has a trait raypack can't pack (here a layer whose type it hasn't
    seen holding a module that takes the mask: something working along the sequence) is refused by
    the same checks as a text model."""

    class Scorer(torch.nn.Module):
        def forward(self, hidden_states, attention_mask):
            return hidden_states

    spec = VLM_FAMILIES["llava_clip"]
    config = spec.build_config()
    model = build_vlm(config, "sdpa")
    model.config.text_config.layer_types = ["conv", "full_attention"]
    model.model.language_model.layers[0].add_module("scorer", Scorer())
    with pytest.raises(UnsupportedModelError, match=r"layer_types conv \(layers\.0\.scorer: Scorer takes the attention_mask"):
        check_vlm_packable(model, "tiny-llava")


TRAINED = [f for f, s in VLM_FAMILIES.items() if not s.refused]


@pytest.mark.parametrize("family", TRAINED)
@pytest.mark.parametrize("what", [("vision",), ("vision", "projector")])
def test_frozen_parts_get_no_gradient_and_the_rest_stays_exact(family, what):
    spec = VLM_FAMILIES[family]
    config, model, ref = _pair(spec)
    frozen = freeze(model, what)
    assert freeze(ref, what) == frozen and frozen
    examples = make_examples(spec, config)
    errors = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
    assert all(model.get_parameter(n).grad is None for n in frozen)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family}: {worst} off by {errors[worst]:.2e}"
    assert ("grad:projector" in errors) == ("projector" not in what) and "grad:vision" not in errors


LANGUAGE_LORA = r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
"""LoRA on the language model only (peft's target_modules as a regex)."""


@pytest.mark.parametrize("family", TRAINED)
def test_lora_on_the_language_model_is_exact(family):
    """peft's LoRA on the language model's linear layers, the towers frozen: every adapter gradient
    packed equals the examples alone (B drawn at random: at peft's zero start every lora_A
    gradient is zero, which any path would match)."""
    from exactness import random_lora_b
    from peft import LoraConfig, get_peft_model

    spec = VLM_FAMILIES[family]
    config, model, ref = _pair(spec)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE_LORA)
    model = random_lora_b(get_peft_model(model, lora))
    ref = get_peft_model(ref, lora)
    ref.load_state_dict(model.state_dict())
    examples = make_examples(spec, config)
    # positions from the peft-wrapped model: example_positions finds get_rope_index through the wrapper
    errors = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} + LoRA: {worst} off by {errors[worst]:.2e}"
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n and ("language_model" in n or "text_model" in n) for n in trained)


@pytest.mark.parametrize("family", TRAINED)
def test_lora_all_linear_in_both_towers_is_exact(family):
    """raypack's LoRA as `model.peft.method: lora` applies it by default (all-linear): adapters in
    the vision tower, the projector and the language model. Every adapter gradient, tower and
    projector included, packed equals the examples alone (B drawn at random, as above)."""
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters

    spec = VLM_FAMILIES[family]
    config, model, ref = _pair(spec)
    cfg = PeftConfig(method="lora", r=4, alpha=8)
    model = random_lora_b(apply_adapters(model, cfg))
    ref = apply_adapters(ref, cfg)
    ref.load_state_dict(model.state_dict())
    examples = make_examples(spec, config)
    errors = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} + LoRA all-linear: {worst} off by {errors[worst]:.2e}"
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)
    towers = {part for part in ("vision", "projector", "language") if any(
        any(key in n for key in KEYS[part]) for n in trained)}  # fmt: skip
    assert towers == {"vision", "projector", "language"}, towers


KEYS = {"vision": ("visual.blocks", "vision_tower", "vision_model"), "projector": ("merger", "multi_modal_projector",
                                                                                "connector"),
        "language": ("language_model", "text_model")}  # fmt: skip
"""Where each part's weights sit, by the families' names (raypack/model/vision.py's TOWERS, PROJECTORS)."""


def test_mrope_without_get_rope_index_is_refused():
    """An mRoPE model whose get_rope_index raypack can't reach (an unknown wrapper) is refused,
    never trained on text positions."""
    spec = VLM_FAMILIES["qwen2_5_vl"]
    model = build_vlm(spec.build_config(), "sdpa")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model, self.config = torch.nn.Module(), inner.config

    with pytest.raises(UnsupportedModelError, match=r"mrope_section.*get_rope_index"):
        example_positions(Wrapper(model), torch.arange(5), torch.tensor([[1, 4, 4]]))


def test_the_drivers_model_check_takes_packable_vlms_and_refuses_the_rest():
    """`raypack train`'s model check (preflight, meta device) takes a VLM that packs exactly and
    refuses one that doesn't for packed strategies, before any data or worker work; `pad` (its
    own mask) takes both."""
    from raypack.model.build import check_model

    from raypack.model.vision import trains_as_vlm

    check_model(VLM_FAMILIES["qwen2_5_vl"].build_config(), attention="auto", device_type="cpu")
    gemma = VLM_FAMILIES["gemma3"].build_config()
    with pytest.raises(UnsupportedModelError, match=r"token_type_ids.*bidirectionally"):
        check_vlm_packable(build_vlm(gemma, check=False), "gemma3")
    # transformers loads a Gemma 3 checkpoint as its causal LM: raypack trains its text, packed,
    # and image rows for it are refused before packing (prepare.check_images_trainable)
    assert not trains_as_vlm(gemma)
    check_model(gemma, attention="auto", device_type="cpu", name="gemma3")


@pytest.mark.parametrize("family", CHECKPOINTED)
def test_gradient_checkpointing_stays_exact(family):
    """raypack's full gradient checkpointing (non-reentrant, raypack/model/checkpointing.py) on
    both towers: the recomputed forward keeps the packed row's positions and images. Train mode,
    where transformers checkpoints (these configs have no dropout)."""
    from raypack.model import checkpointing

    spec = VLM_FAMILIES[family]
    config, model, ref = _pair(spec)
    checkpointing.enable(model, "full")
    model.train()
    examples = make_examples(spec, config)
    errors = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} + checkpointing: {worst} off by {errors[worst]:.2e}"
    on = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    assert any(n.startswith(("model.visual", "model.vision")) for n in on), on  # the tower's layers
    assert any(n.startswith(("model.language_model", "model.text_model")) for n in on), on


def test_a_saved_vlm_loads_with_transformers_and_computes_the_same(tmp_path):
    """save_vlm after LoRA training: AutoModelForImageTextToText (its own attention, each example
    alone) gives the packed model's logits; the tokenizer and image processor load from the folder."""
    from exactness import random_lora_b
    from peft import LoraConfig, get_peft_model
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from raypack.config import ASSETS
    from raypack.model.vision import save_vlm, tiny_vlm_config

    image_processor = AutoImageProcessor.from_pretrained(ASSETS / "vlm_processor")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "vlm_processor")
    config = tiny_vlm_config(image_processor, tokenizer)
    torch.manual_seed(0)
    model = random_lora_b(get_peft_model(build_vlm(config, "sdpa_varlen"), LoraConfig(r=4, target_modules=LANGUAGE_LORA)))
    model.eval()
    spec = VLM_FAMILIES["qwen2_5_vl"]
    examples = make_examples(spec, config)
    batch = collate_vision_packed(with_positions(model, examples))
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits[0]
    save_vlm(model, tmp_path, image_processor, tokenizer)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == tokenizer.chat_template
    assert type(AutoImageProcessor.from_pretrained(tmp_path)) is type(image_processor)
    with torch.no_grad():
        alone = torch.cat([loaded(**alone_inputs(loaded, e)).logits[0] for e in examples])
    assert ((packed - alone).abs().max() / alone.abs().max()).item() < TOLERANCE


def test_pictures_of_different_sizes_are_refused_not_padded():
    """A picture tower takes one size per batch; padding one would change its result against the
    example alone, so the collate refuses the mix (Qwen's flat patches have no such limit)."""
    a = {"input_ids": [1, 2], "labels": [1, 2], "position_ids": [0, 1], "pixel_values": torch.zeros(1, 3, 16, 16)}
    b = {**a, "pixel_values": torch.zeros(1, 3, 8, 8)}
    with pytest.raises(ValueError, match=r"pixel_values of different shapes"):
        collate_vision_packed([a, b])


def test_a_gemma3_checkpoint_trains_its_text_packed_exactly():
    """Gemma 3's config maps to a causal LM (its multimodal class): raypack trains it on text, not
    as an image VLM (`trains_as_vlm`), and its packed text rows are exact against each example
    alone, loss and every gradient; the bidirectional image mask never meets a packed row."""
    from exactness import packed_vs_alone

    from raypack.model.build import load_model

    config = VLM_FAMILIES["gemma3"].build_config()
    torch.manual_seed(0)
    model = load_model(config, attention="sdpa_varlen", dtype="float32").eval()
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst} off by {errors[worst]:.2e}"
    assert any(k.startswith("grad:model.language_model.") for k in errors)
