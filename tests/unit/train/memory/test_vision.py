"""raypack/train/memory/vision.py: a VLM's vision tower in the memory estimate and the plan's
weights, against what autograd keeps, what torch's FLOP counter counts and what the model holds."""

from __future__ import annotations

import copy

import pytest
import torch
from saved import saved_bytes

from raypack.config import load
from raypack.model.build import model_config
from raypack.model.vision import build_vlm, parts
from raypack.train.memory.estimate import Arch, estimate, tower_cost

pytestmark = pytest.mark.usefixtures("one_thread")

GRIDS = ([[1, 8, 8]], [[1, 8, 8], [1, 4, 12], [1, 20, 20]], [[1, 16, 24]])
"""Images of a micro-batch (t, h, w patches): one, three of mixed sizes, one off the windows' 4x4."""


def tiny(**vision):
    config = copy.deepcopy(model_config("tiny-qwen2_5_vl"))
    for k, v in vision.items():
        setattr(config.vision_config, k, v)
    return config


SHAPES = {"tiny": {}, "wider": dict(hidden_size=64, num_heads=4, intermediate_size=160, depth=3,
                                    fullatt_block_indexes=[0, 2])}  # fmt: skip


def pixels(config, grids):
    vc = config.vision_config
    g = torch.tensor(grids)
    return torch.randn(int(g.prod(1).sum()), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
                       dtype=torch.bfloat16), g  # fmt: skip


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_tower_term_is_what_autograd_keeps(shape):
    """The tower's forward (bf16, as a GPU run holds it) over a micro-batch's patches: the estimate
    within 10% of the bytes autograd saves. Seen: 1.00 for every grid, both shapes."""
    config = tiny(**SHAPES[shape])
    arch = Arch.from_config(config)
    model = build_vlm(config, "sdpa_varlen", torch.bfloat16)
    for grids in GRIDS:
        px, g = pixels(config, grids)
        measured = saved_bytes(model, lambda: model.model.visual(px, grid_thw=g))
        estimated = arch.tower.activations(px.shape[0])
        assert 0.9 < estimated / measured < 1.1, f"{shape} {grids}: {estimated} estimated, {measured} measured"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_plan_s_flops_are_torch_s_count(shape):
    """Forward FLOPs of the tower over one image and of the language model over n tokens, as
    torch's FlopCounterMode counts them with eager attention (which shows its matmuls): the cost's
    per patch and per patch² (a third of training's), and per token and per length² (eager computes
    the whole n x n a causal kernel halves), exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny(**SHAPES[shape])
    cost = tower_cost(config)
    model = build_vlm(config, "eager", torch.float32)
    for side in (8, 16, 24):
        px, g = pixels(config, [[1, side, side]])
        with FlopCounterMode(display=False) as fc:
            model.model.visual(px.float(), grid_thw=g)
        n = side * side
        assert fc.get_total_flops() == pytest.approx((cost.patch_flops * n + cost.image_flops * n * n) / 3)
    for n in (32, 64):
        with FlopCounterMode(display=False) as fc:
            model(input_ids=torch.randint(10, 100, (1, n)))
        assert fc.get_total_flops() == pytest.approx((cost.token_flops * n + 2 * cost.length_flops * n * n) / 3)


def test_the_tower_s_parameters_are_counted_and_frozen_parts_train_nothing():
    config = tiny()
    arch = Arch.from_config(config)
    model = build_vlm(config, "sdpa_varlen", torch.float32)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    found = parts(model)
    vision, projector = (sum(sizes[n] for n in found[k]) for k in ("vision", "projector"))
    assert (arch.tower.params, arch.tower.projector) == (vision + projector, projector)
    assert arch.params == pytest.approx(sum(sizes.values()), rel=0.01)  # the language model's arithmetic
    base = ["model.name=tiny-qwen2_5_vl", "train.num_workers=1", "pack.budget=256"]
    full = estimate(load(None, base), arch, zero={}, checkpointing="full").trained
    for freeze, less in (("[vision]", vision), ("[projector]", projector), ("[vision,projector]", vision + projector)):
        frozen = estimate(load(None, [*base, f"model.freeze={freeze}"]), arch, zero={}, checkpointing="full")
        assert full - frozen.trained == less


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_estimate_adds_the_tower_over_the_widest_micro_batch_s_patches(mode):
    """The tower's activations grow with the patches given (the plan's widest micro-batch), by its
    per-patch bytes; without a plan, every token an image token (merge² patches each)."""
    arch = Arch.from_config(tiny())
    cfg = load(None, ["model.name=tiny-qwen2_5_vl", "train.num_workers=1", "pack.budget=256"])
    few, many = (estimate(cfg, arch, zero={}, checkpointing=mode, patches=p) for p in (100, 900))
    tower = arch.tower
    per_patch = tower.blocks * tower.block_bytes(mode) + tower.patch_bytes()
    grown = many.activations - few.activations
    assert grown >= 800 * per_patch and grown <= 800 * (per_patch + 2 * tower.block_bytes("none"))
    assert "vision tower over 900 patches a micro-batch" in many.line(cfg, arch)
    assert "over 1024 patches" in estimate(cfg, arch, zero={}, checkpointing=mode).line(cfg, arch)
    assert arch.tower.block_bytes("full") < arch.tower.block_bytes("selective") < arch.tower.block_bytes("none")
