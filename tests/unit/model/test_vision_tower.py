"""A grid tower run from a host plan (raypack/model/vision_tower.py): the same features and
gradients as transformers' own sdpa tower, no device read left in it, and the towers it can't
take left on transformers' path, found by trait.

Equality is checked against a model built with `sdpa` everywhere (transformers' tower, which
computes everything from the grid itself and splits SDPA per image or window), same weights,
same images: the images of tests/vision_families.py plus one several of Qwen2.5-VL's windows
wide. The reads are counted as benchmarks/loop_syncs.py counts them: the batch is copied as
CUDA would move it, and a read of anything but a host tensor is one that would wait on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from vision_families import VLM_FAMILIES, make_examples, with_positions

from raypack.data.vision_collate import collate_vision_packed
from raypack.model import vision_tower as vt
from raypack.model.exact import keep_host_copy
from raypack.model.vision import _inner, build_vlm

pytestmark = pytest.mark.usefixtures("one_thread")
PLANNED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
LAYOUT = ((5, [(4, 4)], 7), (9, [], 4), (3, [(4, 6), (2, 2)], 6), (2, [(12, 8)], 3))
"""tests/vision_families.EXAMPLES and an image of 6x4 merged patches: several 2x2 windows."""


def _moved(batch: dict) -> dict:
    """The batch as to_device leaves it on CUDA: new tensors, the HOST_COPIED host ones beside them."""
    from raypack.train.prefetch import HOST_COPIED

    moved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for key in HOST_COPIED:
        if isinstance(batch.get(key), torch.Tensor):
            keep_host_copy(moved[key], batch[key])
    return moved


def _towers(family: str):
    spec = VLM_FAMILIES[family]
    config = spec.build_config()
    torch.manual_seed(0)
    model = build_vlm(config, "sdpa_varlen")
    ref = build_vlm(config, "sdpa")
    ref.load_state_dict(model.state_dict())
    return config, model, ref


def _features(model, kwargs: dict) -> list[torch.Tensor]:
    out = _inner(model).get_image_features(**kwargs, return_dict=True)
    return [torch.cat(out.pooler_output)] + [torch.cat(f) for f in getattr(out, "deepstack_features", None) or []]


@pytest.mark.parametrize("family", PLANNED)
def test_a_planned_tower_equals_transformers_own_sdpa_tower(family):
    config, model, ref = _towers(family)
    assert vt.installed(model) and not vt.installed(ref)
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    plan = vt.plan(vt.tower_of(model), batch["image_grid_thw"])
    moved = _moved({"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"], **plan})
    host = {"image_grid_thw": batch["image_grid_thw"]}
    mine = _features(model, {**moved, "image_grid_thw": host["image_grid_thw"]})
    theirs = _features(ref, {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]})
    for a, b in zip(mine, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"{family}: off by {(a - b).abs().max():.2e}"
    sum(f.square().sum() for f in mine).backward()
    sum(f.square().sum() for f in theirs).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in vt.tower_of(model).named_parameters(prefix="model.visual"):
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), f"{family}: {name} off"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_windowed_tower_really_splits_by_window(family):
    """A control: the plan's offsets matter. Qwen2.5-VL's windowed blocks given the whole images'
    offsets (or Qwen3-VL given one segment for all images) must come out different."""
    config, model, ref = _towers(family)
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    plan = vt.plan(vt.tower_of(model), batch["image_grid_thw"])
    total = int(plan["image_cu_seqlens"][-1])
    wrong = dict(plan)
    if "image_cu_window_seqlens" in plan:
        wrong.update(image_cu_window_seqlens=plan["image_cu_seqlens"], image_max_window_seqlen=plan["image_max_seqlen"])
    else:
        wrong.update(image_cu_seqlens=torch.tensor([0, total], dtype=torch.int32), image_max_seqlen=total)
    kwargs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    with torch.no_grad():
        right, off = _features(model, {**kwargs, **plan})[0], _features(model, {**kwargs, **wrong})[0]
    assert (right - off).abs().max() > 1e-3


def _device_reads(model, batch: dict) -> list[str]:
    """Where a forward and backward of `batch`, moved as CUDA would move it, read a device value."""
    from benchmarks.loop_syncs import ReadCounter, copying_to_device

    counter = ReadCounter()
    batch = dict(batch)
    labels = batch.pop("labels")
    with counter:
        moved = copying_to_device(counter, batch, "cpu")
        logits = model(**moved).logits
        torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=-100).backward()
    return [f"{what} | {origin} ({where})" for kind, origin, where, what in counter.events
            if kind == "read" and "device value" in what]  # fmt: skip


def test_a_vlm_step_reads_nothing_from_the_device():
    """VisionRows' micro-batch of the bundled sample through the tiny Qwen2.5-VL: transformers read
    26 device values a step (its tower's grid and offsets, and the placeholder count:
    benchmarks/results/loop_syncs_cpu_20261203.md before the plan); from the plan, none. The
    control, the same batch without its plan (the grid and offsets for transformers to derive on
    the device), must show the reads, so the count can fail."""
    from benchmarks.vision_host import PROCESSOR, sample_row

    from raypack.model.build import load_model
    from raypack.train.vision_rows import VisionRows

    torch.manual_seed(0)
    model = load_model("tiny-qwen2_5_vl", attention="sdpa_varlen", dtype=torch.float32)
    row, images = sample_row(256)
    batch = VisionRows(model, images, str(PROCESSOR), workers=1)([row])
    assert vt.PLAN_KEY in batch and "image_window_index" in batch
    assert _device_reads(model, batch) == []
    unplanned = {k: v for k, v in batch.items() if not k.startswith("image_") or k == "image_grid_thw"}
    control = _device_reads(model, unplanned)
    assert sum("vision_utils" in r for r in control) >= 3 and any("get_placeholder_mask" in r for r in control), control


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vls_deepstack_adds_at_host_positions_and_reads_nothing(family):
    """Qwen3-VL adds the tower's deepstack features to the language model's hidden states at the
    image tokens, found by a boolean mask: two device reads a deepstack layer forward, three
    backward (5 for the tiny model). From the positions collate finds on the host, none; the
    control, the same planned batch without them, must read (transformers' own add), so the
    count can fail. The values are transformers' (test_a_planned_packed_forward_equals_the_unplanned_one)."""
    config, model, _ = _towers(family)
    text = _inner(model).language_model
    assert getattr(text._deepstack_process, "__func__", None) is vt._deepstack_process
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    planned = {**batch, **vt.plan_batch(vt.tower_of(model), batch, config.image_token_id)}
    index = planned[vt.VISUAL_INDEX]
    assert torch.equal(index, torch.nonzero(batch["input_ids"].reshape(-1) == config.image_token_id).squeeze(1))
    assert _device_reads(model, planned) == []
    control = _device_reads(model, {k: v for k, v in planned.items() if k != vt.VISUAL_INDEX})
    assert sum("_deepstack_process" in r for r in control) >= 2, control


def test_the_deepstack_add_is_replaced_only_where_it_gives_the_models_own():
    """By trait, on a probe: a language model whose own add differs (here it scales the features)
    keeps it; one without deepstack (Qwen2.5-VL's) gets nothing."""

    class Own(torch.nn.Module):
        def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
            hidden_states = hidden_states.clone()
            hidden_states[visual_pos_masks, :] = hidden_states[visual_pos_masks, :] + visual_embeds
            return hidden_states

    class Scaled(Own):
        def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
            return super()._deepstack_process(hidden_states, visual_pos_masks, 0.5 * visual_embeds)

    assert vt._same_deepstack(Own()) and not vt._same_deepstack(Scaled()) and not vt._same_deepstack(torch.nn.Module())
    _, model, _ = _towers("qwen2_5_vl")
    assert "_deepstack_process" not in vars(_inner(model).language_model)


@pytest.mark.parametrize("variant", ["", "checkpointed", "lora"])
@pytest.mark.parametrize("family", PLANNED)
def test_a_planned_packed_forward_equals_the_unplanned_one(family, variant):
    """The whole model: the packed batch with its plan (host grid, offsets' host copies, the
    placeholder mask without its device check) gives the logits and gradients of the same batch
    without one, which test_vision.py checks against every example alone; also with raypack's
    full gradient checkpointing, whose recompute takes the plan's tensors again, and through
    raypack's LoRA (all-linear, both towers: a peft wrapper around the planned model)."""
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.model import checkpointing
    from raypack.model.adapters import apply_adapters

    config, model, _ = _towers(family)
    if variant == "checkpointed":
        checkpointing.enable(model, "full")
        model.train()
    if variant == "lora":
        model = random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))
        assert vt.installed(model)
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    labels = batch.pop("labels")
    planned = {**batch, **vt.plan_batch(vt.tower_of(model), batch, config.image_token_id)}
    grads, logits = [], []
    for b in (_moved(planned), batch):
        model.zero_grad(set_to_none=True)
        out = model(**b).logits
        torch.nn.functional.cross_entropy(out[0], labels[0], ignore_index=-100).backward()
        logits.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(logits[0], logits[1], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-5, atol=1e-7), name


