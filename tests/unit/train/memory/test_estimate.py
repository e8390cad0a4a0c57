"""The per-GPU memory estimate: its parameter counts against the models transformers and peft
build (what the arithmetic did not write), and the relations between full fine-tuning, LoRA
and QLoRA that any correct estimate keeps."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config

from raypack.config import PeftConfig, load
from raypack.model.adapters import apply_adapters, trainable_summary
from raypack.model.build import load_model, model_config
from raypack.train.memory.auto import AUTO_MARGIN, CONTEXT_BYTES, choose_checkpointing, usable_bytes
from raypack.train.memory.estimate import CHECKPOINTING, GB, NF4_BYTES, Arch, adapted, estimate, trained_params

LLAMA_8B = Arch(32, 4096, 14336, 32, 8, 128256)
ZERO2 = {"reduce_bucket_size": 500_000_000}


def cfg(*overrides: str):
    """An 8-GPU ZeRO-2 run of 8192-token rows without gradient checkpointing, with `overrides`."""
    base = ["train.num_workers=8", "train.use_gpu=true", "train.zero_stage=2", "pack.budget=8192",
            "model.gradient_checkpointing=none"]
    return load(None, [*base, *overrides])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_parameter_count_is_the_models(family):
    model = load_model(f"tiny-{family}")
    assert Arch.from_config(model_config(f"tiny-{family}")).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("peft", [
    PeftConfig(method="lora"),
    PeftConfig(method="lora", r=4, target_modules=("q_proj", "v_proj")),
    PeftConfig(method="lora", r=8, target_modules=("mlp.down_proj", "self_attn.o_proj")),
    PeftConfig(method="lora", use_dora=True),
    PeftConfig(method="lora", modules_to_save=("lm_head",)),
], ids=["all-linear", "q-v", "suffixes", "dora", "modules-to-save"])  # fmt: skip
def test_adapter_count_is_peft_s(peft):
    """peft wraps a real tiny Llama; what it trains is what the estimate counts."""
    model = apply_adapters(load_model("tiny-llama"), peft)
    arch = Arch.from_config(model_config("tiny-llama"))
    summary = trainable_summary(model)
    assert summary["trainable_params"] == trained_params(arch, peft)
    assert summary["total_params"] == arch.params + trained_params(arch, peft)  # the adapters come beside


def test_llama_8b_adapters_and_shapes():
    assert abs(LLAMA_8B.params / 8.03e9 - 1) < 0.01
    assert trained_params(LLAMA_8B, PeftConfig(method="lora")) == 41_943_040  # peft's figure for r=16 all-linear
    assert Arch.from_config(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)) == LLAMA_8B
    qwen = Arch.from_config(Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))
    assert qwen.qkv_bias and abs(qwen.params / 7.62e9 - 1) < 0.01


def test_lora_needs_less_than_full_fine_tuning():
    for stage in ("2", "3"):
        full = estimate(cfg(f"train.zero_stage={stage}"), LLAMA_8B, zero=ZERO2)
        lora = estimate(cfg(f"train.zero_stage={stage}", "model.peft.method=lora"), LLAMA_8B, zero=ZERO2)
        assert lora.total < full.total
        assert lora.optimizer < full.optimizer / 100 and lora.grads < full.grads
        # frozen weights are still held (and sharded alike), and the adapters beside them
        assert full.weights < lora.weights < full.weights * 1.01
        # the backward through frozen layers keeps the same activations, plus the adapters' r-wide ones
        assert full.activations < lora.activations < full.activations * 1.01
        assert lora.head_sum == 0 < full.head_sum  # the head is frozen: no fp32 sum of its gradient


def test_qlora_weights_are_about_a_quarter():
    assert 0.25 < NF4_BYTES / 2 < 0.26  # 4 bits + the double-quantized constants, against bf16
    lora = estimate(cfg("model.peft.method=lora"), LLAMA_8B, zero=ZERO2)
    qlora = estimate(cfg("model.peft.method=qlora"), LLAMA_8B, zero=ZERO2)
    quantized = LLAMA_8B.layers * LLAMA_8B.linear_params
    # everything but the layers' linears (embeddings, head, norms, adapters) stays bf16
    assert qlora.weights - (lora.weights - 2 * quantized) == pytest.approx(
        NF4_BYTES * quantized + 2 * max(a * b for a, b in LLAMA_8B.linears().values()))
    assert 0.3 < qlora.weights / lora.weights < 0.4
    assert (qlora.grads, qlora.optimizer, qlora.activations) == (lora.grads, lora.optimizer, lora.activations)


def test_terms_follow_the_setting():
    base = estimate(cfg("model.peft.method=lora"), LLAMA_8B, zero=ZERO2)
    ckpt = estimate(cfg("model.peft.method=lora", "model.gradient_checkpointing=true"), LLAMA_8B, zero=ZERO2)
    longer = estimate(cfg("model.peft.method=lora", "pack.budget=16384"), LLAMA_8B, zero=ZERO2)
    dropout = estimate(cfg("model.peft.method=lora", "model.peft.dropout=0.1"), LLAMA_8B, zero=ZERO2)
    assert ckpt.activations < base.activations / 5
    assert longer.activations == pytest.approx(2 * base.activations)
    assert dropout.activations > base.activations * 1.2  # a copy of every adapted input, and its mask
    full_loss = estimate(cfg("model.peft.method=lora", "train.loss=full"), LLAMA_8B, zero=ZERO2)
    assert full_loss.logits == 12 * 8192 * LLAMA_8B.vocab and base.logits == 12 * 2048 * LLAMA_8B.vocab


def test_offload_moves_the_optimizer_to_the_host():
    m = estimate(cfg("train.offload_optimizer=true"), LLAMA_8B, zero=ZERO2)
    assert m.optimizer == 0 and m.host == 16 * LLAMA_8B.params / 8


def test_unknown_target_modules_are_refused_not_guessed():
    with pytest.raises(ValueError, match="can't size"):
        adapted(PeftConfig(method="lora", target_modules=("c_attn",)))  # GPT-2's fused projection
    with pytest.raises(ValueError, match="some layers only"):
        adapted(PeftConfig(method="lora", target_modules=("model.layers.0.mlp.down_proj",)))


def test_line_names_the_setting():
    c = load("jobs/configs/llama8b_lora_1gpu.yaml")
    line = estimate(c, LLAMA_8B).line(c, LLAMA_8B)  # the zero2 preset, read through engine.load_preset
    assert line.startswith("31.2 GB = weights 16.1 + gradients 1.1 + optimizer 0.5 + activations 10.3 + loss 3.2")
    for part in ("lora r16", "41.9M of 8.03B", "ZeRO-2 over 1 rank(s)", "mixed precision", "gradient checkpointing full",
                 "16384 tokens"):
        assert part in line
    assert estimate(c, LLAMA_8B).total < 80 * GB


LLAMA_1B = Arch(16, 2048, 8192, 32, 8, 128256, tied=True)


def test_checkpointing_modes_trade_memory_in_order():
    """none keeps every activation, selective the matmul and attention outputs, full a layer's input."""
    c = cfg("pack.budget=16384")
    acts = {mode: estimate(c, LLAMA_1B, zero=ZERO2, checkpointing=mode).activations for mode in CHECKPOINTING}
    assert acts["none"] > acts["selective"] > acts["full"]
    with pytest.raises(ValueError, match="'auto'"):
        estimate(cfg("model.gradient_checkpointing=auto"), LLAMA_1B, zero=ZERO2)


