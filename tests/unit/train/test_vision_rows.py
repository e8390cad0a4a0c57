"""raypack/train/vision_rows.py: a VLM run's packed rows, through the code the workers run
(VisionRows as prepare_step's collate, step.forward_backward, the chunked loss), give the loss and
every gradient (vision tower, projector, language model) of each example run alone through the
model's own forward (its own attention and positions, a batch of one, transformers' logits), fp32
on the CPU, 1e-5 relative; for each bundled tiny VLM: a grid processor on Qwen2.5-VL (mRoPE) and
whole CLIP pictures on LLaVA (text positions, each picture its own batch element in the tower).

The rows are jobs/configs/vlm_quickstart.yaml's, made by the pipeline's own stages (sources.read_unit,
encode.Encoder, the plan, pack.Router and assemble_rows), with the model and processor swapped by
the same overrides `raypack train` takes. The same on two Ray Train workers under ZeRO-2, for
three optimizer steps: tests/ray/train/test_loop_vision.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paths import REPO

from raypack.config import load

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = REPO / "jobs" / "configs" / "vlm_quickstart.yaml"
LLAVA = ("model.name=tiny-llava", "tokenize.tokenizer=raypack/assets/llava_processor")
"""The overrides that train the quickstart's data on the tiny LLaVA (docs/guides/vision.md)."""
IDEFICS3 = ("model.name=tiny-idefics3", "tokenize.tokenizer=raypack/assets/idefics3_processor")
"""... and on the tiny Idefics3."""


def prepared_rows(overrides=(), steps: int = 3) -> tuple[dict[int, list[dict]], dict[int, tuple], str]:
    """(each rank's first `steps` packed rows, images by example id, tokenizer folder) of the
    quickstart's config with `overrides`, planned by `balanced` for two ranks."""
    from raypack.data.encode import Encoder, kept_rows
    from raypack.data.listing import Sources, read_units
    from raypack.data.pack import Router, assemble_rows, plan_routing
    from raypack.data.sources import read_unit
    from raypack.data.strategies import make_plan
    from raypack.data.tower import grid_work, tower_extra
    from raypack.model.build import model_config
    from raypack.runs import absolute_paths
    from raypack.train.memory.estimate import tower_cost

    cfg = absolute_paths(load(str(CONFIG), list(overrides)))
    t = cfg.tokenize
    units = read_units(Sources.of(cfg.data.paths).files)
    table = read_unit({k: [v] for k, v in units[0].items()}, "auto").drop_columns(["error", "fatal"])
    table = kept_rows(Encoder(t.tokenizer, t.chat_template, t.label_mask, t.overlength, cfg.max_length)
                      .encode_table(table)).sort_by("example_id")  # fmt: skip
    ids, lengths = table["example_id"].to_numpy(), table["length"].to_numpy()
    # planned as a run plans it: each example's vision-tower work weighed by the model's tower, where
    # raypack sizes it (data/tower.py)
    work = grid_work(table["image_grid_thw"])
    plan = make_plan(lengths, cfg.pack, 2, 1, extra=tower_extra(work, tower_cost(model_config(cfg.model.name))))
    assert plan.num_steps >= steps and np.bincount(plan.pack).max() > 1, "no pack holds two examples"
    pieces = Router(plan_routing(plan, ids))(table)
    rows = {}
    for rank in range(2):
        mine = assemble_rows(pieces.filter(pieces["rank"].to_numpy() == rank), plan.reset_positions).to_pylist()
        assert [r["step"] for r in mine] == list(range(plan.num_steps))
        rows[rank] = mine[:steps]
    images = {e: (b, g) for e, b, g in zip(*(table[c].to_pylist() for c in ("example_id", "images", "image_grid_thw")))}
    return rows, images, t.tokenizer


@pytest.mark.parametrize("overrides", [(), LLAVA, IDEFICS3], ids=["qwen2_5_vl", "llava", "idefics3"])
def test_packed_rows_through_the_workers_code_equal_each_example_alone(overrides):
    from tests.unit.train.objectives.test_dpo import OneRankEngine

    from raypack.data.vision_collate import collate_vision_padded
    from raypack.model.build import load_model
    from raypack.model.vision import image_token_id, uses_mrope
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss, token_loss_sum
    from raypack.train.prefetch import prepare_step
    from raypack.train.vision_rows import VisionRows

    rows, images, processor = prepared_rows(overrides, steps=2)
    name = dict(o.split("=") for o in overrides).get("model.name", "tiny-qwen2_5_vl")
    torch.manual_seed(0)
    packed = load_model(name, attention="auto", dtype="float32")
    alone = load_model(name, attention="sdpa", dtype="float32")  # what `pad` trains: the model's own
    alone.load_state_dict(packed.state_dict())
    group = [rows[rank][k] for k in range(2) for rank in range(2)]

    engine = OneRankEngine(packed, micro_batches=1)
    step = prepare_step(group, collate=VisionRows(packed, images, processor))
    pictures = sum(int(b["pixel_values"].numel()) for b in step.batches if "pixel_values" in b)
    assert pictures and all(b["position_ids"].dim() == (3 if uses_mrope(packed) else 2) for b in step.batches)
    assert any(len(r["example_ids"]) > 1 for r in group), "no packed row holds two examples"
    loss = forward_backward(engine, step.batches, 1.0 / step.label_tokens, make_loss(packed, "chunked"))

    examples = VisionRows(alone, images, processor).examples(group)
    assert len(examples) == sum(len(r["example_ids"]) for r in group)
    ref = 0.0
    for e in examples:
        batch = collate_vision_padded([e], image_token_id(alone.config))
        labels = batch.pop("labels")
        ref = ref + token_loss_sum(alone(**batch).logits, labels)
    (ref / step.label_tokens).backward()

    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    grads = {n: p.grad for n, p in alone.named_parameters() if p.grad is not None}
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values())  # as tests/exactness.py floors
    parts = {"vision": 0, "projector": 0, "language": 0}
    for n, p in packed.named_parameters():
        assert (p.grad is None) == (n not in grads), f"{n}: a gradient in one run only"
        if p.grad is None:
            continue
        err = (p.grad - grads[n]).abs().max().item() / max(grads[n].abs().max().item(), floor)
        assert err < 1e-5, f"{n}: gradient off by {err:.1e}"
        part = ("projector" if "merger" in n or "multi_modal_projector" in n or "connector" in n else
                "vision" if "visual" in n or "vision_tower" in n or "vision_model" in n else "language")  # fmt: skip
        parts[part] += 1
    assert all(parts.values()), f"a part got no gradient compared: {parts}"


