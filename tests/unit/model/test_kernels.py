"""raypack/model/kernels.py on the CPU: regional torch.compile keeps packed rows exact (fp32, Inductor)
and a new row length or example count compiles nothing new; `model.kernels` and `train.loss: liger`
refused where Liger-Kernel can't run. Liger itself is Triton: tests/gpu/model/test_kernels.py on
CUDA, tests/unit/model/test_liger_interpreted.py in Triton's CPU interpreter (`make test-liger`)."""

from __future__ import annotations

import pytest
import torch
from exactness import packed_vs_alone
from families import FAMILIES, TOLERANCE

from raypack.config import load
from raypack.errors import InputError
from raypack.model import kernels
from raypack.model.build import load_model
from raypack.model.checkpointing import check_selective

COMPILED = ["full", "selective"]
"""Llama compiled in training under each recomputing mode, in every run (~1 min each on 2 cores)."""
COMPILED_SLOW = ["gemma2", "qwen3", "gpt_oss", "deepseek_v3", "phi3", "mixtral"]
"""Sliding windows with softcapping, qk-norm, sinks, MLA with MoE, fused qkv, MoE: full recompute."""


def _layer_as_dynamo_sees_it(model, batch):
    """torch._dynamo.explain of the first decoder layer's call, with the arguments training gives it."""
    layer = kernels.decoder_layers(model, "test")[0]
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                           with_kwargs=True)  # fmt: skip
    try:
        model(**batch)
    finally:
        hook.remove()
    return torch._dynamo.explain(layer._call_impl)(*seen["args"], **seen["kwargs"])


def _compiled_training_vs_alone(family: str, checkpointing: str) -> None:
    """train.compile as training runs it: train mode, the layers checkpointed, the setup probes
    first; packed rows exact against each example alone, no graph break, no recompile."""
    from torch._dynamo.utils import counters

    from raypack.train.objectives.loss import probe_batch

    torch._dynamo.reset()
    counters.clear()
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    model = load_model(config, attention="sdpa_varlen", dtype="float32", gradient_checkpointing=checkpointing).train()
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    assert kernels.compile_layers(model) == config.num_hidden_layers
    probe = {k: v for k, v in probe_batch(config.vocab_size, padded=False).items() if k != "labels"}
    with torch.no_grad():  # the chunked loss's setup probe: eval, no gradients
        model.eval()
        model(**probe)
        model.train()
    inference = kernels.compiled_graphs()
    # the setup's other probes, in raypack.train.loop.setup_worker's order
    assert check_selective(model, probe, checkpointing) == (checkpointing, None)
    kernels.check_compiled(model, probe)  # a graph break, or a layer run eagerly, here is a refusal
    assert kernels.compiled_graphs() > inference, "the training probe compiled no graph of its own"
    with kernels.eager_layers(model) as eager:
        errors = packed_vs_alone(model, ref)  # train mode: every layer checkpointed
    assert not eager, f"layers {sorted(set(eager))} ran eagerly in training"
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} compiled, {checkpointing}: {worst} off by {errors[worst]:.2e}"
    graphs = kernels.compiled_graphs()
    # other rows: other total lengths and example counts, one example alone, and no new graph
    errors = packed_vs_alone(model, ref, lengths=([10, 7, 3, 2], [5, 19], [12]), seed=1)
    assert max(errors.values()) < TOLERANCE
    assert kernels.compiled_graphs() == graphs, "a new packed length recompiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one layer as Dynamo traces it: one graph, the checkpoint inside it, raypack's attention inside that
    explained = _layer_as_dynamo_sees_it(model, probe)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    (graph,) = explained.graphs
    assert "tag_activation_checkpoint" in graph.code
    assert any("raypack.exact_varlen" in body.code for _, body in graph.named_children())


@pytest.mark.parametrize("checkpointing", COMPILED)
def test_compiled_layers_train_exactly_checkpointed_whole_without_recompiling(checkpointing):
    _compiled_training_vs_alone("llama", checkpointing)


@pytest.mark.slow
@pytest.mark.parametrize("family", COMPILED_SLOW)
def test_more_families_compiled(family):
    _compiled_training_vs_alone(family, "full")


