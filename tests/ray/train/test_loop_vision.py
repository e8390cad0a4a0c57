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

The torch engine, in the same worker group: FSDP2 at zero_stage 3 on the same rows, and a fourth
step in which rank 1's micro-batch holds text alone, so its forward skips the vision tower that rank
0's runs (FSDP2 keeps the tower in its root unit: gathered on both ranks, zeros reduced for it
where it didn't run, raypack/train/engines/torch_engine.py); the same reference over four steps.

DPO with image prompts, in the same worker group (a Ray Train run costs most of this test's
time): one optimizer step of 2 ranks x 2 micro-batches of packed image pairs
(jobs/configs/vlm_dpo_quickstart.yaml's data, processor and budget) under ZeRO-2 and ZeRO-3,
DPOLoss with VisionRows as the loop runs it, against every sequence run alone through
transformers' Qwen2.5-VL forward, the loss written from its formula: the loss, each sequence's
log-probability (dpo_reference.rows_logps, the reference pass's code) and every gradient.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dpo_check import alone_reference, encoded_pairs, grad_errors, packed_pair_rows, pairs_alone_loss, perturb
from paths import REPO

from raypack.config import DpoConfig, load

# one_thread: the references run here, in the driver, beside the Ray workers (tests/ray/train/test_dpo.py)
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]
STEPS = 3
DPO_CONFIG = REPO / "jobs" / "configs" / "vlm_dpo_quickstart.yaml"
DPO = DpoConfig(beta=0.5, sft_weight=0.3)
DPO_STAGES = (2, 3)


def vlm_folder() -> str:
    """The tiny Qwen2.5-VL's saved folder, as a user's model.name (tests/checkpoints.py); fp32, for
    fp32's tolerances against `pad`, one example at a time."""
    from checkpoints import saved

    return str(saved("tiny-qwen2_5_vl", dtype=torch.float32))


def _train_config(engine: str = "deepspeed"):
    from raypack.config import TrainConfig

    # A constant rate and no clipping: the reference's AdamW needs no schedule. 1e-3, not the
    # config's 3e-3: Adam moves a weight whose gradient is rounding noise in both runs (~1e-9,
    # a rotary dimension that barely rotates) by up to lr in either direction, and at 3e-3 two
    # such updates moved step 3's loss by 2.3e-5 relative; the gradients themselves agree to 1e-6.
    # DeepSpeed's ZeRO-2; the torch engine's FSDP2 resharding after each layer (zero_stage 3)
    return TrainConfig(num_workers=2, zero_stage=2 if engine == "deepspeed" else 3, grad_accum=1, grad_clip=0.0,
                       warmup_steps=0, min_lr_ratio=1.0, lr=1e-3, engine=engine)  # fmt: skip


TEXT_ONLY = {"input_ids": [5, 17, 33, 9, 41, 12, 7, 88, 23], "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3],
             "example_ids": [10**9, 10**9 + 1], "num_tokens": 9}
"""Two examples without an image (ids no image is stored under), for rank 1's fourth step."""
TEXT_ONLY["labels"] = TEXT_ONLY["input_ids"]


def steps_of(rows: dict, rank: int, engine: str) -> list[dict]:
    """The rows `rank` trains a step at a time: the first STEPS; the torch engine's run one more,
    rank 0 an image row again, rank 1 text alone."""
    return rows[rank][:STEPS] + ([rows[rank][0] if rank == 0 else TEXT_ONLY] if engine == "torch" else [])


def loop(config):
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    with open(config["data"], "rb") as f:
        rows, images, processor = pickle.load(f)
    sft = {name: sft_steps(name, steps_of(rows, rank, name), images, processor) for name in ("deepspeed", "torch")}
    dpo = {stage: dpo_step(config, stage) for stage in DPO_STAGES}
    if rank == 0:
        torch.save({**sft, "dpo": dpo}, config["out"])


def sft_steps(name: str, rows: list[dict], images, processor) -> dict:
    """`rows`' optimizer steps on engine `name` (one micro-batch each), as the loop takes them."""
    import functools

    from engine_views import grads as full_grads
    from engine_views import params as full_params

    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.vision_rows import VisionRows

    torch.manual_seed(0)  # what follows draws the same in the driver and the workers
    cfg = _train_config(name)
    # FSDP2's rank 1 builds the folder's structure on the meta device and gets rank 0's weights
    with engines.building(cfg, dtype=torch.float32, world_size=2):
        model = load_model(vlm_folder(), attention="auto", dtype="float32")
    engine = engines.build(model, cfg, dtype=torch.float32, world_size=2, total_steps=len(rows))
    loss_fn = make_loss(engine, "chunked")
    collate = functools.partial(prepare_step, collate=VisionRows(engine.module, images, processor))
    losses = []
    for k, row in enumerate(rows):
        step = collate([row])  # what the loop's prefetcher builds
        assert ("pixel_values" in step.batches[0]) == (row is not TEXT_ONLY)
        assert step.batches[0]["position_ids"].shape[0] == 4
        n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
        loss_sum = forward_backward(engine, step.batches, 2 / n, loss_fn)
        losses.append(float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n)
        if k == 0:
            grads = full_grads(engine)
        engine.step()
    params = full_params(engine)
    engine.destroy()
    return {"losses": losses, "grads": grads, "params": params}


def _dpo_policy(attention: str, moved: bool = True):
    """The tiny VLM a DPO step trains: seeded, then moved off the reference (its starting weights,
    `moved` False)."""
    from raypack.model.build import load_model

    torch.manual_seed(0)  # what follows draws the same in the driver and the workers
    model = load_model(vlm_folder(), attention=attention, dtype="float32")
    if moved:
        perturb([model], scale=0.01)
    return model


def dpo_step(config, stage: int) -> dict:
    """One DPO optimizer step on this rank's image-pair rows, as the loop takes it (DPOLoss with a
    VisionRows collate), and the policy's per-sequence sums through the reference pass's code."""
    import deepspeed
    import ray.train

    from raypack.config import TrainConfig
    from raypack.train.objectives.dpo import DPOLoss
    from raypack.train.objectives.dpo_reference import rows_logps
    from raypack.train.engines.deepspeed_engine import setup_engine
    from raypack.train.loop import global_count
    from raypack.train.objectives.loss import make_loss
    from raypack.train.step import forward_backward
    from raypack.train.stepvalues import HostCounts
    from raypack.train.vision_rows import VisionRows

    rank = ray.train.get_context().get_world_rank()
    with open(config["pairs"], "rb") as f:
        rows, images, processor, reference = pickle.load(f)
    cfg = TrainConfig(num_workers=2, zero_stage=stage, grad_accum=2, grad_clip=0.0, warmup_steps=0,
                      deepspeed_preset=config["preset"])  # fmt: skip
    engine = setup_engine(_dpo_policy("auto"), cfg, dtype=torch.float32, world_size=2, total_steps=1)
    collate = VisionRows(engine.module, images, processor)
    loss = DPOLoss(make_loss(engine, "chunked", chunk_tokens=7), DPO, global_count, reference=reference,
                   collate=collate)  # fmt: skip
    logps = rows_logps(loss, engine, rows[rank], False, 0, engine.device)
    step = loss.prepare_step(rows[rank])
    assert all("pixel_values" in b and b["position_ids"].shape[0] == 4 for b in step.batches)
    host, sft_scale = loss.host(HostCounts(2).sums(*loss.counts(step)))
    pairs = host["pairs"]
    total = forward_backward(engine, step.batches, 2 * len(step.batches) / pairs, loss, context=sft_scale)
    value = float(global_count([float(total)], engine.device)[:, 0].sum()) / pairs
    grads = {name: deepspeed.utils.safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, logps)
    engine.destroy()
    return {"loss": value, "pairs": pairs, "grads": grads, "logps": {k: v for d in everyone for k, v in d.items()}}


def _dpo_rows():
    """(rows of each rank's first two micro-batches, images by example id, processor folder, the
    pairs' tokenized rows) from the DPO quickstart's data, as the pipeline's stages make them."""
    from raypack.runs import absolute_paths

    cfg = absolute_paths(load(str(DPO_CONFIG)))
    path, processor = cfg.data.paths[0], cfg.tokenize.tokenizer
    table = encoded_pairs(path, 12, tokenizer=processor)
    ranks = packed_pair_rows(path, budget=cfg.pack.budget, strategy=cfg.pack.strategy, ranks=2, table=table)
    rows = [r[:2] for r in ranks]
    assert all(len(x["example_ids"]) >= 4 for r in rows for x in r), "no row holds two image pairs"
    ids = sorted(i for r in rows for x in r for i in x["example_ids"])
    table = table.filter(np.isin(table["example_id"].to_numpy(), ids))
    images = {e: (b, g) for e, b, g in zip(*(table[c].to_pylist() for c in ("example_id", "images", "image_grid_thw")))
              if b is not None}  # fmt: skip
    return rows, images, processor, table


def test_packed_vlm_steps_equal_pad_one_example_a_micro_batch_on_two_ranks(ray_local, tmp_path):
    from tests.ray.train.test_loop import fit_on_gloo
    from tests.unit.train.test_vision_rows import prepared_rows

    vlm_folder()  # written here once, read by the workers
    rows, images, processor = prepared_rows(steps=STEPS)  # the rows of tests/unit/train/test_vision_rows.py
    data = tmp_path / "rows.pkl"
    data.write_bytes(pickle.dumps((rows, images, processor)))
    pair_rows, pair_images, _, table = _dpo_rows()
    start = _dpo_policy("eager", moved=False)  # the reference: the starting weights
    inputs = _alone_inputs(table, pair_images, processor, start.config)
    reference = alone_reference(start, table, inputs)
    pairs = tmp_path / "pairs.pkl"
    pairs.write_bytes(pickle.dumps((pair_rows, pair_images, processor, reference)))
    out = tmp_path / "rank0.pt"
    fit_on_gloo(loop, tmp_path, "vlm-exact", 2, out=str(out), data=str(data), pairs=str(pairs))
    got = torch.load(out)
    _check_dpo(got["dpo"], table, inputs, reference)

    reference = _pad_reference({rank: steps_of(rows, rank, "torch") for rank in range(2)}, images, processor)
    for name, steps in (("deepspeed", STEPS), ("torch", STEPS + 1)):
        _check_sft(name, got[name], reference, steps)


def _pad_reference(rows: dict, images, processor) -> dict:
    """What `pad` trains, one example a micro-batch, through the model's own forward: each step's
    loss, the first step's gradients and the weights after each step."""
    from raypack.data.vision_collate import collate_vision_padded
    from raypack.model.build import load_model
    from raypack.train.engines.optim import make_optimizer
    from raypack.train.objectives.loss import token_loss_sum
    from raypack.train.vision_rows import VisionRows

    torch.manual_seed(0)  # what follows draws the same in the driver and the workers
    model = load_model(vlm_folder(), attention="sdpa", dtype="float32")  # what `pad` trains
    optimizer = make_optimizer([{"params": list(model.parameters())}], _train_config())
    unpack = VisionRows(model, images, processor)
    out = {"losses": [], "params": []}
    for k in range(len(rows[0])):
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
        out["losses"].append((total / n).item())
        if k == 0:
            out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        out["params"].append({name: p.detach().clone() for name, p in model.named_parameters()})
    return out


def _check_sft(engine: str, got: dict, reference: dict, steps: int) -> None:
    for k in range(steps):
        assert got["losses"][k] == pytest.approx(reference["losses"][k], rel=1e-5), f"{engine}: step {k + 1}"
    towers = 0
    for name, g in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{engine}: {name}")
        towers += "visual" in name
    assert towers, "no vision-tower gradient was compared"
    assert got["losses"][STEPS - 1] < got["losses"][0]
    # Adam moves an entry whose gradient is rounding noise in both runs by up to lr (1e-3) a step
    # in either direction, whatever the gradient's size: seen, one entry of 8192 in an MLP weight
    # 2.8e-5 apart after three steps (1.2e-4 on another machine), the rest within 1e-5. Entries
    # whose first gradient is below 1e-7 (rounding noise, as tests/ray/train/test_loop.py) are left
    # out; 1e-4 is a tenth of one step's update; the gradients (1e-6) and the losses at every step
    # (1e-5) above are the tight checks.
    for name, p in reference["params"][steps - 1].items():
        signal = reference["grads"][name].abs() > 1e-7
        torch.testing.assert_close(got["params"][name][signal], p[signal], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{engine}: {name}: {m}")


def _alone_inputs(table, images, processor, config):
    """The model's own image arguments for a tokenized pair row run alone: its pair's pictures (the
    bytes the source stage read) through the image processor, and the token types its
    get_rope_index reads."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    from raypack.model.vision import token_types

    image_processor = AutoImageProcessor.from_pretrained(processor)
    pixels = {}
    for eid, (blobs, _) in images.items():
        pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
        pixels[eid] = dict(image_processor(images=pictures, return_tensors="pt"))

    def inputs(row: dict) -> dict:
        pix = pixels[row["example_id"] - row["example_id"] % 2]  # a pair: its id + 0 (chosen) and + 1 (rejected)
        ids = torch.tensor([row["input_ids"]])
        return {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"],
                "mm_token_type_ids": token_types(config, ids)}

    return inputs


def _check_dpo(got: dict, table, inputs, reference: dict) -> None:
    """Each ZeRO stage's DPO step against the pairs alone (the loss from its formula)."""
    policy = _dpo_policy("eager")
    sums = alone_reference(policy, table, inputs)
    loss = pairs_alone_loss(policy, reference, table, DPO, inputs)
    loss.backward()
    for stage, r in got.items():
        assert r["pairs"] == table.num_rows // 2, stage
        assert r["logps"].keys() == sums.keys()
        for eid, value in sums.items():
            assert r["logps"][eid] == pytest.approx(value, rel=1e-5), f"zero {stage}: log p of example {eid}"
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-5), f"zero {stage}"
        errors = grad_errors(policy, r["grads"])
        worst = max(errors, key=errors.get)
        # as tests/ray/train/test_dpo.py: sums over 2 ranks and 2 micro-batches round in other orders
        assert errors[worst] < 1e-4, f"zero {stage}: {worst} off by {errors[worst]:.2e}"
        assert any(n.startswith("model.visual.blocks") for n in r["grads"]), "no vision-tower gradient compared"
