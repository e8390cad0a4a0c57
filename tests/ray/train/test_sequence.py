"""Sequence parallelism under Ray Train, on either engine (raypack/train/sequence.py, model/ulysses.py).

One optimizer step on 4 workers in 2 groups of 2 (each group 2 micro-batches of packed rows whose
examples cross the shard cut; the group's first rank reads them and scatters the shards): the loss
and every gradient equal a single process running each example alone with the model's own
attention. Under ZeRO-2, ZeRO-3 with gradient checkpointing on a tied, softcapped head (Gemma 2),
and LoRA under ZeRO-3 with checkpointing, on DeepSpeed and on the torch engine. Then `raypack train` itself: 4 workers with
train.sequence_parallel=2 log the same losses as 2 workers without, through a worker that dies in
the middle of the epoch and a restart from its checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from exactness import random_lora_b
from trackfiles import tensorboard_scalars
from trained import trained_ids

from tests.ray.train.test_loop import EXAMPLES, VOCAB, fit_on_gloo, packed_row
from tests.ray.train.test_trainer import CONFIG, loop_killed_once, with_worker_loop

pytestmark = pytest.mark.ray

CASES = {  # zero stage, tiny family, config overrides, gradient checkpointing, LoRA
    "zero2-llama": (2, "llama", {}, False, False),
    "zero3-checkpointing-gemma2-tied-softcap": (3, "gemma2", {"final_logit_softcapping": 0.5}, True, False),
    "zero3-checkpointing-lora-qwen3": (3, "qwen3", {}, True, True),
    # the torch engine (FSDP2 over all 4 ranks, resharding; each group's two ranks hold other tokens)
    "torch3-checkpointing-lora-qwen3": (3, "qwen3", {}, True, True),
}


def build(case, attention="auto"):
    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model

    _, family, overrides, checkpointing, lora = CASES[case]
    torch.manual_seed(0)
    model = load_model(f"tiny-{family}", attention=attention, dtype="float32", vocab_size=VOCAB,
                       gradient_checkpointing=checkpointing, **overrides)
    if lora:
        model = random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))
    return model


def loop(config):
    import ray.train
    import torch.distributed as dist
    from engine_views import grads as full_grads

    from raypack.config import TrainConfig
    from raypack.model.ulysses import sequence_parallel
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.sequence import ShardedSteps, data_rank, make_groups, probe_split

    rank = ray.train.get_context().get_world_rank()
    results = {}
    group = make_groups(2)
    for case in config["cases"]:
        name = "torch" if case.startswith("torch") else "deepspeed"
        cfg = TrainConfig(num_workers=4, sequence_parallel=2, zero_stage=CASES[case][0], grad_accum=2, grad_clip=0.0,
                          warmup_steps=0, engine=name, deepspeed_preset=config["preset"] if name == "deepspeed" else None)
        engine = engines.build(build(case), cfg, dtype=torch.float32, world_size=4, total_steps=1)
        loss_fn = make_loss(engine, "chunked", chunk_tokens=7)
        probe_split(engine, group, loss_fn)
        # the group's first rank reads its data rank's rows; the shards are scattered to the others
        mine = [prepare_step([packed_row(mb) for mb in EXAMPLES[data_rank(rank, 2)]])] if group.rank == 0 else None
        step = next(ShardedSteps(iter(mine) if mine else None, group, pad_token_id=0, pin=False))
        with sequence_parallel(group):
            n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
            loss_sum = forward_backward(engine, step.batches, 4 * 2 / n, loss_fn)
        loss = float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n
        grads = full_grads(engine, trainable_only=True)
        results[case] = {"loss": loss, "grads": grads, "tokens": step.tokens, "examples": step.example_ids}
        engine.destroy()
        dist.barrier()
    if rank in (0, 1):
        torch.save(results, f"{config['out']}.{rank}")


def test_one_step_split_over_groups_matches_each_example_alone(ray_local, tmp_path):
    out = tmp_path / "rank.pt"
    fit_on_gloo(loop, tmp_path, "split", 4, out=str(out), cases=list(CASES))
    got, second = torch.load(f"{out}.0"), torch.load(f"{out}.1")

    examples = [e for mbs in EXAMPLES.values() for mb in mbs for e in mb]
    rows = [packed_row(mb) for mb in EXAMPLES[0]]
    for case in CASES:
        # one group's two shards hold the group's tokens once, and only the first lists the examples
        assert got[case]["tokens"] + second[case]["tokens"] == sum(r["num_tokens"] for r in rows), case
        assert got[case]["examples"] == [i for r in rows for i in r["example_ids"]] and second[case]["examples"] == []
        model = build(case, attention="eager")  # the model's own attention, independent of raypack's
        total = sum(torch.nn.functional.cross_entropy(model(input_ids=torch.as_tensor(e)[None]).logits[0, :-1],
                                                      torch.as_tensor(e)[1:], reduction="sum") for e in examples)
        loss = total / sum(len(e) - 1 for e in examples)
        loss.backward()
        assert got[case]["loss"] == pytest.approx(loss.item(), rel=1e-5), case
        trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
        assert got[case]["grads"].keys() == trained.keys(), case
        for name, p in trained.items():
            torch.testing.assert_close(got[case]["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")


def test_raypack_train_split_over_two_ranks_logs_the_losses_of_one(ray_local, tmp_path, monkeypatch):
    """`raypack train`'s own path (prepare, each group's rows read once and scattered, Ulysses, the
    loop) with num_workers=4, sequence_parallel=2, ZeRO-3 and gradient checkpointing, against
    num_workers=2 on the same packed rows (2 data ranks): the same loss at every step, the same eval
    loss and tokens. In the split run the second rank of the second group dies after step 3, in the
    middle of the epoch: the group restarts from the step-2 checkpoint, and every example still
    trains once."""
    from raypack.config import load
    from raypack.train import trainer

    common = ["pack.budget=256", "pack.strategy=bfd", "train.max_steps=5", "train.report_every_steps=1",
              "train.checkpoint_every_steps=2", "train.zero_stage=3", "train.lr=1e-2", "train.max_failures=1",
              "model.gradient_checkpointing=true", f"run.storage_path={tmp_path}", "data.eval_fraction=0.05"]
    one = trainer.start(load(CONFIG, [*common, "train.num_workers=2", "run.name=one"])).result
    split_cfg = load(CONFIG, [*common, "train.num_workers=4", "train.sequence_parallel=2", "run.name=split"])
    marker = tmp_path / "fault-fired"
    with_worker_loop(monkeypatch, loop_killed_once, fault={"rank": 3, "step": 3, "marker": str(marker)})
    split = trainer.start(split_cfg).result
    assert marker.exists(), "the injected worker failure never fired"
    assert one.metrics["step"] == split.metrics["step"] == 5 and split.error is None

    losses = [tensorboard_scalars(tmp_path / name / "tensorboard")["train/loss"] for name in ("one", "split")]
    assert sorted(losses[0]) == sorted(losses[1]) == [1, 2, 3, 4, 5]
    for step in losses[0]:
        assert losses[1][step] == pytest.approx(losses[0][step], rel=1e-4), step
    assert split.metrics["eval_loss"] == pytest.approx(one.metrics["eval_loss"], rel=1e-4)
    assert split.metrics["tokens_seen"] == one.metrics["tokens_seen"]  # the rows' padding is not counted

    ids, steps = trained_ids(Path(split.checkpoint.path))
    assert steps == [[1, 2, 3, 4, 5]] * 4  # every rank took each step once, the redone ones included
    assert len(ids) == len(set(ids))  # each example once: only a group's first rank lists them
    assert sorted(ids) == sorted(trained_ids(Path(one.checkpoint.path))[0])
