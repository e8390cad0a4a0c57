"""The optimizer step's loss is Σ token losses / N over all micro-batches and ranks
(raypack/train/loop.py's docstring says why and how).

2 ranks × 2 micro-batches of unequal packs under ZeRO-2 and ZeRO-3: the loss and the full
gradients after one step's backward equal a single-process computation over the same examples, run
one at a time with the model's own logits. The loss is the chunked one (raypack/train/objectives/loss.py), in
chunks of 7 label tokens; under ZeRO-3 with a tied, softcapped head (Gemma 2), whose output weight
is partitioned outside its module's forward and shared with the embedding.

The four tiny hybrids (tiny-qwen3_5, tiny-qwen3_5_moe, tiny-nemotron_h, tiny-lfm2) under ZeRO-2
and ZeRO-3 each, over three AdamW steps: losses at every step, the first step's gradients and the
final weights, all eight in one Ray Train run.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

# one_thread: the references run here, in the driver, beside the Ray workers (up to 50x slower on
# two threads on a shared 2-core host); the workers are processes of their own, one CPU each
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]

from gloo_fit import EXAMPLES, VOCAB, fit_on_gloo, packed_row  # noqa: E402

CASES = {  # zero stage, tiny family, config overrides, gradient checkpointing and train.compile
    "zero2-llama": (2, "llama", {}, {}),
    "zero3-gemma2-tied-softcap": (3, "gemma2", {"final_logit_softcapping": 0.5}, {}),
    # what a user's fast run trains: compiled layers, selective recompute, the setup probe
    "zero2-llama-compiled-selective": (2, "llama", {}, {"gradient_checkpointing": "selective", "compile": True}),
}

HYBRID_CASES = {  # the hybrids (raypack/model/mixers.py), three optimizer steps each
    f"zero{stage}-{family}": (stage, family, {}, {"gradient_checkpointing": mode, "steps": 3})
    for family, modes in {
        # every recompute mode with each mixer: gated delta rule, with MoE, Mamba-2, short convolution
        # (ZeRO-3 refuses selective: raypack/config)
        "qwen3_5": ("full", "none"), "qwen3_5_moe": ("selective", "full"),
        "nemotron_h": ("none", "full"), "lfm2": ("selective", "none"),
    }.items()
    for stage, mode in zip((2, 3), modes)
}  # fmt: skip
"""Every tiny hybrid under ZeRO-2 and ZeRO-3, all in one Ray Train run (an engine each, one after
the other): a run costs ~30 s here, a case a few seconds."""

TORCH_CASES = {  # the torch engine (train.engine: torch): every mode once, three optimizer steps each
    f"torch{stage}-{family}-{name}": (stage, family, overrides, {"engine": "torch", "steps": 3, **extra})
    for stage, family, name, overrides, extra in (
        (0, "llama", "ddp", {}, {}),
        (1, "llama", "selective", {}, {"gradient_checkpointing": "selective"}),
        (2, "llama", "compiled-selective", {}, {"gradient_checkpointing": "selective", "compile": True}),
        (3, "gemma2", "tied-softcap-full", {"final_logit_softcapping": 0.5}, {"gradient_checkpointing": "full"}),
        (3, "llama", "selective", {}, {"gradient_checkpointing": "selective"}),  # refused under DeepSpeed's ZeRO-3
        (2, "qwen3_5", "full", {}, {"gradient_checkpointing": "full"}),
        (3, "qwen3_5_moe", "none", {}, {}),
        (0, "nemotron_h", "ddp-selective", {}, {"gradient_checkpointing": "selective"}),
        (3, "lfm2", "full", {}, {"gradient_checkpointing": "full"}),
    )
}  # fmt: skip
"""Each mode once on the torch engine (replicated, FSDP2 without and with resharding, each
checkpointing mode, compiled layers, a tied softcapped head, the four mixers), in one Ray Train run."""
TWINS = {f"twin{stage}-llama": (stage, "llama", {}, {"steps": 3}) for stage in (0, 2, 3)}
"""DeepSpeed's ZeRO 0, 2 and 3 on torch0/1/3-llama's model and batches: the two engines' losses and
weights, step by step."""
ALL_CASES = {**CASES, **HYBRID_CASES, **TORCH_CASES, **TWINS}


@pytest.fixture(autouse=True, scope="module")
def folders_saved():
    """Every case's folder written here, before the workers read them: two ranks that each found
    one missing once failed to read its config (ValueError: Unrecognized model, under this file's
    hybrids fit), which the driver then read whole."""
    from checkpoints import saved

    for _, family, overrides, _ in [*ALL_CASES.values(), *LORA_CASES.values()]:
        saved(f"tiny-{family}", vocab_size=VOCAB, dtype=torch.float32, **overrides)
    saved("tiny-llama", vocab_size=VOCAB, dtype=torch.bfloat16)  # the bf16 step's


def build_model(case, attention="auto", reference=False, dtype=torch.float32):
    """`case`'s model read from its saved folder, as a user's model.name (tests/checkpoints.py):
    fp32, whose comparisons with each example alone hold to fp32 rounding, or bf16 as published."""
    from checkpoints import saved

    from raypack.model.build import load_model

    _, family, overrides, extra = ALL_CASES[case]
    checkpointing = "none" if reference else extra.get("gradient_checkpointing", "none")
    folder = saved(f"tiny-{family}", vocab_size=VOCAB, dtype=dtype, **overrides)
    torch.manual_seed(0)
    return load_model(str(folder), attention=attention, dtype=dtype, gradient_checkpointing=checkpointing)


def loop(config):
    """Every case of config["cases"], an engine each; rank 0 saves their results by case."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    results = {case: run_case(case, rank, config["preset"]) for case in config["cases"]}
    if rank == 0:
        torch.save(results, config["out"])