def test_auto_takes_the_fastest_mode_that_fits():
    c = cfg("pack.budget=16384", "model.gradient_checkpointing=auto", "train.deepspeed_preset=zero2")
    sizes = {mode: estimate(c, LLAMA_1B, checkpointing=mode).total for mode in CHECKPOINTING}

    def room(total):  # a device whose usable bytes are exactly `total`
        return total / (1 - AUTO_MARGIN) + CONTEXT_BYTES

    assert usable_bytes(room(sizes["none"]), "cuda") == pytest.approx(sizes["none"])
    assert choose_checkpointing(c, LLAMA_1B, room(sizes["none"]))[0] == "none"
    assert choose_checkpointing(c, LLAMA_1B, room(sizes["none"]) - 1e6)[0] == "selective"
    assert choose_checkpointing(c, LLAMA_1B, room(sizes["selective"]) - 1e6)[0] == "full"
    mode, why = choose_checkpointing(c, LLAMA_1B, room(sizes["full"]) - 1e6)
    assert mode == "full" and why.startswith("no mode fits") and "full needs least" in why
    mode, why = choose_checkpointing(c, LLAMA_1B, 80e9)
    assert mode == "none" and f"none {sizes['none'] / GB:.1f} GB" in why and "80.0 GB" in why
    # tiled MLPs drop what selective would keep: auto never takes it with them
    tiled = cfg("pack.budget=16384", "model.gradient_checkpointing=auto", "model.tiled_mlp_tokens=2048",
                "train.deepspeed_preset=zero2")
    none = estimate(tiled, LLAMA_1B, checkpointing="none").total
    mode, why = choose_checkpointing(tiled, LLAMA_1B, room(none) - 1e6)
    assert mode == "full" and "selective" not in why
    assert choose_checkpointing(cfg("model.gradient_checkpointing=selective"), LLAMA_1B, 1.0) == ("selective",
                                                                                                   "as configured")


