"""The router's load-balancing loss on packed rows, per MoE family raypack packs (tests/families.py):

- `example`: the loss and every parameter's gradient on two packed rows equal the mean, over the
  examples, of each example's own loss run alone through transformers' eager model, with
  transformers' `load_balancing_loss_func` on the router logits that model returns (softmax
  routers), or DeepSeek-V3's sequence-wise balance loss written out below from the paper on the
  router's own choice (sigmoid routers with a bias-corrected top-k), fp32, 1e-5;
- `micro_batch`: equals transformers' function on the same rows' router logits, packed and padded (for
  sigmoid routers, the sequence-wise reference over the whole packed row).

Models run in eval mode (no router jitter); gradients are still taken.
"""

from __future__ import annotations

import copy

import pytest
import torch
from exactness import AS_CLOSE, float64_copy, make_rows, rel_err
from families import FAMILIES, with_routers
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from raypack.config.sections import TrainConfig
from raypack.data.collate import collate_packed
from raypack.model.build import load_model
from raypack.model.build import meta_model
from raypack.model.routers import builds_routers, declared, expert_count
from raypack.train.objectives.router_loss import batch_units, make_router_loss, resolve_coef

pytestmark = pytest.mark.usefixtures("one_thread")

# families that build MoE layers (Nemotron-H's config carries expert settings; its tiny pattern has none)
MOE = with_routers()
TOL = 1e-5


def models(family: str):
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    # load_model: raypack's exact path as a packed run builds it (a hybrid's mixers included)
    packed = load_model(copy.deepcopy(config), attention="sdpa_varlen", dtype="float32").eval()
    # Router weights at random: some families start them at zero, where every token ties.
    with torch.no_grad():
        for name, p in packed.named_parameters():
            if p.dim() == 2 and p.shape[0] == expert_count(config) and p.shape[1] == config.hidden_size:
                p.normal_(0, 0.5)
    ref = load_model(copy.deepcopy(config), attention="eager", dtype="float32").eval()
    ref.load_state_dict(packed.state_dict())
    return packed, ref


def router_loss(model, family, scope="example"):
    return make_router_loss(model, TrainConfig(router_aux_loss_coef=1.0, router_aux_loss=scope), family)


def model_kwargs(batch):
    return {k: v for k, v in batch.items() if k not in ("labels",) and not k.startswith("router_")}


def seq_balance_reference(logits, selected, experts, top_k):
    """DeepSeek-V3 (arXiv 2412.19437, eqs. 17-20) for one sequence and one layer, written out."""
    n = logits.shape[0]
    s = torch.sigmoid(logits.float())
    s = s / s.sum(-1, keepdim=True)
    loss = 0.0
    for e in range(experts):
        f = experts / (top_k * n) * (selected == e).any(-1).float().sum()
        loss = loss + f * s[:, e].mean()
    return loss