def test_a_row_whose_image_tokens_miss_its_features_is_refused_on_the_host():
    """The count transformers checks on the device, checked where the plan is made instead."""
    config, model, _ = _towers("qwen2_5_vl")
    batch = collate_vision_packed(with_positions(model, make_examples(VLM_FAMILIES["qwen2_5_vl"], config)))
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == config.image_token_id).nonzero()[0]] = 7
    with pytest.raises(ValueError, match=r"holds \d+ image tokens for \d+ image features"):
        vt.plan_batch(vt.tower_of(model), {**batch, "input_ids": ids}, config.image_token_id)


@pytest.mark.parametrize("family,why", [
    ("glm4v", r"Glm4vVisionModel with its grid on the host.*not on the expected device"),
])  # fmt: skip
def test_a_tower_that_reads_its_grid_elsewhere_stays_on_transformers_path(family, why):
    """GLM-4.1V's tower indexes its grid again in its position embeddings, with device indices: on
    the meta probe (as on CUDA) a host grid meets a device tensor. It keeps transformers' sdpa and
    its own grid handling, and still trains exactly (test_vision.py)."""
    import re

    model = build_vlm(VLM_FAMILIES[family].build_config(), "sdpa_varlen")
    assert not vt.installed(model)
    assert re.search(why, vt.host_plan_refusal(vt.tower_of(model)))
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_a_tower_calling_an_unknown_helper_is_refused():
    """A forward calling a vision_utils helper raypack doesn't plan (here: the nearest-position one
    NaViT-style towers use) is left alone, named."""
    import transformers.vision_utils as vu

    class Tower(torch.nn.Module):
        def forward(self, hidden_states, grid_thw, **kwargs):
            return get_vision_nearest_position_ids(grid_thw, 4, kwargs=kwargs)  # noqa: F821

    Tower.forward.__globals__["get_vision_nearest_position_ids"] = vu.get_vision_nearest_position_ids
    assert "calls get_vision_nearest_position_ids, which raypack doesn't precompute" in vt.host_plan_refusal(Tower())