def test_auto_never_takes_selective_under_zero3():
    c = cfg("pack.budget=16384", "model.gradient_checkpointing=auto", "train.zero_stage=3")
    mode, why = choose_checkpointing(c, LLAMA_1B, 1e9)
    assert mode == "full" and "selective" not in why


def test_liger_uncompiled_rules_selective_out(monkeypatch):
    """Liger's RoPE writes into the q and k projections' outputs, which selective keeps."""
    from raypack.errors import InputError
    from raypack.model import kernels
    from raypack.train.memory.auto import resolve_checkpointing

    monkeypatch.setattr(kernels, "resolve_kernels", lambda *args, **kwargs: "liger")
    run = ["model.name=tiny-llama", "pack.budget=64", "train.num_workers=1"]
    with pytest.raises(InputError, match="selective with Liger-Kernel's kernels uncompiled"):
        resolve_checkpointing(load(None, [*run, "model.gradient_checkpointing=selective"]), "cpu")
    mode, why = resolve_checkpointing(load(None, [*run, "model.gradient_checkpointing=auto"]), "cpu")
    assert mode in ("none", "full") and "selective" not in why
    # compiled, Liger's calls run on copies: selective stands
    compiled = load(None, [*run, "model.gradient_checkpointing=selective", "train.compile=true"])
    assert resolve_checkpointing(compiled, "cpu") == ("selective", "as configured")