@pytest.mark.parametrize("overrides", [(), LLAVA, IDEFICS3], ids=["qwen2_5_vl", "llava", "idefics3"])
def test_a_padded_batch_of_several_examples_equals_each_alone(overrides):
    """`pad`'s micro-batches hold several examples: Idefics3's tiles padded with all-zero tiles
    (which its model drops), as its processor pads a batch."""
    from raypack.data.vision_collate import collate_vision_padded
    from raypack.model.build import load_model
    from raypack.model.vision import image_token_id
    from raypack.train.objectives.loss import token_loss_sum
    from raypack.train.vision_rows import VisionRows

    rows, images, processor = prepared_rows(overrides, steps=2)
    name = dict(o.split("=") for o in overrides).get("model.name", "tiny-qwen2_5_vl")
    torch.manual_seed(0)
    model = load_model(name, attention="sdpa", dtype="float32").eval()
    collate = VisionRows(model, images, processor)
    group = [rows[0][0], rows[0][1], rows[1][1]]  # Idefics3: pictures of 3 and of 5 tiles
    examples = collate.examples(group)
    pictures = [e["pixel_values"] for e in examples if e["pixel_values"] is not None]
    assert len(pictures) > 2 and (name != "tiny-idefics3" or len({p.shape[1] for p in pictures}) > 1)
    with torch.no_grad():
        batch = collate(group, padded=True)
        labels = batch.pop("labels")
        together = token_loss_sum(model(**batch).logits, labels)
        alone = 0.0
        for e in examples:
            one = collate_vision_padded([e], image_token_id(model.config))
            labels = one.pop("labels")
            alone = alone + token_loss_sum(model(**one).logits, labels)
    assert together.item() == pytest.approx(alone.item(), rel=1e-5)


def test_a_processor_that_does_not_fit_the_model_is_refused_on_the_worker_too():
    from raypack.config import ASSETS
    from raypack.errors import InputError
    from raypack.model.build import load_model
    from raypack.train.vision_rows import VisionRows

    llava = load_model("tiny-llava", attention="auto", dtype="float32")
    with pytest.raises(InputError, match=r"vlm_processor': its image processor gives image_grid_thw beside "
                                         r"pixel_values, but LlavaForConditionalGeneration takes neither"):
        VisionRows(llava, {}, str(ASSETS / "vlm_processor"))
    qwen = load_model("tiny-qwen2_5_vl", attention="auto", dtype="float32")
    with pytest.raises(InputError, match=r"llava_processor': its image processor gives pixel_values alone, but "
                                         r"Qwen2_5_VL.* takes image_grid_thw"):
        VisionRows(qwen, {}, str(ASSETS / "llava_processor"))
    with pytest.raises(InputError, match=r"idefics3_processor': its image processor gives pixel_attention_mask .*"
                                         r"Qwen2_5_VL.* takes image_grid_thw"):
        VisionRows(qwen, {}, str(ASSETS / "idefics3_processor"))


def test_images_are_decoded_on_a_pool_once_an_owner_and_give_the_same_batch(monkeypatch):
    """VisionRows decodes a micro-batch's images on `workers` threads: the same tensors as on one
    thread, packed and padded; each image owner's bytes are processed once a call (a preference
    pair's two sequences share their pair's images), here two rows naming the same examples."""
    from raypack.model.build import load_model
    from raypack.train.vision_rows import VisionRows

    rows, images, processor = prepared_rows(steps=2)
    model = load_model("tiny-qwen2_5_vl", attention="auto", dtype="float32")
    group = [rows[0][0], rows[1][0], rows[0][0]]  # the first row twice: its examples' images once
    serial, pooled = VisionRows(model, images, processor, workers=1), VisionRows(model, images, processor, workers=2)
    calls = []
    original = pooled.tokenize.example_pixels
    monkeypatch.setattr(pooled.tokenize, "example_pixels", lambda ex, where: calls.append(where) or original(ex, where))
    for padded in (False, True):
        a, b = serial(group, padded=padded), pooled(group, padded=padded)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    with_images = {e for r in group for e in r["example_ids"] if images.get(e, ([], []))[0]}
    assert len(calls) == 2 * len(with_images) and len(set(calls)) == len(with_images)
    assert pooled._pool is not None and serial._pool is None
