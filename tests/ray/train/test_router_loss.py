"""The router loss on two ranks under ZeRO-2 and ZeRO-3: three optimizer steps of a tiny Qwen3-MoE
(AdamW updates between them) train the same token loss, router loss and expert load whether each
rank's examples are packed into rows or fed one per micro-batch (`example` scope), through the
training loop's own step (step.train_step: the host counts, one all_reduce, read a step late);
the first step's router loss is also the mean, over the step's examples on both ranks, of
transformers' load_balancing_loss_func on each example run alone through the model's eager
attention. The same on the torch engine's FSDP2 (zero_stage 3), where its losses equal DeepSpeed's
ZeRO-3 step by step. One Ray Train run holds all six (an engine each, one after the other).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ray.train.test_loop import fit_on_gloo

pytestmark = pytest.mark.ray

VOCAB = 97
COEF = 0.1
rng = np.random.default_rng(3)
# Three optimizer steps; each rank trains three examples a step, of unequal lengths.
STEPS = [{rank: [rng.integers(3, VOCAB, n).tolist() for n in lengths] for rank, lengths in enumerate(ranks)}
         for ranks in (([13, 5, 21], [3, 8, 11]), ([7, 17, 4], [19, 2, 9]), ([6, 6, 15], [10, 12, 5]))]
CASES = [(engine, stage, packed) for engine, stage in (("deepspeed", 2), ("deepspeed", 3), ("torch", 3))
         for packed in (True, False)]


def row(examples):
    ids = [t for e in examples for t in e]
    return {"input_ids": ids, "labels": ids, "position_ids": [p for e in examples for p in range(len(e))],
            "num_tokens": len(ids), "example_ids": list(range(len(examples)))}


def rows(examples, packed):
    """Packed: two rows, the first two examples sharing one; unpacked: a row each."""
    return [row(examples[:2]), row(examples[2:])] if packed else [row([e]) for e in examples]


def build_model(attention="auto"):
    from checkpoints import saved

    from raypack.model.build import load_model

    # its saved folder, as a user's model.name; fp32, for fp32's tolerances against each example alone
    folder = saved("tiny-qwen3_moe", vocab_size=VOCAB, dtype=torch.float32)
    model = load_model(str(folder), attention=attention, dtype="float32")
    torch.manual_seed(0)  # the routers' draw below, the same in the driver and the workers
    with torch.no_grad():  # routers that prefer experts from the start, so the loss has work to do
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model.eval()  # no dropout (the tiny config has none; eval makes it certain)


def moe_loop(config):
    import ray.train
    from engine_views import full_param

    from raypack.config import TrainConfig
    from raypack.train import engines
    from raypack.train.step import train_step
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.objectives.router_loss import make_router_loss
    from raypack.train.stepvalues import HostCounts

    rank = ray.train.get_context().get_world_rank()
    results = {}
    for name, stage, packed in CASES:
        cfg = TrainConfig(num_workers=2, zero_stage=stage, grad_accum=2 if packed else 3, grad_clip=0.0,
                          warmup_steps=0, lr=1e-2, engine=name, router_aux_loss_coef=COEF,
                          deepspeed_preset=config["preset"] if name == "deepspeed" else None)
        engine = engines.build(build_model(), cfg, dtype=torch.float32, world_size=2, total_steps=len(STEPS))
        loss = make_loss(engine, "chunked", chunk_tokens=7)
        router = make_router_loss(engine.module, cfg, "tiny-qwen3_moe")
        counts = HostCounts.open(2, engine.device)
        gate = engine.module.model.layers[0].mlp.gate.weight
        before = full_param(engine, gate).clone()
        values = []
        for number, step in enumerate(STEPS, start=1):
            batch = prepare_step(rows(step[rank], packed), router_scope=router.scope)
            v = train_step(engine, batch, loss, counts, number, router=router).resolve()
            values.append({k: v[k] for k in ("loss", "router_aux_loss", "router_units", "label_tokens")}
                          | {"router_load": v["router_load"].tolist()})
        moved = (full_param(engine, gate) - before).abs().max().item()
        results[(name, stage, packed)] = values + [{"router_moved": moved}]
        router.routers.remove()
        engine.destroy()
    if rank == 0:
        torch.save(results, config["out"])


def test_packed_equals_unpacked_over_three_steps_under_zero2_and_zero3(ray_local, tmp_path):

    from checkpoints import saved
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    saved("tiny-qwen3_moe", vocab_size=VOCAB, dtype=torch.float32)  # written here, before the workers read it
    out = tmp_path / "rank0.pt"
    fit_on_gloo(moe_loop, tmp_path, "router-loss", 2, out=str(out))
    got = torch.load(out)

    model = build_model(attention="eager")
    examples = [e for ranks in STEPS[0].values() for e in ranks]
    alone = [load_balancing_loss_func(model(input_ids=torch.tensor([e]), output_router_logits=True).router_logits,
                                      4, 2).item() for e in examples]
    for name, stage in (("deepspeed", 2), ("deepspeed", 3), ("torch", 3)):
        *packed, moved = got[(name, stage, True)]
        *unpacked, _ = got[(name, stage, False)]
        assert moved["router_moved"] > 1e-3  # the updates reached the routers
        assert packed[0]["router_aux_loss"] == pytest.approx(sum(alone) / len(alone), rel=1e-5)
        for number, (p, u) in enumerate(zip(packed, unpacked), start=1):
            where = f"{name} zero_stage {stage}, step {number}"
            assert p["router_units"] == u["router_units"] == 6, where
            assert p["loss"] == pytest.approx(u["loss"], rel=1e-5), where
            assert p["router_aux_loss"] == pytest.approx(u["router_aux_loss"], rel=1e-5), where
            assert p["router_load"] == u["router_load"], where
    assert got[("deepspeed", 2, True)][-2]["loss"] == pytest.approx(got[("deepspeed", 3, True)][-2]["loss"], rel=1e-4)
    for number, (ours, theirs) in enumerate(zip(got[("torch", 3, True)][:-1], got[("deepspeed", 3, True)][:-1]), 1):
        for key in ("loss", "router_aux_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), f"torch against deepspeed, step {number}: {key}"
