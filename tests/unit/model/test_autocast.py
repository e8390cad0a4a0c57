"""The torch engine's precision mixed: fp32 master weights under torch.autocast(bf16), where the MoE
experts' grouped matmul (no autocast rule) must multiply in bf16 as autocast's mm does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations import moe

from raypack.model import autocast
from raypack.model.build import load_model


@pytest.fixture
def restored_grouped_mm(monkeypatch):
    # transformers' own function (an engine built earlier in this process may have wrapped it),
    # put back after the test
    monkeypatch.setattr(moe, "_grouped_mm", getattr(moe._grouped_mm, "__wrapped__", moe._grouped_mm))


def experts_and_inputs():
    model = load_model("tiny-qwen3_moe", dtype="float32")
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert experts.config._experts_implementation == "grouped_mm"  # the path the fix is for
    torch.manual_seed(0)
    tokens, top_k = 12, model.config.num_experts_per_tok
    hidden = torch.randn(tokens, model.config.hidden_size)
    index = torch.stack([torch.randperm(model.config.num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k).softmax(-1)
    return experts, (hidden, index, weights)


class GroupedMatmuls(TorchDispatchMode):
    """The dtypes of every grouped matmul aten runs, forward and backward."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_grouped_mm":
            self.dtypes.append(tuple(a.dtype for a in args[:2]))
        return func(*args, **(kwargs or {}))


def run(experts, inputs):
    with GroupedMatmuls() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(*inputs)
        out.float().square().sum().backward()
    assert seen.dtypes, "no grouped matmul ran"
    return out, {n: p.grad for n, p in experts.named_parameters()}, set(seen.dtypes)


def test_experts_multiply_in_bf16_under_autocast_and_train_fp32_weights(restored_grouped_mm):
    experts, inputs = experts_and_inputs()
    _, _, before = run(copy.deepcopy(experts), inputs)
    assert before == {(torch.float32, torch.float32)}  # transformers casts the input to the fp32 weights

    assert autocast.cast_grouped_experts() and autocast.cast_grouped_experts()  # idempotent
    out, grads, after = run(experts, inputs)
    assert after == {(torch.bfloat16, torch.bfloat16)}, after
    # the same values as bf16 weights give (autocast's cast of a weight is its bf16 copy)
    want, _, _ = run(copy.deepcopy(experts).to(torch.bfloat16), inputs)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # the weights stay fp32 and get fp32 gradients, through the differentiable cast
    assert all(p.dtype == torch.float32 and grads[n] is not None and grads[n].dtype == torch.float32
               for n, p in experts.named_parameters())  # fmt: skip

    with torch.no_grad(), GroupedMatmuls() as seen:  # outside autocast nothing changes
        experts(*inputs)
    assert set(seen.dtypes) == {(torch.float32, torch.float32)}
