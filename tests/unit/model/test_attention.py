"""Packed (varlen) attention against running every example alone, on the CPU in fp32, and the
exact path's pieces: per-example segments, chunks, sinks, softcapping, no syncs on CUDA paths."""

from __future__ import annotations

import pytest
import torch
from exactness import make_rows, packed_vs_alone, rel_err, summed_loss
from transformers.utils.generic import is_flash_attention_requested

from raypack.data.collate import collate_packed, count_label_tokens
from raypack.model import attention as attn
from raypack.model.build import UnsupportedModelError, load_model

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 8},  # window shorter than the examples
    "qwen3": {},
    "gemma2": {"sliding_window": 8},  # softcapping, alternating sliding layers, tied embeddings
    "phi3": {},
    "olmo2": {},
    "granite": {},
}
"""The shipped tiny-<family> models under attention='auto' (test_families.py covers many more)."""


def twin(model, attention):
    """The same weights under another attention implementation."""
    ref = load_model(model.config, attention=attention)
    ref.load_state_dict(model.state_dict())
    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_matches_each_example_alone(family):
    torch.manual_seed(0)
    model = load_model(f"tiny-{family}", **FAMILIES[family])
    assert model.config._attn_implementation == "raypack_varlen" and model.config.use_cache is False
    errors = packed_vs_alone(model, twin(model, "eager"))
    assert max(errors.values()) < 1e-5, errors
    # transformers' own loss (a token mean over the same labels) agrees with the summed one
    batch = collate_packed(make_rows()[0])
    with torch.no_grad():
        out = model(**batch)
    torch.testing.assert_close(out.loss * count_label_tokens(batch), summed_loss(out.logits, batch["labels"]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_sliding_window_is_applied():
    """The window test above only means something if the window changes the answer."""
    model = load_model("tiny-mistral", sliding_window=8)
    wide = load_model(model.config, sliding_window=None)
    wide.load_state_dict(model.state_dict())
    batch = collate_packed(make_rows()[0])
    with torch.no_grad():
        assert rel_err(model(**batch).logits, wide(**batch).logits) > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_flatten_matches_pad(family):
    """`flatten` (one packed row) against `pad` (the same examples, right-padded, plain sdpa)."""
    model = load_model(f"tiny-{family}")
    padded_model = twin(model, "sdpa")  # what the loop loads for padded batches (Prepared.padded)
    rows, _ = make_rows(seed=1)
    packed, padded = collate_packed(rows), collate_packed(rows, padded=True)
    assert count_label_tokens(packed) == count_label_tokens(padded)
    with torch.no_grad():
        a, b = model(**packed), padded_model(**padded)
    mask = padded["attention_mask"].bool()
    assert rel_err(a.logits[0], b.logits[mask]) < 1e-5
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_without_collate_metadata_derives_from_position_ids():
    model = load_model("tiny-llama")
    batch = collate_packed(make_rows()[0])
    with torch.no_grad():
        expected = model(**batch).logits
        attn._warned.clear()
        with pytest.warns(UserWarning, match="deriving them from position_ids"):
            got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_cuda_paths_never_sync(monkeypatch):
    """On CUDA a read-back is a sync per layer. The CUDA kernels' path (metadata, chunk
    refinement, the kernel call) must read nothing back; here a stand-in kernel takes the
    kernel's place and every read-back raises."""
    rows, _ = make_rows()
    batch = collate_packed(rows)
    total = batch["input_ids"].shape[1]
    q, k, v = (torch.randn(1, h, total, 16, dtype=torch.bfloat16) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.config, module.layer_idx = type("Cfg", (), {"layer_types": ["chunked_attention"], "attention_chunk_size": 8})(), 0
    seen = {}

    def kernel(module, query, key, value, cu, max_len, *args):
        seen.update(cu=cu, max_len=max_len)
        return torch.zeros(query.shape[0] * query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)

    monkeypatch.setitem(attn._KERNELS, "torch_varlen", kernel)
    meta = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}

    def boom(*args, **kwargs):
        raise AssertionError("device-to-host read on the CUDA path")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    out, _ = attn._make_forward("torch_varlen")(module, q, k, v, None, scaling=0.25, sliding_window=4, **meta)
    monkeypatch.undo()
    assert out.shape == (1, total, 4, 16)
    assert seen["max_len"] == 8 and seen["cu"].shape == (len(batch["cu_seq_lens_q"]) - 1 + total // 8 + 1,)


def test_registered_names_avoid_transformers_substrings():
    """transformers runs its SDPA-support check on names with `sdpa` (it refuses Gemma2 and
    GPT-OSS) and treats names with `flash` as flash kernels to load."""
    attn.register()
    for name in attn.NAMES.values():
        assert "sdpa" not in name and "flash" not in name
        assert not is_flash_attention_requested(requested_attention_implementation=name)
    model = load_model("tiny-gemma2", attention="sdpa_varlen")  # refused by transformers under the old name
    assert model.config._attn_implementation == "raypack_exact_varlen"


def test_model_passing_its_own_mask_is_refused():
    """A model that hands the attention a mask or bias it built itself (Doge's learned dynamic
    mask) can't be packed: refused at the first forward, naming the padded strategies."""
    model = load_model("tiny-llama")
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    bias = torch.zeros(1, 1, 5, 5)
    with pytest.raises(UnsupportedModelError, match=r"LlamaAttention.*\(pad or pad_sorted\)"):
        attn._make_forward(None)(module, q, q[:, :2], q[:, :2], bias)


def test_cuda_kernels_refuse_sinks():
    q = torch.randn(1, 4, 6, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(UnsupportedModelError, match=r"attention sinks.*sdpa_varlen"):
        attn._torch_varlen(None, q, q, q, cu, 6, 0.0, None, None, None, torch.zeros(4))


def test_padding_mask_is_refused():
    model = load_model("tiny-llama")
    with pytest.raises(ValueError, match="attention='sdpa'"):
        model(**collate_packed(make_rows()[0], padded=True))
    batch = collate_packed(make_rows()[0])
    with torch.no_grad():  # a mask of ones pads nothing: the same logits as none
        ones = model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).logits
        torch.testing.assert_close(ones, model(**batch).logits, rtol=0, atol=0)


def test_padding_mask_is_refused_under_lora():
    """PEFT calls the model's forward directly, past its hooks: the refusal sits on the decoder."""
    from raypack.config.sections import PeftConfig
    from raypack.model.adapters import apply_adapters

    model = apply_adapters(load_model("tiny-llama"), PeftConfig(method="lora"), "tiny-llama")
    with pytest.raises(ValueError, match="attention='sdpa'"):
        model(**collate_packed(make_rows()[0], padded=True))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_transformers_looks_for_no_packed_rows(family, monkeypatch):
    """transformers' mask code, for an attention with a mask function registered, looks for packed
    rows in position_ids (a device read each time: once a forward, twice with sliding layers) to
    build a mask raypack's attention never uses. raypack's names have none: it never looks."""
    from transformers import masking_utils

    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a: calls.append(1) or real(*a))
    model = load_model(f"tiny-{family}", **FAMILIES[family])
    model(**collate_packed(make_rows()[0])).logits.sum().backward()
    assert not calls
    sdpa = load_model(f"tiny-{family}", attention="sdpa", **FAMILIES[family])
    sdpa(**collate_packed(make_rows()[0]))
    assert calls, "transformers no longer looks for packed rows: this test shows nothing"


def test_cuda_backends_refuse_fp32_clearly():
    model = load_model("tiny-llama", attention="torch_varlen")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        model(**collate_packed(make_rows()[0]))


def test_dropout_runs_on_cpu_path():
    model = load_model("tiny-llama", attention_dropout=0.5).train()
    out = model(**collate_packed(make_rows()[0]))
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_gradient_checkpointing_keeps_packed_kwargs():
    plain = load_model("tiny-llama", attention_dropout=0.0).train()
    ckpt = twin(plain, "auto")
    ckpt.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert load_model("tiny-llama", gradient_checkpointing=True).is_activation_checkpointing
    batch = collate_packed(make_rows()[0])
    plain(**batch).loss.backward()
    ckpt(**batch).loss.backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5
