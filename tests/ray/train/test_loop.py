"""The optimizer step's loss is Σ token losses / N over all micro-batches and ranks
(raypack/train/loop.py's docstring says why and how).

2 ranks × 2 micro-batches of unequal packs under ZeRO-2 and ZeRO-3: the loss and the full
gradients after one step's backward equal a single-process computation over the same examples, run
one at a time with the model's own logits. The loss is the chunked one (raypack/train/loss.py), in
chunks of 7 label tokens; under ZeRO-3 with a tied, softcapped head (Gemma 2), whose output weight
is partitioned outside its module's forward and shared with the embedding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.ray

VOCAB = 97
# Examples (token lists) per rank per micro-batch: deliberately unequal in count and length.
rng = np.random.default_rng(0)
EXAMPLES = {
    0: [[rng.integers(1, VOCAB, 13), rng.integers(1, VOCAB, 5)], [rng.integers(1, VOCAB, 21)]],
    1: [[rng.integers(1, VOCAB, 3), rng.integers(1, VOCAB, 8), rng.integers(1, VOCAB, 11)], [rng.integers(1, VOCAB, 4)]],
}


def packed_row(examples):
    ids = np.concatenate(examples).tolist()
    return {
        "input_ids": ids,
        "labels": ids,
        "position_ids": np.concatenate([np.arange(len(e)) for e in examples]).tolist(),
        "num_tokens": len(ids),
        "example_ids": list(range(len(examples))),
    }


CASES = {  # zero stage, tiny family, config overrides
    "zero2-llama": (2, "llama", {}),
    "zero3-gemma2-tied-softcap": (3, "gemma2", {"final_logit_softcapping": 0.5}),
}


def build_model(case, attention="auto"):
    from raypack.model.build import load_model

    _, family, overrides = CASES[case]
    torch.manual_seed(0)
    return load_model(f"tiny-{family}", attention=attention, dtype="float32", vocab_size=VOCAB, **overrides)


def loop(config):
    import deepspeed
    import ray.train

    from raypack.config import TrainConfig
    from raypack.train.engine import setup_engine
    from raypack.train.loop import forward_backward, global_count
    from raypack.train.loss import make_loss
    from raypack.train.prefetch import prepare_step

    rank = ray.train.get_context().get_world_rank()
    stage = CASES[config["case"]][0]
    cfg = TrainConfig(
        num_workers=2, zero_stage=stage, grad_accum=2, grad_clip=0.0, warmup_steps=0, deepspeed_preset=config["preset"]
    )
    engine, _ = setup_engine(build_model(config["case"]), cfg, dtype=torch.float32, world_size=2, total_steps=1)
    if stage == 3:  # the weights really are partitioned outside forward
        assert engine.module.get_output_embeddings().weight.numel() == 0
    loss_fn = make_loss(engine, "chunked", chunk_tokens=7)
    step = prepare_step([packed_row(mb) for mb in EXAMPLES[rank]])  # what the loop's prefetcher builds
    n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    loss_sum = forward_backward(engine, step.batches, 2 * 2 / n, loss_fn)
    loss = float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n
    grads = {name: deepspeed.utils.safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, config["out"])


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_two_microbatches_match_single_process(ray_local, tmp_path, case):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = tmp_path / "rank0.pt"
    # ZeRO-3 keeps parameters under 1e5 elements whole on every rank ("persistent"); a threshold
    # of 0 partitions the tiny model's head as a real model's would be.
    preset = tmp_path / "zero.json"
    preset.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    TorchTrainer(
        loop,
        train_loop_config={"out": str(out), "case": case, "preset": str(preset)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"exact-loss-{tmp_path.name}", storage_path=str(tmp_path / "runs")),
    ).fit()
    got = torch.load(out)

    # Reference: one process, each example alone, Σ token losses / total label tokens.
    model = build_model(case, attention="eager")  # the model's own attention and logits, independent of raypack's
    examples = [e for mbs in EXAMPLES.values() for mb in mbs for e in mb]
    total, count = 0.0, 0
    for e in examples:
        ids = torch.as_tensor(e)[None]
        logits = model(input_ids=ids).logits
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        count += len(e) - 1
    loss = total / count
    loss.backward()

    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
