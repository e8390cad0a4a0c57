"""A VLM run's optimizer steps (raypack/train/loop.py with raypack/train/vision_rows.py's
VisionRows) on packed rows equal `pad`, one example a micro-batch, through the model's own forward.

jobs/configs/vlm_quickstart.yaml's data, tokenizer, model, strategy and budget: the bundled image
sample read and tokenized by the pipeline's own stages (sources.read_unit, encode.Encoder), planned
by `balanced` for two ranks, its rows built by the pack stage's own code (pack.Router and
assemble_rows, without Ray tasks, to keep this test's cost to one Ray Train fit). Two Ray Train
workers train three optimizer steps under ZeRO-2 with the chunked loss; the reference, in this
process, runs every example of each step alone, padded (`pad`'s batch of one), with the model's
own attention, positions (get_rope_index) and logits, and raypack's AdamW. Losses at every step,
every gradient of the first (vision tower and projector included) and the weights after three
steps agree.
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = pytest.mark.ray
STEPS = 3


def _train_config():
    from raypack.config import TrainConfig

    # A constant rate and no clipping: the reference's AdamW needs no schedule. 1e-3, not the
    # config's 3e-3: Adam moves a weight whose gradient is rounding noise in both runs (~1e-9,
    # a rotary dimension that barely rotates) by up to lr in either direction, and at 3e-3 two
    # such updates moved step 3's loss by 2.3e-5 relative; the gradients themselves agree to 1e-6.
    return TrainConfig(num_workers=2, zero_stage=2, grad_accum=1, grad_clip=0.0, warmup_steps=0, min_lr_ratio=1.0,
                       lr=1e-3)  # fmt: skip


def loop(config):
    import functools

    import deepspeed
    import ray.train

    from raypack.model.build import load_model
    from raypack.train.engine import setup_engine
    from raypack.train.loop import forward_backward, global_count
    from raypack.train.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.vision_rows import VisionRows

    rank = ray.train.get_context().get_world_rank()
    with open(config["data"], "rb") as f:
        rows, images, processor = pickle.load(f)
    torch.manual_seed(0)
    model = load_model("tiny-qwen2_5_vl", attention="auto", dtype="float32")
    engine, _ = setup_engine(model, _train_config(), dtype=torch.float32, world_size=2, total_steps=STEPS)
    loss_fn = make_loss(engine, "chunked")
    collate = functools.partial(prepare_step, collate=VisionRows(engine.module, images, processor))
    losses = []
    for k in range(STEPS):
        step = collate([rows[rank][k]])  # what the loop's prefetcher builds
        assert "pixel_values" in step.batches[0] and step.batches[0]["position_ids"].shape[0] == 4
        n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
        loss_sum = forward_backward(engine, step.batches, 2 / n, loss_fn)
        losses.append(float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n)
        if k == 0:
            grads = {name: deepspeed.utils.safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
        engine.step()
    params = {name: deepspeed.utils.safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "params": params}, config["out"])


def test_packed_vlm_steps_equal_pad_one_example_a_micro_batch_on_two_ranks(ray_local, tmp_path):
    from tests.ray.train.test_loop import fit_on_gloo
    from tests.unit.train.test_vision_rows import prepared_rows

    from raypack.data.vision_collate import collate_vision_padded
    from raypack.model.build import load_model
    from raypack.train.engine import make_optimizer
    from raypack.train.loss import token_loss_sum
    from raypack.train.vision_rows import VisionRows

    rows, images, processor = prepared_rows(steps=STEPS)  # the rows of tests/unit/train/test_vision_rows.py
    data = tmp_path / "rows.pkl"
    data.write_bytes(pickle.dumps((rows, images, processor)))
    out = tmp_path / "rank0.pt"
    fit_on_gloo(loop, tmp_path, "vlm-exact", 2, out=str(out), data=str(data))
    got = torch.load(out)

    torch.manual_seed(0)
    model = load_model("tiny-qwen2_5_vl", attention="sdpa", dtype="float32")  # what `pad` trains
    optimizer = make_optimizer([{"params": list(model.parameters())}], _train_config())
    unpack = VisionRows(model, images, processor)
    for k in range(STEPS):
        examples = unpack.examples([rows[rank][k] for rank in range(2)])
        assert sum(e["pixel_values"] is not None for e in examples) > 2
        batches = [collate_vision_padded([e], model.config.image_token_id) for e in examples]  # one example a micro-batch
        n = sum(int((b["labels"][0, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            b = dict(b)
            labels = b.pop("labels")
            total = total + token_loss_sum(model(**b).logits, labels)
        (total / n).backward()
        assert got["losses"][k] == pytest.approx((total / n).item(), rel=1e-5), f"step {k + 1}"
        if k == 0:
            towers = 0
            for name, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
                towers += "visual" in name
            assert towers, "no vision-tower gradient was compared"
        optimizer.step()
        optimizer.zero_grad()
    assert got["losses"][-1] < got["losses"][0]
    # Adam moves an entry whose gradient is rounding noise in both runs by up to lr (1e-3) a step
    # in either direction, whatever the gradient's size: seen, one entry of 8192 in an MLP weight
    # 2.8e-5 apart after three steps, the rest within 1e-5. 1e-4 is a tenth of one step's
    # update; the gradients (1e-6) and the losses at every step (1e-5) above are the tight checks.
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