def test_the_tower_attention_refuses_what_it_does_not_do():
    q = torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="bidirectional"):
        vt.tower_attention(torch.nn.Module(), q, q, q, is_causal=True, cu_seq_lens_q=cu, max_length_q=4)
    out, _ = vt.tower_attention(torch.nn.Module(), q, q, q, cu_seq_lens_q=cu, max_length_q=4)
    alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, 2:], q[:, :, 2:], q[:, :, 2:])
    assert torch.equal(out[0, 2:], alone[0].transpose(0, 1))


def test_a_plan_that_differs_from_the_towers_own_values_is_refused(monkeypatch):
    """The planners must call each helper as the tower's forward does: here a window planner with
    the wrong window size is caught against the values the tower's own forward computes."""
    _, model, _ = _towers("qwen2_5_vl")
    tower = vt.tower_of(model)
    assert vt.host_plan_refusal(tower) is None

    def wrong(t, grid):
        index, cu = vt.vu.get_vision_window_index(grid, spatial_merge_size=t.spatial_merge_size,
                                                  window_size=2 * t.window_size, patch_size=t.patch_size)  # fmt: skip
        return {"window_index": index, **vt._offsets("cu_window_seqlens", "max_window_seqlen", cu)}

    monkeypatch.setitem(vt.PLANNERS, "get_vision_window_index", wrong)
    assert "own get_vision_window_index gives other values than raypack's plan" in vt.host_plan_refusal(tower)


def test_the_placeholder_mask_is_replaced_only_where_it_gives_the_models_own():
    """Without the device check only where the replacement's masks are the model's own (a probe
    row); a model whose get_placeholder_mask differs keeps it."""

    class Inner(torch.nn.Module):
        config = type("C", (), {"image_token_id": 5, "video_token_id": 6})()

        def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
            return (input_ids == 5)[..., None], (input_ids == 6)[..., None]

    class Other(Inner):
        def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
            return (input_ids >= 5)[..., None], (input_ids == 6)[..., None]  # video tokens count as images too

    assert vt._same_masks(Inner()) and not vt._same_masks(Other())