def run_case(case, rank, preset):
    from engine_views import grads as full_grads
    from engine_views import params as full_params

    from raypack.config import TrainConfig
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step

    from raypack.data.collate import move_batch
    from raypack.model.checkpointing import active_mode, check_selective
    from raypack.model.kernels import check_compiled, compile_layers, compiled_graphs
    from raypack.train.objectives.loss import probe_batch

    stage, _, _, extra = ALL_CASES[case]
    steps = extra.get("steps", 1)
    engine_name = extra.get("engine", "deepspeed")
    cfg = TrainConfig(  # a constant learning rate: the reference's AdamW needs no schedule
        num_workers=2, zero_stage=stage, grad_accum=2, grad_clip=0.0, warmup_steps=0, min_lr_ratio=1.0,
        engine=engine_name, deepspeed_preset=preset if engine_name == "deepspeed" else None,
    )  # fmt: skip
    # FSDP2: ranks > 0 build on the meta device and get rank 0's weights (the seeded init, as the
    # reference's); DeepSpeed's ZeRO-3 is not built under zero.Init here, whose init draws differ
    torch_engine = engine_name == "torch"
    with engines.building(cfg, dtype=torch.float32, world_size=2) if torch_engine else contextlib.nullcontext():
        model = build_model(case)
    if extra.get("compile"):  # as raypack.train.loop.setup and setup_worker do
        compile_layers(model)
    engine = engines.build(model, cfg, dtype=torch.float32, world_size=2, total_steps=steps)
    if stage == 3:  # the weights really are partitioned outside forward
        head = engine.module.get_output_embeddings().weight
        assert head.numel() == 0 if engine_name == "deepspeed" else head.to_local().shape[0] < head.shape[0]
    loss_fn = make_loss(engine, "chunked", chunk_tokens=7)
    probe = move_batch(probe_batch(loss_fn.vocab, False), engine.device)
    assert check_selective(engine.module, probe, "auto")[1] is None
    if extra.get("compile"):
        check_compiled(engine.module, probe)
        probed = compiled_graphs()
        assert probed > 0
    step = prepare_step([packed_row(mb) for mb in EXAMPLES[rank]])  # what the loop's prefetcher builds
    n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    losses = []
    for k in range(steps):  # the same micro-batches every step
        loss_sum = forward_backward(engine, step.batches, 2 * 2 / n, loss_fn)
        losses.append(float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n)
        if k == 0:
            grads = full_grads(engine)
        if steps > 1:
            engine.step()
    params = full_params(engine)
    # the step's rows (other lengths than the probe's) compiled nothing new
    new_graphs = compiled_graphs() - probed if extra.get("compile") else 0
    mode = active_mode(engine.module)
    engine.destroy()
    return {"loss": losses[0], "losses": losses, "grads": grads, "params": params, "new_graphs": new_graphs,
            "checkpointing": mode}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_two_microbatches_match_single_process(ray_local, tmp_path, case):
    out = tmp_path / "rank0.pt"
    fit_on_gloo(loop, tmp_path, "exact-loss", 2, out=str(out), cases=[case])
    check_against_examples_alone(case, torch.load(out)[case])


