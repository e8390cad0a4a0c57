"""Finding an MoE model's routers: the model's own router_logits recorder, and the same modules
found by trait (a module that scores the experts and feeds a top-k) with that recorder hidden, for
every MoE family raypack packs (tests/families.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from families import FAMILIES, with_routers
from transformers import AutoModelForCausalLM

from raypack.config.sections import TrainConfig
from raypack.data.collate import collate_packed
from raypack.model.build import load_model
from raypack.model import routers as routers_mod
from raypack.model.build import meta_model
from raypack.model.routers import builds_routers, RouterNotFoundError, by_trait, declared, expert_count, find_routers
from raypack.train.objectives.loss import probe_batch
from raypack.train.objectives.router_loss import make_router_loss

pytestmark = pytest.mark.usefixtures("one_thread")

# families that build MoE layers (Nemotron-H's config carries expert settings; its tiny pattern has none)
MOE = with_routers()
SIGMOID = {"deepseek_v3", "glm4_moe", "dots1", "exaone_moe", "mimo_v2_flash", "nemotron_h", "kimi_linear",
           "bailing_hybrid"}  # fmt: skip
"""Bias-corrected sigmoid routers among them (DeepSeek-V3's, which the others copy), by model type."""


def build(family):
    """The family as a packed run builds it: raypack's exact path, a hybrid's mixers installed
    (the probe's packed row would make transformers' own linear attention refuse)."""
    torch.manual_seed(0)
    return load_model(copy.deepcopy(FAMILIES[family].build_config(family)), attention="sdpa_varlen",
                      dtype="float32").eval()


@pytest.mark.parametrize("family", MOE)
def test_trait_finds_the_declared_routers(family):
    model = build(family)
    cls, index = declared(model)
    want = [m for m in model.modules() if isinstance(m, cls)]
    probe = {k: v for k, v in probe_batch(512, padded=False).items() if k != "labels"}
    found, found_index = by_trait(model, probe, expert_count(model.config))
    # the trait finds the module whose output is the logits: the declared router itself, or the
    # one linear layer inside it (Hunyuan's gate wraps its `wg`), which records the same tensor
    assert len(found) == len(want) and found_index == index
    for module, router in zip(found, want):
        assert any(sub is module for sub in router.modules())
    routers = find_routers(model, family)
    assert routers.kind == ("sigmoid" if family.split("-")[0] in SIGMOID else "softmax")
    assert routers.layers == len(want) and routers.num_experts == 4 and routers.top_k == 2


def test_without_a_recorder_the_trait_is_used(monkeypatch):
    model = build("qwen3_moe")
    monkeypatch.setattr(routers_mod, "declared", lambda model: None)
    probe = {k: v for k, v in probe_batch(512, padded=False).items() if k != "labels"}
    routers = find_routers(model, "qwen3_moe", probe)
    assert routers.how == "trait" and routers.layers == 2
    rows = collate_packed([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 1, 2]}])
    with routers.capture() as calls:
        model(**{k: v for k, v in rows.items() if k != "labels"})
    assert len(calls) == 2 and calls[0].logits.shape == (3, 4) and calls[0].selected.shape == (3, 2)


def test_an_moe_model_whose_router_is_not_found_is_refused(monkeypatch):
    model = build("mixtral")
    monkeypatch.setattr(routers_mod, "declared", lambda model: None)
    monkeypatch.setattr(routers_mod, "by_trait", lambda model, probe, experts: ([], 0))
    with pytest.raises(RouterNotFoundError, match=r"model.name 'my-moe': a mixture-of-experts model \(4 experts\).*"
                                                  r"train.router_aux_loss_coef: 0"):
        make_router_loss(model, TrainConfig(), "my-moe", probe={})
    assert make_router_loss(model, TrainConfig(router_aux_loss_coef=0), "my-moe") is None


def test_hooks_record_only_inside_capture():
    model = build("mixtral")
    routers = find_routers(model, "mixtral")
    ids = torch.tensor([[5, 6, 7]])
    model(input_ids=ids)  # outside: nothing kept (a checkpoint's recompute runs here)
    with routers.capture() as calls:
        model(input_ids=ids)
    model(input_ids=ids)
    assert len(calls) == 2
    routers.remove()
    with routers.capture() as calls:
        model(input_ids=ids)
    assert calls == []


def test_capture_through_compiled_layers_is_exact_and_compiles_once():
    """train.compile: the hooks run inside the compiled decoder layers; the captured router loss and
    every gradient equal the eager model's, and after the first captured forward (the capture's own
    graph) new packed lengths compile nothing."""
    from raypack.config.sections import TrainConfig
    from raypack.model.kernels import check_compiled, compile_layers, compiled_graphs
    from raypack.train.objectives.router_loss import make_router_loss

    # a fresh Dynamo: code objects other tests compiled count toward its recompile limit, past which
    # layers run eagerly (which check_compiled refuses)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = load_model("tiny-qwen3_moe", dtype="float32", vocab_size=64)
    eager = load_model("tiny-qwen3_moe", dtype="float32", vocab_size=64)
    eager.load_state_dict(model.state_dict())
    routers = [make_router_loss(m, TrainConfig(router_aux_loss_coef=1.0), "tiny-qwen3_moe") for m in (model, eager)]
    compile_layers(model)
    check_compiled(model, probe_batch(64, False))
    g = torch.Generator().manual_seed(0)
    counts = []
    for lengths in ([9, 5], [13, 2, 7], [20]):
        rows = []
        for n in lengths:
            ids = torch.randint(3, 64, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(n))})
        batch = collate_packed(rows)
        batch.update(routers[0].units(batch))
        kwargs = {k: v for k, v in batch.items() if k != "labels" and not k.startswith("router_")}
        out = []
        for m, router in zip((model, eager), routers):
            m.zero_grad(set_to_none=True)
            with router.routers.capture() as calls:
                logits = m(**kwargs).logits
            total = router.sums(calls, batch)[0] + logits.float().pow(2).mean()
            total.backward()
            out.append((total.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        (mine, mine_g), (theirs, theirs_g) = out
        assert mine == pytest.approx(theirs, rel=1e-5)
        for name, grad in theirs_g.items():
            torch.testing.assert_close(mine_g[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item())
        counts.append(compiled_graphs())
    assert counts[0] == counts[-1], counts


def test_routers_that_dont_run_are_refused_before_training():
    """A kernel or wrapper that replaces the MoE block's router leaves the hooks silent: the setup
    probe refuses it, naming the model."""
    from raypack.config.sections import TrainConfig
    from raypack.train.objectives.router_loss import make_router_loss

    model = build("qwen3_moe")
    router = make_router_loss(model, TrainConfig(), "tiny-qwen3_moe")
    probe = {k: v for k, v in probe_batch(512, padded=False).items() if k != "labels"}
    router.probe(model, probe, "tiny-qwen3_moe")  # every router ran once
    class Unhooked(torch.nn.Module):  # as a fused MoE kernel would: the block no longer calls the router module
        def __init__(self, gate):
            super().__init__()
            self.inner = [gate]  # kept out of the module tree, its hooks never called

        def forward(self, h):
            return type(self.inner[0]).forward(self.inner[0], h)

    for layer in model.model.layers:
        layer.mlp.gate = Unhooked(layer.mlp.gate)
    with pytest.raises(RouterNotFoundError, match=r"model.name 'tiny-qwen3_moe': its 2 routers ran on none of the tokens in a probe forward of 12"):
        router.probe(model, probe, "tiny-qwen3_moe")