def test_the_kernels_packages_routing_is_taken_off_where_it_routes_to_the_functions_own_code():
    """transformers 5.25 installs the `kernels` package, whose decorator wraps Llama's attention in a
    forward that sets a context variable on every call (routing RoPE to the instance's private
    copy): inside a checkpoint Dynamo refuses that ("HOP: Unsafe side effect"), and train.compile
    with checkpointing was refused. Where every copy runs the function's own code, compile_layers
    takes the routing off, the layers computing the same; where a copy holds a hub kernel (its
    own forward) the routing stays, and check_compiled's refusal would name it. Compiled whole in
    test_compiled_layers_train_exactly_checkpointed_whole_without_recompiling."""
    import types

    pytest.importorskip("kernels")
    from raypack.train.objectives.loss import probe_batch

    torch.manual_seed(0)
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32")
    layers = kernels.decoder_layers(model, "test")
    routed = [m for m in layers.modules() if kernels._routed(m) is not None]
    if not routed:
        pytest.skip("no module here routes kernel functions")
    probe = {k: v for k, v in probe_batch(1024, padded=False).items() if k != "labels"}
    with torch.no_grad():
        before = model(**probe).logits
    hub = routed[0]
    copy = next(iter(hub._kernel_funcs.values()))
    copy.forward = types.MethodType(type(copy).forward, copy)  # as kernelize sets a hub kernel's
    assert kernels._unrouted(layers) == len(routed) - 1
    assert "forward" not in vars(hub) and all("forward" in vars(m) for m in routed[1:])
    del copy.forward
    assert kernels._unrouted(layers) == 1 and kernels._unrouted(layers) == 0
    with torch.no_grad():
        assert torch.equal(model(**probe).logits, before)