def alone_loss(ref, routers, ids):
    """One example alone through the eager model: transformers' function on its returned router
    logits, or the sequence-wise reference on its routers' own choice."""
    if routers.kind == "softmax":
        out = ref(input_ids=ids[None], output_router_logits=True)
        return load_balancing_loss_func(out.router_logits, routers.num_experts, routers.top_k)
    cls, _ = declared(ref)
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, o: seen.append(o)) for m in ref.modules() if isinstance(m, cls)]
    try:
        out = ref(input_ids=ids[None], output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(out.router_logits)
    return sum(seq_balance_reference(z, o[2], routers.num_experts, routers.top_k)
               for z, o in zip(out.router_logits, seen))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_errors(mine, theirs):
    """Each gradient's largest difference, relative to its scale (at least 1e-3 of the largest)."""
    floor = 1e-3 * max(g.abs().max().item() for g in theirs.values())
    return {n: (mine[n].double() - theirs[n].double()).abs().max().item() / max(theirs[n].abs().max().item(), floor)
            for n in theirs}  # fmt: skip


def alone_in_fp64(ref, family, examples):
    """The examples alone in float64: the exact value the fp32 runs round."""
    exact64 = float64_copy(ref)
    routers = router_loss(exact64, family).routers
    (sum(alone_loss(exact64, routers, ids) for ids, _ in examples) / len(examples)).backward()
    return grads(exact64)


@pytest.mark.parametrize("family", MOE)
def test_example_scope_is_each_example_alone(family):
    packed, ref = models(family)
    router = router_loss(packed, family)
    assert router is not None and router.routers.how == "declared"
    rows, examples = make_rows(vocab=512)
    batch = collate_packed(rows)
    batch.update(router.units(batch))
    with router.routers.capture() as calls:
        packed(**model_kwargs(batch))
    total, load = router.sums(calls, batch)
    mean = total / batch["router_unit_count"]
    mean.backward()
    ref_router = router_loss(ref, family).routers
    alone = sum(alone_loss(ref, ref_router, ids) for ids, _ in examples) / len(examples)
    alone.backward()
    assert batch["router_unit_count"] == len(examples)
    assert rel_err(mean, alone) < TOL, (mean.item(), alone.item())
    mine, theirs = grads(packed), grads(ref)
    assert mine.keys() == theirs.keys() and mine
    errors = grad_errors(mine, theirs)
    worst = max(errors, key=errors.get)
    if errors[worst] >= max(TOL, FAMILIES[family].tolerance):  # the row's own bound
        # The router loss's gradient can be ill-conditioned in fp32: through a hybrid's scans the
        # examples alone, in fp32, are themselves up to 1.1e-4 off their float64 value (Bailing,
        # perturbed weights). Then the packed row must be as close to that exact value as they
        # are: seen 0.96 to 2.5 times their error (Qwen3-Next, Qwen3.5-MoE, Bailing, Kimi-Linear).
        exact64 = alone_in_fp64(ref, family, examples)
        packed_err, alone_err = grad_errors(mine, exact64), grad_errors(theirs, exact64)
        assert max(packed_err.values()) < AS_CLOSE * max(max(alone_err.values()), TOL), (worst, errors[worst])
    # the load: every token's top-k, each layer
    assert load.shape == (router.layers, router.experts)
    assert torch.all(load.sum(-1) == sum(len(ids) for ids, _ in examples) * router.routers.top_k)


@pytest.mark.parametrize("family", MOE)
def test_micro_batch_scope_is_transformers_function_on_the_rows(family):
    """Packed (no mask) and padded (the attention mask) rows; for a bias-corrected sigmoid router,
    which transformers gives no loss, the sequence-wise reference over the whole packed row."""
    packed, ref = models(family)
    rows, _ = make_rows(vocab=512)
    for padded, model in ((False, packed), (True, ref)):
        router = router_loss(model, family, "micro_batch")
        if padded and router.routers.kind != "softmax":
            continue
        batch = collate_packed(rows, padded=padded)
        batch.update(router.units(batch))
        seen = []
        hooks = [m.register_forward_hook(lambda m, a, o: seen.append(o)) for m in router.routers.modules]
        with router.routers.capture() as calls:
            out = model(**model_kwargs(batch), output_router_logits=True)
        for h in hooks:
            h.remove()
        ours = router.sums(calls, batch)[0]
        if router.routers.kind == "softmax":
            theirs = load_balancing_loss_func(out.router_logits, router.experts, router.routers.top_k,
                                              batch.get("attention_mask"))
        else:
            theirs = sum(seq_balance_reference(z, o[2], router.experts, router.routers.top_k)
                         for z, o in zip(out.router_logits, seen))
        assert batch["router_unit_count"] == 1
        assert rel_err(ours, theirs) < TOL, (padded, ours.item(), theirs.item())


def test_coefficient_auto_and_dense_models():
    moe = FAMILIES["qwen3_moe"].build_config("qwen3_moe")
    assert resolve_coef("auto", moe, True) == moe.router_aux_loss_coef
    v3 = FAMILIES["deepseek_v3"].build_config("deepseek_v3")
    assert not hasattr(v3, "router_aux_loss_coef") and resolve_coef("auto", v3, True) == 0.001
    assert resolve_coef("auto", FAMILIES["llama"].build_config("llama"), False) == 0.0
    assert resolve_coef(0.02, moe, True) == 0.02
    dense = AutoModelForCausalLM.from_config(FAMILIES["llama"].build_config("llama"))
    assert make_router_loss(dense, TrainConfig(), "llama") is None
    with pytest.raises(Exception, match=r"model.name 'llama'.*not a mixture-of-experts model"):
        make_router_loss(dense, TrainConfig(router_aux_loss_coef=0.01), "llama")


def test_units_of_packed_and_padded_batches():
    rows, _ = make_rows(vocab=512)
    packed = batch_units(collate_packed(rows), "example")
    assert packed["router_unit_count"] == 5
    assert packed["router_units"].tolist() == [0] * 21 + [1] * 6 + [2] * 13 + [3] + [4] * 9
    padded = batch_units(collate_packed(rows, padded=True), "example")
    assert padded["router_unit_tokens"].tolist() == [21, 6, 13, 1, 9]
    assert (padded["router_units"] == 5).sum() == 5 * 21 - 50  # pad tokens belong to no unit
    pooled = batch_units(collate_packed(rows, padded=True), "micro_batch")
    assert pooled["router_unit_count"] == 1 and pooled["router_unit_tokens"].tolist() == [50]


def test_a_config_with_expert_settings_that_builds_no_moe_layer_is_dense():
    """Nemotron-H's config always carries expert settings; a layer pattern without MoE layers
    builds no router: `auto` trains it without a router loss, a number is refused."""
    from raypack.model.build import tiny_config
    from raypack.model.routers import RouterNotFoundError

    model = meta_model(tiny_config("nemotron_h"))
    assert expert_count(model.config) > 0 and not builds_routers(model)
    assert make_router_loss(model, TrainConfig(), "tiny-nemotron_h") is None
    with pytest.raises(RouterNotFoundError, match=r"builds no mixture-of-experts layer"):
        make_router_loss(model, TrainConfig(router_aux_loss_coef=0.01), "tiny-nemotron_h")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_tiled_mlps_give_the_same_router_loss(family):
    """model.tiled_mlp_tokens runs each MoE block 5 tokens at a time (recomputed in backward), so
    each router runs once per tile: the loss joins a router's tiles back (routers.per_layer), and
    the router loss, the expert load and every gradient equal the untiled model's, packed and
    padded (a padded batch is tiled as one sequence of its rows' tokens, in their order). The
    setup probe (12 tokens, 3 tiles) accepts it."""
    from raypack.model.kernels import tile_mlps
    from raypack.train.objectives.loss import probe_batch

    rows, _ = make_rows(vocab=512)
    for padded, plain in zip((False, True), models(family)):  # raypack's packed model; eager for padded rows
        tiled = copy.deepcopy(plain)
        assert tile_mlps(tiled, 5) == FAMILIES[family].build_config(family).num_hidden_layers
        results = []
        for model in (plain, tiled):
            model.zero_grad()
            router = router_loss(model, family)
            batch = collate_packed(rows, padded=padded)
            batch.update(router.units(batch))
            with router.routers.capture() as calls:
                model(**model_kwargs(batch))
            total, load = router.sums(calls, batch)
            total.backward()
            results.append((total.detach(), load, grads(model)))
            router.routers.remove()
        (a, load_a, ga), (b, load_b, gb) = results
        assert rel_err(a, b) < TOL and torch.equal(load_a, load_b), (padded, a.item(), b.item())
        assert ga.keys() == gb.keys() and ga
        assert max(rel_err(ga[n], gb[n]) for n in ga) < TOL
    router = router_loss(tiled, family)
    probe = {k: v for k, v in probe_batch(512, padded=False).items() if k != "labels"}
    router.probe(tiled, probe, family)
