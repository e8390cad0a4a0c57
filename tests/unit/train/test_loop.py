"""One optimizer step in one process (gloo, world size 1): a step with no label token on any rank
runs no forward, backward or update, and reports no loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raypack.train.loop import train_step
from raypack.train.loss import token_loss_sum
from raypack.train.prefetch import prepare_step
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

    def get_global_grad_norm(self):
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


def full_loss(engine, batch):
    """The `full` loss on the recording engine's uniform logits (the chunked loss needs a real model)."""
    return token_loss_sum(engine(input_ids=batch["input_ids"]).logits, batch["labels"])


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