def test_hybrids_packed_equal_unpacked_over_three_steps_under_zero2_and_zero3(ray_local, tmp_path):
    """tiny-qwen3_5, tiny-qwen3_5_moe, tiny-nemotron_h and tiny-lfm2, each under ZeRO-2 and ZeRO-3
    (with full, selective or no recompute): three AdamW steps on packed rows give the losses,
    gradients and weights of the same examples run one at a time through transformers' model."""
    out = tmp_path / "rank0.pt"
    fit_on_gloo(loop, tmp_path, "exact-hybrids", 2, out=str(out), cases=list(HYBRID_CASES))
    got = torch.load(out)
    for case in HYBRID_CASES:
        assert got[case]["checkpointing"] == ALL_CASES[case][3]["gradient_checkpointing"], case
        check_against_examples_alone(case, got[case])


def test_torch_engine_packed_equals_unpacked_in_every_mode_and_equals_deepspeed(ray_local, tmp_path):
    """The torch engine (DDP, FSDP2 without and with resharding) in each mode once: three AdamW
    steps on packed rows give the losses, gradients and weights of the same examples run one at a
    time through transformers' model; and on the same batches its losses and weights equal
    DeepSpeed's at ZeRO 0, 2 and 3 step by step (fp32 on the CPU: both run torch's AdamW on the same
    gradients, averaged over the ranks in another order, so they agree to fp32 rounding)."""
    out = tmp_path / "rank0.pt"
    fit_on_gloo(loop, tmp_path, "exact-torch-engine", 2, out=str(out), cases=list(TORCH_CASES) + list(TWINS))
    got = torch.load(out)
    for case in TORCH_CASES:
        assert got[case]["checkpointing"] == ALL_CASES[case][3].get("gradient_checkpointing", "none"), case
        check_against_examples_alone(case, got[case])
    for stage, torch_case in zip((0, 2, 3), ("torch0-llama-ddp", "torch1-llama-selective", "torch3-llama-selective")):
        ours, theirs = got[torch_case], got[f"twin{stage}-llama"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6), stage
        torch.testing.assert_close(ours["grads"], theirs["grads"], rtol=1e-5, atol=1e-7)
        for name, p in theirs["params"].items():
            # Adam amplifies rounding where a gradient is small (check_against_examples_alone):
            # seen 2.3e-6 on one of 2048 v_proj entries; 1e-5 is 1% of one step's update
            signal = theirs["grads"][name].abs() > 1e-7
            torch.testing.assert_close(ours["params"][name][signal], p[signal], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"ZeRO-{stage}: {name}: {m}")  # fmt: skip


