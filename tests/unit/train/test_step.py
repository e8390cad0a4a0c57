"""One optimizer step in one process (gloo, world size 1): a step with no label token on any rank
runs no forward, backward or update, and reports no loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from benchmarks.router_loss import OneRank

from raypack.train.objectives.loss import CausalLMLoss
from raypack.train.prefetch import prepare_step
from raypack.train.step import train_step
from raypack.train.stepvalues import HostCounts


class RecordingEngine:
    """What train_step uses of a DeepSpeed engine, recording the calls."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def __call__(self, **batch):
        self.calls.append("forward")
        n = batch["input_ids"].shape[-1]
        return type("Out", (), {"logits": torch.zeros(1, n, 8, requires_grad=True)})()

    def backward(self, loss):
        self.calls.append("backward")

    def step(self):
        self.calls.append("step")

    def grad_norm(self):
        return torch.tensor(0.5)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    ours = not dist.is_initialized()
    if ours:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if ours:
        dist.destroy_process_group()


def row(labels):
    n = len(labels)
    return {"input_ids": list(range(1, n + 1)), "labels": labels, "position_ids": list(range(n)), "num_tokens": n,
            "example_ids": [n]}


full_loss = CausalLMLoss(torch.nn.Module(), "full")
"""The `full` loss, on the recording engine's uniform logits (the chunked loss needs a real model)."""


def test_a_step_without_label_tokens_is_skipped(process_group):
    engine = RecordingEngine()
    values = train_step(engine, prepare_step([row([-100, -100, -100]), row([5, -100])]), full_loss, HostCounts(1)).resolve()
    assert engine.calls == []  # no forward, no backward, no update
    assert values["skipped_steps"] == 1.0 and values["label_tokens"] == 0.0 and math.isnan(values["loss"])
    assert values["tokens"] == 5.0


def test_a_step_with_label_tokens_trains(process_group):
    engine = RecordingEngine()
    values = train_step(engine, prepare_step([row([-100, 2, 3]), row([-100, -100])]), full_loss, HostCounts(1)).resolve()
    assert engine.calls == ["forward", "backward", "step", "forward", "backward", "step"]
    assert values["skipped_steps"] == 0.0 and values["label_tokens"] == 2.0
    assert values["loss"] == pytest.approx(math.log(8))  # uniform logits over 8 classes


