"""LoRA through peft (raypack/model/adapters.py): what it adapts, what the chunked loss refuses,
the frozen-weight checksum, and the folders a run leaves (loaded back with peft and transformers).

Exactness on packed rows, per model family, is in test_families.py (`test_family_with_lora_is_exact`).
"""

from __future__ import annotations

import pytest
import torch
from exactness import make_rows, summed_loss
from peft import PeftModel
from transformers import AutoModelForCausalLM

from raypack.config import PeftConfig
from raypack.data.collate import collate_packed
from raypack.model.adapters import (
    AdapterError, adapted_head, apply_adapters, custom_linears, expected_digests, frozen_digest, frozen_sum,
    is_peft_model, save_adapted, tensor_digest,
)  # fmt: skip
from raypack.model.build import load_model, tiny_config
from raypack.train.objectives.loss import UnsupportedLossError, make_loss

LORA = PeftConfig(method="lora", r=4, alpha=8)


def tiny(family="llama", **overrides):
    torch.manual_seed(0)
    return load_model(tiny_config(family, **overrides), attention="sdpa_varlen", dtype="float32")


def test_base_is_frozen_and_only_adapters_train():
    model = apply_adapters(tiny(), LORA)
    assert is_peft_model(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # all-linear: attention and MLP projections of every layer, never the head
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not adapted_head(model)


@pytest.mark.parametrize("peft", [
    PeftConfig(method="lora", r=4, target_modules=("q_proj", "lm_head")),
    PeftConfig(method="lora", r=4, target_modules=("q_proj",), modules_to_save=("lm_head",)),
])  # fmt: skip
def test_adapted_head_is_refused_by_the_chunked_loss_only(peft):
    model = apply_adapters(tiny(tie_word_embeddings=False), peft)
    assert adapted_head(model)
    with pytest.raises(UnsupportedLossError, match="train.loss: full"):
        make_loss(model, "chunked")
    make_loss(model, "full")


def test_adapted_embeddings_of_a_tied_model_keep_the_chunked_loss_exact():
    """LoRA on the input embeddings of a tied model leaves the head's function alone: the chunked
    loss is accepted, and equals the full-logit loss (loss and every adapter gradient)."""
    losses, grads = {}, {}
    for kind in ("full", "chunked"):
        model = apply_adapters(tiny(tie_word_embeddings=True), PeftConfig(method="lora", r=4, target_modules=("embed_tokens", "q_proj")))
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1
        loss = make_loss(model, kind)
        rows, _ = make_rows(vocab=768)
        losses[kind] = loss(model, collate_packed(rows))
        losses[kind].backward()
        grads[kind] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert torch.allclose(losses["chunked"], losses["full"], rtol=1e-6)
    assert grads["full"].keys() == grads["chunked"].keys() and any("embedding" in n for n in grads["full"])
    for name, g in grads["full"].items():
        assert torch.allclose(grads["chunked"][name], g, rtol=1e-5, atol=1e-7), name


def test_unknown_target_names_the_key():
    with pytest.raises(AdapterError, match=r"model.peft.target_modules \['nope'\].*not found"):
        apply_adapters(tiny(), PeftConfig(method="lora", target_modules=("nope",)))


def test_routers_are_left_out_of_all_linear_and_refused_by_name():
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1)  # fmt: skip
    routers = custom_linears(load_model(config, attention="sdpa_varlen", dtype="float32"))
    assert routers and all(r.endswith("router") for r in routers)
    model = apply_adapters(load_model(config, attention="sdpa_varlen", dtype="float32"), LORA)
    assert not any(n.startswith(tuple(f"base_model.model.{r}.lora" for r in routers)) for n, _ in model.named_parameters())
    with pytest.raises(AdapterError, match="router"):
        apply_adapters(load_model(config, attention="sdpa_varlen", dtype="float32"),
                       PeftConfig(method="lora", target_modules=("q_proj", "router")))


def test_frozen_digest_sees_one_bit():
    model = apply_adapters(tiny(), LORA)
    before = frozen_digest(model)
    lora = next(p for n, p in model.named_parameters() if p.requires_grad)
    lora.data += 1.0  # trainable weights are not part of it
    assert frozen_digest(model) == before
    base = next(p for n, p in model.named_parameters() if not p.requires_grad and p.ndim == 2)
    base.data.view(torch.int32)[0, 0] ^= 1  # the lowest bit of one weight
    assert frozen_digest(model) != before