def check_against_examples_alone(case, got):
    """Reference: one process, each example alone, Σ token losses / total label tokens; for
    several steps, raypack's AdamW (the torch optimizer at a constant rate) steps it."""
    from raypack.config import TrainConfig
    from raypack.train.engines.optim import make_optimizer

    model = build_model(case, attention="eager", reference=True)  # the model's own attention and logits
    steps = ALL_CASES[case][3].get("steps", 1)
    optimizer = make_optimizer([{"params": list(model.parameters())}], TrainConfig())
    examples = [e for mbs in EXAMPLES.values() for mb in mbs for e in mb]
    for k in range(steps):
        total, count = 0.0, 0
        for e in examples:
            ids = torch.as_tensor(e)[None]
            logits = model(input_ids=ids).logits
            total = total + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            count += len(e) - 1
        loss = total / count
        loss.backward()
        assert got["losses"][k] == pytest.approx(loss.item(), rel=1e-5), f"{case}: step {k + 1}"
        if k == 0:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
            for name, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
        if steps > 1:
            optimizer.step()
            optimizer.zero_grad()
    if steps > 1:
        # Adam divides each gradient by its own running RMS: an entry whose gradient is near zero
        # (rounding in both runs) may move by a fraction of lr (1e-3) either way. Seen: 1.7e-5 on
        # one of tiny-lfm2's 16384 w3 entries, whose first gradient was -1e-8 (the median 8e-4),
        # and 8.8e-5 on one of tiny-llama's down_proj entries, whose first gradient was 2e-10: so
        # entries whose first gradient is below 1e-7 (rounding noise: 1e-4 of the median) are left
        # out, and the rest agree within 3e-5, 3% of one step's update; the losses above already
        # agree at every step
        for name, p in model.named_parameters():
            signal = first[name].abs() > 1e-7
            torch.testing.assert_close(got["params"][name][signal], p.detach()[signal], rtol=1e-4, atol=3e-5,
                                       msg=lambda m: f"{case}: {name}: {m}")  # fmt: skip
    assert got["new_graphs"] == 0, f"{case}: a packed row of a new length recompiled"


# LoRA (model.peft) under every ZeRO stage: zero stage, tiny family, config overrides, what else.
LORA_CASES = {
    "zero0-lora": (0, "llama", {}, {}),
    "zero1-lora-offload": (1, "llama", {}, {"offload_optimizer": True}),
    "zero2-lora-checkpointing": (2, "llama", {}, {"gradient_checkpointing": True}),
    "zero3-lora-checkpointing-gemma2-tied-softcap": (3, "gemma2", {"final_logit_softcapping": 0.5},
                                                     {"gradient_checkpointing": True}),
    # selective recompute beside ZeRO-2's gradient hooks on the adapters (ZeRO-3 + selective is refused)
    "zero2-lora-selective": (2, "llama", {}, {"gradient_checkpointing": "selective"}),
    # all-linear on the hybrids' mixer projections (the gated delta rule's in_proj_*, Mamba-2's
    # in_proj), with either recompute mode
    "zero3-lora-checkpointing-qwen3_5": (3, "qwen3_5", {}, {"gradient_checkpointing": "full"}),
    "zero2-lora-selective-nemotron_h": (2, "nemotron_h", {}, {"gradient_checkpointing": "selective"}),
    # the torch engine: DDP, FSDP2 with CPU offload, resharding with a tied softcapped head
    "torch0-lora": (0, "llama", {}, {"engine": "torch"}),
    # with a gradient clip: the norm's all-reduce of the offloaded (host) gradients
    "torch2-lora-offload-selective": (2, "llama", {}, {"engine": "torch", "offload_optimizer": True, "grad_clip": 1.0,
                                                       "gradient_checkpointing": "selective"}),
    "torch3-lora-checkpointing-gemma2-tied-softcap": (3, "gemma2", {"final_logit_softcapping": 0.5},
                                                      {"engine": "torch", "gradient_checkpointing": True}),
}
"""One fit runs them all (an engine each, one after the other): a Ray Train run costs ~30 s here.
ZeRO-3 with frozen weights and non-reentrant checkpointing is the combination that crashed in
recompute (transformers issue 47254); offload runs DeepSpeed's CPU Adam."""