def moe_examples(seed: int) -> list[dict]:
    """Four examples of 9, 4, 12 and 6 random tokens (vocabulary 64), each its own labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 4, 12, 6):
        ids = torch.randint(3, 64, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids, "position_ids": list(range(n)), "num_tokens": n,
                    "example_ids": [n]})
    return out


def moe_step(model, groups, padded=False, scope="example"):
    """One optimizer step of the chunked loss plus the router loss over micro-batches `groups`
    (each a list of packed rows): (its values, every gradient)."""
    from raypack.config.sections import TrainConfig
    from raypack.train.objectives.loss import make_loss
    from raypack.train.objectives.router_loss import make_router_loss

    model.zero_grad(set_to_none=True)
    router = make_router_loss(model, TrainConfig(router_aux_loss_coef=0.5, router_aux_loss=scope), "tiny-qwen3_moe")
    step = prepare_step([r for g in groups for r in [merge(g)]], padded=padded, router_scope=scope)
    engine = OneRank(model, len(step.batches))
    values = train_step(engine, step, make_loss(model, "chunked", padded=padded), HostCounts(1), router=router)
    values = values.resolve()
    router.routers.remove()
    return values, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def merge(rows):
    """Rows packed into one."""
    out = {k: [v for r in rows for v in r[k]] for k in ("input_ids", "labels", "position_ids", "example_ids")}
    return {**out, "num_tokens": sum(r["num_tokens"] for r in rows)}


def test_router_loss_step_is_the_same_packed_unpacked_and_padded(process_group):
    """The step's loss, router loss and every gradient don't depend on how its examples are packed
    into micro-batches (example scope); the micro_batch scope does."""
    from raypack.model.build import load_model

    torch.manual_seed(0)
    model = load_model("tiny-qwen3_moe", attention="sdpa_varlen", dtype="float32", vocab_size=64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    examples = moe_examples(seed=1)
    packed, p_grads = moe_step(model, [examples[:3], examples[3:]])
    alone, a_grads = moe_step(model, [[e] for e in examples])
    model_sdpa = load_model("tiny-qwen3_moe", attention="sdpa", dtype="float32", vocab_size=64).eval()
    model_sdpa.load_state_dict(model.state_dict())
    padded, d_grads = moe_step(model_sdpa, [examples[:2], examples[2:]], padded=True)
    for other, grads in ((alone, a_grads), (padded, d_grads)):
        assert other["router_units"] == 4
        assert other["loss"] == pytest.approx(packed["loss"], rel=1e-5)
        assert other["router_aux_loss"] == pytest.approx(packed["router_aux_loss"], rel=1e-5)
        assert (other["router_load"] == packed["router_load"]).all()
        assert grads.keys() == p_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, p_grads[name], rtol=1e-5, atol=1e-6 * p_grads[name].abs().max().item())
    assert packed["router_load"].sum() == 2 * 2 * sum(e["num_tokens"] for e in examples)  # layers x top-2
    pooled, _ = moe_step(model, [examples[:3], examples[3:]], scope="micro_batch")
    pooled_alone, _ = moe_step(model, [[e] for e in examples], scope="micro_batch")
    assert pooled["router_units"] == 2 and pooled_alone["router_units"] == 4
    assert pooled_alone["router_aux_loss"] == pytest.approx(alone["router_aux_loss"], rel=1e-6)
    assert abs(pooled["router_aux_loss"] - packed["router_aux_loss"]) > 1e-3  # packing changes the pooled value


def tiny_moe(checkpointing="none", lora=False, attention="sdpa_varlen"):
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model

    torch.manual_seed(0)
    model = load_model("tiny-qwen3_moe", attention=attention, dtype="float32", vocab_size=64,
                       gradient_checkpointing=checkpointing)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    if lora:
        model = random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))
    return model.train()  # transformers checkpoints only in training mode; Qwen3-MoE has no dropout or jitter


@pytest.mark.parametrize("checkpointing, lora", [("full", False), ("selective", False), ("none", True),
                                                 ("full", True)])
def test_router_loss_with_checkpointing_and_lora_is_the_same_packed_and_alone(process_group, checkpointing, lora):
    """The router scores keep their gradient through raypack's (non-reentrant) recompute, whose
    second router calls the capture ignores; with LoRA the frozen routers pass the router loss's
    gradient on to the adapters."""
    examples = moe_examples(seed=2)
    packed, p_grads = moe_step(tiny_moe(checkpointing, lora), [examples[:3], examples[3:]])
    alone, a_grads = moe_step(tiny_moe(checkpointing, lora), [[e] for e in examples])
    plain, n_grads = moe_step(tiny_moe("none", lora), [examples[:3], examples[3:]])
    for other, grads in ((alone, a_grads), (plain, n_grads)):
        assert other["router_aux_loss"] == pytest.approx(packed["router_aux_loss"], rel=1e-5)
        assert other["loss"] == pytest.approx(packed["loss"], rel=1e-5)
        assert grads.keys() == p_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, p_grads[name], rtol=1e-5, atol=1e-6 * p_grads[name].abs().max().item())
    if lora:  # peft's all-linear puts LoRA on the router's weight too (a ParamWrapper): it trains
        assert all("lora_" in name for name in p_grads) and any("mlp.gate.lora_A" in n for n in p_grads)


def test_router_loss_adds_no_host_read_to_the_step(process_group):
    """The router loss's sums stay on the device until the step's values are read (a step late):
    the step reads no more tensor values on the host with the router loss than without it
    (benchmarks/step_syncs.py's counter: every .item(), .tolist(), .cpu(), ... in this thread)."""
    from benchmarks.step_syncs import SyncCounter

    from raypack.config.sections import TrainConfig
    from raypack.train.objectives.loss import make_loss
    from raypack.train.objectives.router_loss import make_router_loss

    model = tiny_moe()
    examples = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n)), "position_ids": list(range(n)),
                 "num_tokens": n, "example_ids": [n]} for n in (9, 4, 12)]
    loss = make_loss(model, "chunked")
    reads = {}
    for coef in (0.0, 0.1):
        router = make_router_loss(model, TrainConfig(router_aux_loss_coef=coef), "tiny-qwen3_moe")
        step = prepare_step([merge(examples[:2]), merge(examples[2:])], router_scope=router and router.scope)
        with SyncCounter() as counter:
            pending = train_step(OneRank(model, 2), step, loss, HostCounts(1), 1, router=router)
        reads[coef] = [e for e in counter.events if e[0] in ("read", "sync", "collective")]
        values = pending.resolve()
        assert ("router_aux_loss" in values) == bool(coef)
        if router is not None:
            router.routers.remove()
    # (the model's own mask code reads on the CPU path, router loss or not)
    assert reads[0.1] == reads[0.0] and not [e for e in reads[0.1] if e[1] == "raypack"], reads