def test_expected_digests_are_each_ranks_slice_without_padding(monkeypatch):
    """What export checks a checkpoint's base against: under ZeRO 0-2 every rank holds (and
    digests) the whole weights; under ZeRO-3 rank r its r-th slice of every flattened tensor.
    (That these are DeepSpeed's own partitions is checked on a real ZeRO-3 run, tests/ray/commands/test_export.py.)"""
    model = apply_adapters(tiny(), LORA)
    whole = frozen_digest(model)
    assert expected_digests(model, 2, "replicated") == [whole, whole]
    assert expected_digests(model, 1, "zero3") == [whole]
    frozen = [p for _, p in sorted(model.named_parameters(), key=lambda i: i[0]) if not p.requires_grad]
    halves = expected_digests(model, 2, "zero3")
    assert halves == [tensor_digest(p.data.reshape(-1).chunk(2)[r] for p in frozen) for r in (0, 1)]
    assert any(p.numel() == 64 for p in frozen)  # a norm: 22 weights a rank of 3, the last one's padded by 2
    thirds = expected_digests(model, 3, "zero3")
    # Rank 2 as ZeRO-3 holds it: its slices, the last ones padded with whatever was in memory.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 2)
    for p in frozen:
        size = -(-p.numel() // 3)
        part = torch.full((size,), float("nan"), dtype=p.dtype)  # the padding: never the same twice
        real = p.data.reshape(-1)[2 * size:]
        part[:real.numel()] = real
        p.ds_tensor, p.ds_numel = part, p.numel()
    assert frozen_digest(model) == thirds[2]


def test_expected_digests_under_hsdp_repeat_one_nodes_shards(monkeypatch):
    """FSDP2 over all ranks: rank r digests its dim-0 chunk r of N; under HSDP (2 nodes of 2) a
    shard group is one node's ranks, and rank r holds chunk r mod 2 of 2. Export tries every
    divisor of the world (its checkpoint doesn't record the mesh), the flat one first."""
    from types import SimpleNamespace

    from raypack.train.export import shard_groups

    model = apply_adapters(tiny(), LORA)
    frozen = [p for _, p in sorted(model.named_parameters(), key=lambda i: i[0]) if not p.requires_grad]
    flat = expected_digests(model, 4, "fsdp")
    assert flat == [tensor_digest(p.data.chunk(4, dim=0)[r] for p in frozen) for r in range(4)]
    pairs = expected_digests(model, 2, "fsdp")
    assert expected_digests(model, 4, "fsdp", shard_ranks=2) == [*pairs, *pairs] != flat
    assert shard_groups(SimpleNamespace(world_size=4, layout="fsdp")) == [None, 2, 1]
    assert shard_groups(SimpleNamespace(world_size=4, layout="zero3")) == [None]


def test_frozen_sum_adds_up_to_one_processs_on_any_count_of_zero3_ranks(monkeypatch):
    """The base checksum a LoRA run compares when it changes size (checkpoint.same_base): the ranks'
    shares, each weighted by its values' places in the whole tensors, add up to what one process
    holding every weight computes, on 2 and on 3 ZeRO-3 ranks alike (the padding left out); a
    replicated tensor counts on rank 0 alone. (FSDP2's shards: the gloo run of test_torch_engine.py.)"""
    model = apply_adapters(tiny(), LORA)
    whole = frozen_sum(model)
    frozen = [p for _, p in sorted(model.named_parameters(), key=lambda i: i[0]) if not p.requires_grad]
    values = [p.data.clone() for p in frozen]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    rank = {"now": 0}
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank["now"])
    assert frozen_sum(model) == whole
    rank["now"] = 1
    assert frozen_sum(model) == 0, "a weight every rank holds whole counted twice"

    def zero3(world: int) -> int:
        total = 0
        for rank["now"] in range(world):
            for p, v in zip(frozen, values):
                size = -(-v.numel() // world)
                part = torch.full((size,), float("nan"), dtype=v.dtype)  # the padding: never the same twice
                real = v.reshape(-1)[rank["now"] * size:(rank["now"] + 1) * size]
                part[:real.numel()] = real
                p.ds_tensor, p.ds_numel = part, v.numel()
            total += frozen_sum(model)
        return total % (1 << 64)

    assert zero3(2) == zero3(3) == whole
    for p in frozen:
        del p.ds_tensor, p.ds_numel
    rank["now"] = 0
    i, norm = next((i, p) for i, p in enumerate(frozen) if p.ndim == 1)
    norm.data[[0, 1]] = norm.data[[1, 0]] + torch.tensor([0.5, 0.25])  # two values moved (and made unequal)
    moved = frozen_sum(model)
    norm.data[[0, 1]] = norm.data[[1, 0]]
    assert moved != frozen_sum(model) != whole, "two values that changed places went unseen"
    norm.data.copy_(values[i])
    assert frozen_sum(model) == whole
    base = next(p for p in frozen if p.ndim == 2)
    base.data.view(torch.int32)[-1, -1] ^= 1  # the lowest bit of the last weight
    assert frozen_sum(model) != whole


def test_saved_adapter_base_and_merged_model_load_back(tmp_path):
    """The folders a run leaves: peft loads `adapter/` onto `base/`, transformers loads `model/`,
    and both give the trained model's logits."""
    model = apply_adapters(tiny(), LORA)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows, _ = make_rows(vocab=768)
    batch = collate_packed(rows)
    labels = batch.pop("labels")
    for _ in range(3):
        summed_loss(model(**batch).logits, labels).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids = torch.tensor([[5, 9, 33, 7, 100, 4]])
    with torch.no_grad():
        trained = model(input_ids=ids).logits

    assert save_adapted(model, model.state_dict(), tmp_path, merge=True) == ["adapter", "base", "model"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        assert torch.allclose(adapter(input_ids=ids).logits, trained, atol=1e-5)
        assert torch.allclose(merged(input_ids=ids).logits, trained, atol=1e-5)
    # the run's model is untouched by saving: still a PeftModel with its adapters unmerged
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained)


@pytest.mark.parametrize("peft", [PeftConfig(method="lora", r=4, use_dora=True), PeftConfig(method="lora", r=4, use_rslora=True,
                                                                                              dropout=0.1)])
def test_dora_and_rslora_stay_exact_on_packed_rows(peft):
    """DoRA's magnitude is per output feature, rsLoRA only rescales: packing changes neither
    (dropout is off in eval mode, as in the family checks)."""
    from exactness import packed_vs_alone, random_lora_b

    model = random_lora_b(apply_adapters(tiny(), peft), seed=2)
    ref = apply_adapters(load_model(tiny_config("llama"), attention="eager", dtype="float32"), peft)
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model.eval(), ref.eval())
    assert max(errors.values()) < 1e-5, errors
    assert any("magnitude" in k for k in errors) == peft.use_dora