def build_lora_model(case, attention="auto"):
    from checkpoints import saved
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model

    _, family, overrides, extra = LORA_CASES[case]
    folder = saved(f"tiny-{family}", vocab_size=VOCAB, dtype=torch.float32, **overrides)  # as build_model's
    model = load_model(str(folder), attention=attention, dtype="float32",
                       gradient_checkpointing=extra.get("gradient_checkpointing", False))
    torch.manual_seed(0)  # the adapters' init
    return random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))


def lora_loop(config):
    import ray.train
    from engine_views import full_param, grads as full_grads

    from raypack.config import TrainConfig
    from raypack.model.adapters import frozen_digest
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step

    rank = ray.train.get_context().get_world_rank()
    results = {}
    for case in config["cases"]:
        stage, _, _, extra = LORA_CASES[case]
        engine_name = extra.get("engine", "deepspeed")
        cfg = TrainConfig(num_workers=2, zero_stage=stage, grad_accum=2, grad_clip=extra.get("grad_clip", 0.0),
                          warmup_steps=0, lr=1e-2,
                          engine=engine_name, deepspeed_preset=config["preset"] if engine_name == "deepspeed" else None,
                          offload_optimizer=extra.get("offload_optimizer", False))
        engine = engines.build(build_lora_model(case), cfg, dtype=torch.float32, world_size=2, total_steps=2)
        base = frozen_digest(engine.module)
        loss_fn = make_loss(engine, "chunked", chunk_tokens=7)
        step = prepare_step([packed_row(mb) for mb in EXAMPLES[rank]])
        n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
        loss_sum = forward_backward(engine, step.batches, 2 * 2 / n, loss_fn)
        loss = float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n
        grads = full_grads(engine, trainable_only=True)
        engine.step()  # the update: the adapters move, the base stays bit-identical
        lora_b = next(p for name, p in engine.module.named_parameters() if "lora_B" in name)
        moved = full_param(engine, lora_b).clone()
        results[case] = {"loss": loss, "grads": grads, "base_unchanged": frozen_digest(engine.module) == base,
                         "moved": moved, "frozen_grads": [n for n, p in engine.module.named_parameters()
                                                          if not p.requires_grad and p.grad is not None]}
        engine.destroy()
    if rank == 0:
        torch.save(results, config["out"])


def test_lora_under_every_zero_stage_matches_single_process(ray_local, tmp_path):
    """Every adapter gradient of one optimizer step (2 ranks x 2 micro-batches of packed rows, the
    chunked loss) equals the gradient of the same examples run one at a time through the model's
    own attention; the base weights get no gradient and stay bit-identical through the update."""
    out = tmp_path / "rank0.pt"
    fit_on_gloo(lora_loop, tmp_path, "exact-lora", 2, out=str(out), cases=list(LORA_CASES))
    got = torch.load(out)

    examples = [e for mbs in EXAMPLES.values() for mb in mbs for e in mb]
    for case in LORA_CASES:
        model = build_lora_model(case, attention="eager")
        total = sum(
            torch.nn.functional.cross_entropy(model(input_ids=torch.as_tensor(e)[None]).logits[0, :-1],
                                              torch.as_tensor(e)[1:], reduction="sum")
            for e in examples
        )
        loss = total / sum(len(e) - 1 for e in examples)
        loss.backward()
        r = got[case]
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-5), case
        adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        assert r["grads"].keys() == adapters.keys() and any("lora_A" in n for n in adapters), case
        for name, p in adapters.items():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
        assert r["base_unchanged"] and not r["frozen_grads"], case
        lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
        assert not torch.equal(r["moved"], lora_b.detach()), f"{case}: the adapters did not train"