def tensor_bytes(value) -> int:
    """Bytes of every tensor in a nest of dicts and lists."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_weights_and_optimizer_state_are_what_deepspeed_holds(precision, one_rank_group):
    """The estimate's weights and optimizer terms against the bytes a real ZeRO-2 engine holds on
    the CPU after a step (its saved optimizer state: the master partition and the moments, with
    Kahan's compensation in bf16)."""
    import torch

    from raypack.train.engines.deepspeed_engine import setup_engine

    c = load(None, ["train.num_workers=1", "train.zero_stage=2", f"train.precision={precision}", "model.dtype=bfloat16",
                    "model.gradient_checkpointing=none"])  # activations aside: weights and optimizer state here
    arch = Arch.from_config(model_config("tiny-llama"))
    model = load_model("tiny-llama", dtype="bfloat16")
    engine = setup_engine(model, c.train, dtype=torch.bfloat16, world_size=1, total_steps=1)
    ids = torch.randint(0, arch.vocab, (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    weights = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    saved = engine.optimizer.state_dict()
    held = tensor_bytes(saved["base_optimizer_state"]["state"]) + tensor_bytes(saved["single_partition_of_fp32_groups"])
    mem = estimate(c, arch, zero={}, checkpointing="none")  # weights and optimizer: the same in every mode
    assert weights == mem.weights == 2 * arch.params
    # torch AdamW's per-group step counters (8 B each) are the only bytes the arithmetic leaves out
    assert held == pytest.approx(mem.optimizer, abs=64) and mem.optimizer == {"mixed": 12, "bf16": 8}[precision] * arch.params
    engine.destroy()


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_weights_and_optimizer_state_are_what_the_torch_engine_holds(precision, one_rank_group):
    """The torch engine on one rank (the bare model): its stored weights (fp32 master weights for
    mixed, bf16 for bf16) and AdamW's moments (plus Kahan's compensation) after a step, against the
    estimate; the estimate's weights add the forward's bf16 cast of them (mixed on a GPU)."""
    import torch

    from raypack.train import engines

    c = load(None, ["train.engine=torch", "train.num_workers=1", "train.zero_stage=0", f"train.precision={precision}",
                    "model.dtype=bfloat16", "model.gradient_checkpointing=none"])
    arch = Arch.from_config(model_config("tiny-llama"))
    model = load_model("tiny-llama", dtype=engines.weights_dtype(c.train, c.model.dtype))
    engine = engines.build(model, c.train, dtype=torch.bfloat16, world_size=1, total_steps=1)
    ids = torch.randint(0, arch.vocab, (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    stored = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    held = tensor_bytes([v for state in engine.optimizer.state.values() for k, v in state.items() if k != "step"])
    mem = estimate(c, arch, checkpointing="none")
    weight_bytes, cast = {"mixed": (4, 2), "bf16": (2, 0)}[precision]
    assert stored == weight_bytes * arch.params and mem.weights == (weight_bytes + cast) * arch.params
    assert held == mem.optimizer == {"mixed": 8, "bf16": 6}[precision] * arch.params


def test_fsdp2_counts_one_nodes_shard_group_under_hsdp_and_the_steps_accumulated_gradients():
    """FSDP2 (the torch engine, zero_stage 1-3): under HSDP a rank holds 1/S of the weights, S one
    node's ranks (fsdp.mesh_shape), not 1/N; at stages 1-2 with grad_accum > 1 every layer's
    unsharded gradients accumulate, in FSDP2's reduce dtype (fp32 under mixed), until the step's
    last micro-batch reduce-scatters them (torch's FSDPParam.to_accumulated_grad_if_needed)."""
    from raypack.train.memory.engines import shard_ranks_of

    assert [shard_ranks_of(8, 4), shard_ranks_of(8, 8), shard_ranks_of(6, 4), shard_ranks_of(16, 8)] == [4, 8, 6, 8]
    arch = Arch.from_config(model_config("tiny-llama"))
    run = ["train.engine=torch", "train.num_workers=8", "model.dtype=bfloat16", "model.gradient_checkpointing=none"]

    def mem(*extra, shard_ranks=None):
        return estimate(load(None, [*run, *extra]), arch, checkpointing="none", shard_ranks=shard_ranks)

    flat, hsdp = mem("train.zero_stage=3"), mem("train.zero_stage=3", shard_ranks=4)
    at_rest = 4 * arch.params  # fp32 master weights, sharded
    assert hsdp.weights - flat.weights == pytest.approx(at_rest / 4 - at_rest / 8)
    assert hsdp.optimizer == 2 * flat.optimizer == 2 * 8 * arch.params / 8
    one, two = mem("train.zero_stage=2", "train.grad_accum=1"), mem("train.zero_stage=2", "train.grad_accum=2")
    assert two.grads - one.grads == pytest.approx(4 * arch.params)  # fp32, whole: every layer's
    assert mem("train.zero_stage=3", "train.grad_accum=2").grads == flat.grads  # stage 3 reduce-scatters each one
