"""Packed (varlen) attention against running every example alone, on the CPU in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raypack.data.collate import collate_packed, count_label_tokens
from raypack.model import attention as attn
from raypack.model.build import load_model

LENGTHS = ([21, 6], [13, 1, 9])  # two rows; one example of a single token
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 8},  # window shorter than the examples
    "qwen3": {},
    "gemma2": {"sliding_window": 8},  # softcapping, alternating sliding layers, tied embeddings
    "phi3": {},
    "olmo2": {},
    "granite": {},
}


def make_rows(lengths=LENGTHS, seed=0, vocab=1024):
    g = torch.Generator().manual_seed(seed)
    rows, examples = [], []
    for row in lengths:
        exs = [torch.randint(3, vocab, (n,), generator=g) for n in row]
        labels = [e.clone() for e in exs]
        labels[0][: len(labels[0]) // 3] = -100  # a prompt that carries no loss
        examples += list(zip(exs, labels))
        rows.append({
            "input_ids": torch.cat(exs).tolist(),
            "labels": torch.cat(labels).tolist(),
            "position_ids": [p for n in row for p in range(n)],
            "example_ids": list(range(len(row))), "pack": 0, "rank": 0, "step": 0, "num_tokens": sum(row),
        })  # fmt: skip
    return rows, examples


def twin(model, attention):
    """The same weights under another attention implementation."""
    ref = load_model(model.config, attention=attention)
    ref.load_state_dict(model.state_dict())
    return ref


def summed_loss(logits, labels):
    return F.cross_entropy(logits[..., :-1, :].flatten(0, -2), labels[..., 1:].flatten(), reduction="sum")


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_matches_each_example_alone(family):
    torch.manual_seed(0)
    model = load_model(f"tiny-{family}", **FAMILIES[family])
    assert model.config._attn_implementation == "raypack_varlen" and model.config.use_cache is False
    ref = twin(model, "eager" if family == "gemma2" else "sdpa")
    rows, examples = make_rows()
    batch = collate_packed(rows)

    out = model(**batch)
    loss = summed_loss(out.logits, batch["labels"])
    torch.testing.assert_close(out.loss * count_label_tokens(batch), loss, rtol=1e-5, atol=1e-5)
    loss.backward()

    ref_logits, ref_loss = [], 0.0
    for ids, labels in examples:
        logits = ref(input_ids=ids[None]).logits
        ref_logits.append(logits[0])
        ref_loss = ref_loss + summed_loss(logits, labels[None])
    ref_loss.backward()

    assert rel_err(out.logits[0], torch.cat(ref_logits)) < 1e-5
    assert rel_err(loss, ref_loss) < 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name


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


def test_attention_function_never_syncs(monkeypatch):
    """The attention function itself must not read device values back (that would be a sync per
    layer on CUDA). On the CPU we make every read-back raise."""
    batch = collate_packed(make_rows()[0])
    total = batch["input_ids"].shape[1]
    q, k, v = torch.randn(1, 4, total, 16), torch.randn(1, 2, total, 16), torch.randn(1, 2, total, 16)
    module = torch.nn.Module()
    fn = attn._make_forward(None)
    meta = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    expected, _ = fn(module, q, k, v, None, scaling=0.25, sliding_window=4, **meta)

    def boom(*args, **kwargs):
        raise AssertionError("device-to-host read in the attention function")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    attn._masks._entries.clear()
    out, _ = fn(module, q, k, v, None, scaling=0.25, sliding_window=4, **meta)
    monkeypatch.undo()
    assert out.shape == (1, total, 4, 16)
    torch.testing.assert_close(out, expected)


def test_padding_mask_is_refused():
    model = load_model("tiny-llama")
    with pytest.raises(ValueError, match="attention='sdpa'"):
        model(**collate_packed(make_rows()[0], padded=True))


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