def bf16_loop(config):
    """train.precision bf16 under DeepSpeed's ZeRO-2 and the torch engine's FSDP2 (zero_stage 2):
    one step's full gradients and the update each engine applied."""
    import ray.train
    from engine_views import grads as full_grads
    from engine_views import params as full_params

    from raypack.config import TrainConfig
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step

    rank = ray.train.get_context().get_world_rank()
    results = {}
    for name in ("deepspeed", "torch"):
        cfg = TrainConfig(num_workers=2, zero_stage=2, grad_accum=2, grad_clip=0.0, warmup_steps=0, lr=1e-2,
                          precision="bf16", engine=name, deepspeed_preset=config["preset"] if name == "deepspeed" else None)
        engine = engines.build(build_model("zero2-llama", dtype=torch.bfloat16), cfg, dtype=torch.bfloat16, world_size=2,
                               total_steps=1)
        if name == "deepspeed":
            master, inner = engine.optimizer.single_partition_of_fp32_groups, engine.optimizer.optimizer  # bf16 here
        else:  # the weights themselves are the master copy
            master, inner = list(engine.module.parameters()), engine.optimizer
        loss_fn = make_loss(engine, "chunked", chunk_tokens=7)
        step = prepare_step([packed_row(mb) for mb in EXAMPLES[rank]])
        n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
        loss_sum = forward_backward(engine, step.batches, 2 * 2 / n, loss_fn)
        loss = float(global_count([float(loss_sum)], engine.device)[:, 0].sum()) / n
        grads = full_grads(engine)
        engine.step()
        state = next(iter(inner.state.values()))
        results[name] = {"loss": loss, "grads": grads, "after": full_params(engine), "master": [m.dtype for m in master],
                         "state": {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.ndim},
                         "optimizer": type(inner).__name__}
        engine.destroy()
    if rank == 0:
        torch.save(results, config["out"])


def test_bf16_precision_trains_the_same_gradients_and_applies_optimis_update(ray_local, tmp_path):
    """train.precision bf16, on either engine: every weight, master weight, gradient and moment is
    bf16 (plus Kahan's compensation), the packed step's gradients are the examples' own run one at a
    time in bf16 (within bf16's rounding: a leak across packed examples is 7-100% off, DESIGN.md),
    and the update the engine applies is, bit for bit, torch-optimi's Kahan-summed AdamW on those
    gradients."""
    out = tmp_path / "rank0.pt"
    fit_on_gloo(bf16_loop, tmp_path, "bf16", 2, out=str(out))
    for name, got in torch.load(out).items():
        check_bf16_step(got, name)


def check_bf16_step(got, engine):
    import optimi

    assert got["optimizer"] == "AdamW" and got["master"] == [torch.bfloat16] * len(got["master"]), engine
    assert got["state"] == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "kahan_comp": torch.bfloat16}

    model = build_model("zero2-llama", attention="eager", dtype=torch.bfloat16)
    examples = [e for mbs in EXAMPLES.values() for mb in mbs for e in mb]
    total = sum(torch.nn.functional.cross_entropy(model(input_ids=torch.as_tensor(e)[None]).logits[0, :-1].float(),
                                                  torch.as_tensor(e)[1:], reduction="sum") for e in examples)
    loss = total / sum(len(e) - 1 for e in examples)
    loss.backward()
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-2), engine
    for name, p in model.named_parameters():
        error = (got["grads"][name].float() - p.grad.float()).norm() / p.grad.float().norm()
        assert error < 2e-2, f"{engine}: {name}: {error:.3g}"

    # the update: optimi's AdamW, as raypack builds it, on the same bf16 weights and the engine's gradients
    fresh = build_model("zero2-llama", dtype=torch.bfloat16)
    params = dict(fresh.named_parameters())
    for name, p in params.items():
        p.grad = got["grads"][name].to(torch.bfloat16)
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    opt = optimi.AdamW([{"params": decay}, {"params": no_decay}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.0, kahan_sum=True, triton=False)
    opt.step()
    for name, p in params.items():
        assert torch.equal(got["after"][name], p.detach()), f"{engine}: {name}"
