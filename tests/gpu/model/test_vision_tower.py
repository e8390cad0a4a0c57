"""A grid tower from a host plan on CUDA (raypack/model/vision_tower.py): the varlen kernel
(flash-attn, else torch's varlen_attn) in bf16 and the per-image SDPA path in fp32 against
transformers' own sdpa tower on the same images, with CUDA's sync debug mode set to error around
the tower (any device read in it fails the test), and a whole packed forward with its plan against
the same model without one. The CPU can't see a host tensor meeting a device one; this can."""

from __future__ import annotations

import pytest
import torch
from vision_families import VLM_FAMILIES, make_examples, with_positions

from raypack.data.vision_collate import collate_vision_packed
from raypack.model import vision_tower as vt
from raypack.model.exact import host_copy
from raypack.model.vision import _inner, build_vlm
from raypack.train.prefetch import to_device

pytestmark = pytest.mark.gpu
PLANNED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
LAYOUT = ((5, [(4, 4)], 7), (9, [], 4), (3, [(4, 6), (2, 2)], 6), (2, [(12, 8)], 3))
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # relative, features; gradients twice that


def _models(family: str, dtype: torch.dtype):
    config = VLM_FAMILIES[family].build_config()
    torch.manual_seed(0)
    model = build_vlm(config, "sdpa_varlen", dtype=dtype).cuda()
    ref = build_vlm(config, "sdpa", dtype=dtype).cuda()
    ref.load_state_dict(model.state_dict())
    return config, model, ref


def _features(model, kwargs):
    out = _inner(model).get_image_features(**kwargs, return_dict=True)
    return [torch.cat(out.pooler_output)] + [torch.cat(f) for f in getattr(out, "deepstack_features", None) or []]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-kernel", "fp32-per-image"])
@pytest.mark.parametrize("family", PLANNED)
def test_the_planned_tower_on_cuda_equals_transformers_sdpa_and_reads_nothing(family, dtype, monkeypatch):
    config, model, ref = _models(family, dtype)
    assert vt.installed(model)
    kernels = []
    pick = vt._kernel
    monkeypatch.setattr(vt, "_kernel", lambda q: kernels.append(pick(q)) or kernels[-1])
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    plan = vt.plan(vt.tower_of(model), batch["image_grid_thw"])
    moved = to_device({"pixel_values": batch["pixel_values"].to(dtype), "image_grid_thw": batch["image_grid_thw"],
                       **plan}, "cuda")  # fmt: skip
    moved["image_grid_thw"] = host_copy(moved["image_grid_thw"])  # what the model's pre-hook does
    assert moved["image_grid_thw"].device.type == "cpu" and moved["image_cu_seqlens"].is_cuda
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine = _features(model, moved)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    theirs = _features(ref, {"pixel_values": batch["pixel_values"].to(dtype).cuda(),
                             "image_grid_thw": batch["image_grid_thw"].cuda()})  # fmt: skip
    from raypack.model.attention import flash_attn_available

    expected = None if dtype == torch.float32 else "flash_attn" if flash_attn_available() else "torch_varlen"
    assert set(kernels) == {expected}, kernels
    assert len(kernels) == len(vt.tower_of(model).blocks), kernels  # one attention call a block
    for a, b in zip(mine, theirs, strict=True):
        assert _rel(a, b) < TOLERANCE[dtype], f"{family} {dtype}: {_rel(a, b):.2e}"
    sum(f.float().square().sum() for f in mine).backward()
    sum(f.float().square().sum() for f in theirs).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in vt.tower_of(model).named_parameters(prefix="model.visual"):
        if p.grad is not None:
            assert _rel(p.grad, ref_params[name].grad) < 2 * TOLERANCE[dtype], f"{family} {dtype}: {name}"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_packed_forward_with_its_plan_equals_one_without(family):
    """The whole model on CUDA, bf16: the batch as VisionRows gives it (plan, host copies, the
    pre-hook's host grid, Qwen3-VL's deepstack positions) against the same batch without its plan
    (transformers derives it all on the device), same attention: no device mismatch anywhere in
    the model, the same logits."""
    config, model, _ = _models(family, torch.bfloat16)
    examples = make_examples(VLM_FAMILIES[family], config, layout=LAYOUT)
    batch = collate_vision_packed(with_positions(model, examples))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    batch.pop("labels")
    planned = {**batch, **vt.plan_batch(vt.tower_of(model), batch, config.image_token_id)}
    with torch.no_grad():
        a = model(**to_device(planned, "cuda")).logits
        b = model(**to_device(batch, "cuda")).logits
    assert _rel(a, b) < 1e-2