def test_a_layer_that_breaks_the_graph_is_refused_before_training():
    """A graph break inside a checkpointed layer would run the whole layer eagerly: the setup
    probe refuses it, naming the break (here: attention that reads a row's boundaries on the host)."""
    from raypack.model import attention
    from raypack.train.objectives.loss import probe_batch

    torch._dynamo.reset()
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", gradient_checkpointing="full").train()
    kernels.compile_layers(model)
    probe = {k: v for k, v in probe_batch(256, padded=False).items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")}
    attention._warned.add("derive")  # the once-only warning of derived boundaries is not what is tested
    with pytest.raises(kernels.UnsupportedModelError, match="don't compile whole.*train.compile: false"):
        kernels.check_compiled(model, probe)


RECOMPILE_LIMIT = """
import torch
from torch._dynamo.utils import counters
from raypack.model import kernels
from raypack.model.build import load_model
from raypack.train.objectives.loss import probe_batch

model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", gradient_checkpointing="full").train()
kernels.compile_layers(model)
torch._dynamo.config.recompile_limit = 0
probe = {k: v for k, v in probe_batch(256, padded=False).items() if k != "labels"}
try:
    kernels.check_compiled(model, probe)
except kernels.UnsupportedModelError as e:
    assert "2 of 2 decoder layers" in str(e) and "ran eagerly" in str(e), e
    assert not counters["graph_break"], "no graph break: the break check alone would have passed"
else:
    raise SystemExit("layers past Dynamo's recompile limit ran eagerly and were not refused")
"""


@pytest.mark.parametrize("how", ["not compiled", "force_eager", "recompile limit"])
def test_layers_that_run_eagerly_without_a_graph_break_are_refused(how, monkeypatch):
    """Compile can compile nothing and break no graph: layers never compiled, Dynamo told to run
    eagerly, or its recompile limit reached (Dynamo then runs the frame eagerly, counting no break).
    The setup probe refuses all three; a check of graph breaks alone passed them."""
    import contextlib

    from torch._dynamo.utils import counters

    from raypack.train.objectives.loss import probe_batch

    if how == "recompile limit":
        # In a process of its own: Dynamo marks a frame that hit the limit "run only" for good
        # (shared frames such as a module's call included; torch._dynamo.reset() doesn't clear the
        # mark, pytorch#139200), which would leave every later compile in this process eager.
        import os
        import subprocess
        import sys

        from paths import REPO

        done = subprocess.run([sys.executable, "-c", RECOMPILE_LIMIT], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return
    torch._dynamo.reset()
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", gradient_checkpointing="full").train()
    if how != "not compiled":
        kernels.compile_layers(model)
    probe = {k: v for k, v in probe_batch(256, padded=False).items() if k != "labels"}
    breaks = dict(counters["graph_break"])
    stance = torch.compiler.set_stance("force_eager") if how == "force_eager" else contextlib.nullcontext()
    with stance, pytest.raises(kernels.UnsupportedModelError, match="2 of 2 decoder layers .* ran eagerly"):
        kernels.check_compiled(model, probe)
    assert dict(counters["graph_break"]) == breaks, "no graph break: the break check alone would have passed"


def test_liger_is_used_where_it_can_run_and_refused_where_asked_for_and_it_cannot(monkeypatch):
    monkeypatch.setattr(kernels, "liger_installed", lambda: False)
    assert kernels.resolve_kernels("auto", "llama", "cuda") == "none"
    assert kernels.resolve_kernels("none", "llama", "cuda") == "none"
    with pytest.raises(InputError, match="not installed"):
        kernels.resolve_kernels("liger", "llama", "cuda")
    with pytest.raises(InputError, match="Triton on CUDA"):
        kernels.resolve_kernels("liger", "llama", "cpu")
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "liger_families", lambda: frozenset({"llama"}))
    assert kernels.resolve_kernels("auto", "llama", "cuda") == "liger"
    assert kernels.resolve_kernels("auto", "llama", "cpu") == "none"
    assert kernels.resolve_kernels("auto", "nemotron", "cuda") == "none"
    with pytest.raises(InputError, match="no kernels for model_type 'nemotron'"):
        kernels.resolve_kernels("liger", "nemotron", "cuda")
    # train.compile: auto lets Inductor fuse the elementwise work (KERNELS_COMPILED); liger's kernels
    # go into the graphs as opaque ops (liger_graph.py; tests/liger_interpreted.py checks them)
    assert kernels.resolve_kernels("auto", "llama", "cuda", compiled=True) == kernels.KERNELS_COMPILED == "none"
    assert kernels.resolve_kernels("liger", "llama", "cuda", compiled=True) == "liger"


@pytest.mark.parametrize("family,unverified", [("deepseek_v2", True), ("deepseek_v3", True), ("mixtral", False),
                                               ("qwen3_moe", False), ("llama", False)])  # fmt: skip
def test_liger_is_kept_off_the_structure_it_failed_on_a_gpu(monkeypatch, family, unverified):
    """DeepSeek-V2/V3 failed the packed-against-alone check with Liger on an H100, Mixtral and Qwen3-MoE
    passed: `auto` keeps the model's own code, and `liger` is refused, for routed experts beside shared
    experts (the trait, found on the meta device before Ray starts), whatever the model is called."""
    from raypack.config import load
    from raypack.model.build import meta_model
    from raypack.train.preflight import check_kernels

    config = FAMILIES[family].build_config(family)
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "liger_families", lambda: frozenset({config.model_type}))
    model = meta_model(config)
    assert (kernels.liger_unverified(model) is not None) == unverified
    assert kernels.resolve_kernels("auto", config.model_type, "cuda", model) == ("none" if unverified else "liger")
    cfg = load(None, ["model.kernels=liger", "train.use_gpu=true"])
    if unverified:
        with pytest.raises(InputError, match="failed the packed-against-alone check on a GPU.*beside shared_experts"):
            kernels.resolve_kernels("liger", config.model_type, "cuda", model)
        with pytest.raises(InputError, match="beside shared_experts"):
            check_kernels(cfg, config)
    else:
        check_kernels(cfg, config)


def test_liger_without_a_rope_kernel_for_a_family_keeps_the_models_rope(monkeypatch):
    """Liger 0.8.5 raises NotImplementedError for rope=True on GLM-4 and Qwen3.5, before patching
    anything: the other kernels still apply. (A stand-in for Liger's apply function: the real one
    runs in tests/unit/model/test_liger_interpreted.py, glm4 included.)"""
    import sys
    import types

    calls = []

    def apply(model, **patches):
        calls.append(patches["rope"])
        if patches["rope"] or model.refuse_all:
            raise NotImplementedError("liger_rotary_pos_emb is not available")

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake._apply_liger_kernel_to_instance = apply
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    monkeypatch.setattr(kernels, "resolve_kernels", lambda *_: "liger")
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="glm4"), refuse_all=False)
    assert kernels.apply_kernels(model, "liger", "cuda") == "liger"
    assert calls == [True, False]
    model.refuse_all = True
    with pytest.raises(kernels.UnsupportedModelError, match="Liger-Kernel refuses glm4.*model.kernels: none"):
        kernels.apply_kernels(model, "liger", "cuda")


