"""raypack/data/vision_collate.py, end to end from the bundled image sample: prepared examples
(raypack/data/images.py) planned by their lengths, image tokens included (balanced, two ranks),
collated with each example's own positions, train a tiny Qwen2.5-VL for three AdamW steps to the
same losses and weights as every example run alone through the model's own forward (pad: one
example a micro-batch), the loss in both the sum of token losses over the step's label tokens.

The two ranks are simulated in one process (each step sums both ranks' packs); the same on two
Ray Train workers, through the loop's collate (VisionRows): tests/ray/train/test_loop_vision.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from raypack.config import ASSETS
from raypack.data.images import ImageTokenizer
from raypack.data.strategies import get_strategy
from raypack.data.vision_collate import collate_vision_packed
from raypack.model.vision import build_vlm, example_positions, tiny_vlm_config, token_types

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLE = ASSETS / "vision_sample"


@pytest.fixture(scope="module")
def prepared():
    processor = ASSETS / "vlm_processor"
    image_processor, tokenizer = AutoImageProcessor.from_pretrained(processor), AutoTokenizer.from_pretrained(processor)
    tokenize = ImageTokenizer(image_processor, tokenizer)
    records = [json.loads(line) for line in (SAMPLE / "vision.jsonl").read_text().splitlines()][:22]
    records += [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
                for w in ("yes", "no")]  # text-only examples pack beside image ones  # fmt: skip
    examples = [tokenize(r, f"vision.jsonl:{i + 1}", base_dir=SAMPLE) for i, r in enumerate(records)]
    return tokenize, tiny_vlm_config(image_processor, tokenizer), examples


def _ready(model, tokenize, example):
    pixels = tokenize.example_pixels(example)
    ids = torch.tensor(example["input_ids"])
    grid = torch.as_tensor(pixels["image_grid_thw"]) if pixels else None
    return {"input_ids": ids, "labels": torch.tensor(example["labels"]), "image_grid_thw": grid,
            "pixel_values": torch.as_tensor(pixels["pixel_values"]) if pixels else None,
            "position_ids": example_positions(model, ids, grid)}  # fmt: skip


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum", ignore_index=-100)


def test_lengths_count_image_tokens(prepared):
    tokenize, config, examples = prepared
    for e in examples:
        image_tokens = sum(int(np.prod(g)) // 4 for g in e["image_grid_thw"])
        assert e["length"] == len(e["input_ids"]) and e["input_ids"].count(config.image_token_id) == image_tokens
        assert e["vision_patches"] == sum(int(np.prod(g)) for g in e["image_grid_thw"])


def test_packed_trains_like_pad_for_three_steps_on_two_ranks(prepared):
    tokenize, config, examples = prepared
    lengths = np.array([e["length"] for e in examples])
    plan = get_strategy("balanced", budget=160).plan(lengths, num_ranks=2)
    assert plan.num_steps >= 3 and np.bincount(plan.pack).max() > 1, "no pack holds two examples"
    torch.manual_seed(0)
    packed = build_vlm(config, "sdpa_varlen").train()
    alone = build_vlm(config, "eager").train()
    alone.load_state_dict(packed.state_dict())
    # no dropout in these configs, so train mode is deterministic; AdamW as the loop uses it
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (packed, alone)]
    for step in range(3):
        packs = [plan.example[plan.pack == step * 2 + rank] for rank in range(2)]
        ready = [[_ready(packed, tokenize, examples[i]) for i in pack] for pack in packs]
        batches = [collate_vision_packed(r) for r in ready if r]
        n_labels = sum(int((b["labels"][0, 1:] != -100).sum()) for b in batches)
        # packed: one forward per rank's pack
        losses = []
        for b in batches:
            b = dict(b)
            labels = b.pop("labels")
            losses.append(_loss_sum(packed(**b).logits, labels) / n_labels)
        sum(losses).backward()
        # pad: one example a micro-batch, the model's own forward and positions
        ref_losses = []
        for e in (e for r in ready for e in r):
            kwargs = {"input_ids": e["input_ids"][None]}
            if e["pixel_values"] is not None:
                kwargs.update(pixel_values=e["pixel_values"], image_grid_thw=e["image_grid_thw"],
                              mm_token_type_ids=token_types(config, kwargs["input_ids"]))  # fmt: skip
            labels = e["labels"].clone()
            labels[0] = -100
            ref_losses.append(_loss_sum(alone(**kwargs).logits, labels[None]) / n_labels)
        sum(ref_losses).backward()
        # every gradient, relative to its scale floored at 1e-3 of the largest (tests/exactness.py)
        grads = {n: p.grad for n, p in alone.named_parameters()}
        floor = 1e-3 * max(g.abs().max().item() for g in grads.values())
        for n, p in packed.named_parameters():
            err = (p.grad - grads[n]).abs().max().item() / max(grads[n].abs().max().item(), floor)
            assert err < 1e-5, f"step {step}: {n} gradient off by {err:.1e}"
        assert sum(losses).item() == pytest.approx(sum(ref_losses).item(), rel=1e-5), f"step {step}"
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    ref = dict(alone.named_parameters())
    parts = {"visual.blocks": 0, "visual.merger": 0, "language_model": 0}
    for name, p in packed.named_parameters():
        # AdamW moves every weight by about lr whatever its gradient's size, so a gradient near
        # zero (~1e-8: a key bias in rotary dimensions that barely rotate) still moves ~lr, with
        # its rounding scaled up: absolute 1e-5 is 1% of lr. The gradients above are the tight check.
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-5, msg=name)
        parts.update({k: parts[k] + 1 for k in parts if k in name})
    assert all(parts.values()), parts