def test_compile_is_refused_where_untested():
    from raypack.errors import ConfigError

    with pytest.raises(ConfigError, match="train.compile: expected false with train.zero_stage 3"):
        load(None, ["train.compile=true", "train.zero_stage=3"])
    with pytest.raises(ConfigError, match="train.compile: expected false with train.sequence_parallel > 1"):
        load(None, ["train.compile=true", "train.num_workers=2", "train.sequence_parallel=2"])
    assert load(None, ["train.compile=true"]).train.compile


TILED = ["llama", "gemma2", "mixtral", "deepseek_v3", "gpt2", "qwen3_moe"]
"""Plain, GeGLU with softcapping, MoE, MLA with MoE and shared experts, GPT-2's MLP (under `h`), Qwen3 MoE."""


@pytest.mark.parametrize("family", TILED)
def test_tiled_mlp_is_exact(family):
    """MLPs run 5 tokens at a time (rows of up to 30 tokens: several tiles, cut inside examples),
    each tile recomputed in backward: each example alone, logits, loss and every gradient."""
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    model = load_model(config, attention="sdpa_varlen", dtype="float32").train()
    ref = load_model(config, attention="eager", dtype="float32").train()
    ref.load_state_dict(model.state_dict())
    assert kernels.tile_mlps(model, 5) == config.num_hidden_layers
    model.eval(), ref.eval()  # no dropout or router jitter; grad mode is what tiles checkpoint under
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{family} tiled: {worst} off by {errors[worst]:.2e}"


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_tiled_mlp_refuses_an_mlp_that_returns_router_scores(family):
    from raypack.model.traits import UnsupportedModelError

    torch.manual_seed(0)
    model = load_model(FAMILIES[family].build_config(family), attention="sdpa_varlen", dtype="float32").eval()
    kernels.tile_mlps(model, 5)
    with pytest.raises(UnsupportedModelError, match="returns more than its hidden states"):
        packed_vs_alone(model, model)


def test_offloaded_checkpoints_leave_the_loss_and_gradients_as_they_were():
    """model.offload_checkpoints runs the forward under torch's save_on_cpu (what autograd saves
    goes to the host; on the CPU a copy that stays there): the step's loss and every gradient are
    bit for bit the same. What it saves on a GPU is for the GPU benchmark to measure."""
    from raypack.data.collate import collate_packed
    from raypack.train.objectives.loss import CausalLMLoss, label_targets

    torch.manual_seed(0)
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", vocab_size=256,
                       gradient_checkpointing=True).train()
    rows = [{"input_ids": list(range(3, 43)), "labels": list(range(3, 43)), "position_ids": list(range(40))}]
    batch = collate_packed(rows)
    batch.update(label_targets(batch["labels"]))
    loss_fn = CausalLMLoss(model, "chunked")
    results = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        context = kernels.checkpoint_offload(offload, torch.device("cpu"))
        assert isinstance(context, torch.autograd.graph.save_on_cpu) == offload
        with context:
            loss = loss_fn(model, batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])
    with pytest.raises(Exception, match="model.offload_checkpoints"):
        load(None, ["model.offload_checkpoints=true"])


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["lora", "offload"])
def test_compiled_training_with_lora_or_offloaded_checkpoints(extra):
    """train.compile beside LoRA adapters (peft's wrapped linears traced in the layer's graph) and
    beside model.offload_checkpoints (torch's save_on_cpu hooks around the compiled layers): whole,
    exact against each example alone. Whether offloading moves the compiled graphs' saved tensors
    off a GPU is the GPU benchmark's to measure (benchmarks/long_context.py)."""
    from exactness import random_lora_b
    from torch._dynamo.utils import counters

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.train.objectives.loss import probe_batch

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", vocab_size=512,
                       gradient_checkpointing="full").train()  # fmt: skip
    ref = load_model("tiny-llama", attention="eager", dtype="float32", vocab_size=512).eval()
    if extra == "lora":
        lora = PeftConfig(method="lora", r=4, alpha=8)
        model, ref = random_lora_b(apply_adapters(model, lora)), apply_adapters(ref, lora).eval()
    ref.load_state_dict(model.state_dict())
    kernels.compile_layers(model)
    context = kernels.checkpoint_offload(extra == "offload", torch.device("cpu"))
    with context:
        kernels.check_compiled(model, {k: v for k, v in probe_batch(512, padded=False).items() if k != "labels"})
        errors = packed_vs_alone(model, ref)
    assert max(errors.values()) < TOLERANCE, max(errors.items(), key=lambda kv: kv[1])
    assert kernels.compiled_graphs() > 0 and not counters["graph_break"]
