"""The chunked loss (raypack/train/objectives/loss.py) against the full-logit loss, on the CPU in fp32: the
loss and every parameter gradient, for untied, tied, softcapped and scaled heads, packed and
padded; the probe that refuses a model whose logits it can't reproduce; and the memory property
(no [tokens, vocab] tensor kept for backward)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

from raypack.data.collate import collate_packed
from raypack.model.build import load_model, tiny_config
from raypack.train.objectives import loss as loss_mod
from raypack.train.objectives.loss import CausalLMLoss, UnsupportedLossError, label_targets, make_loss

LENGTHS = ([21, 6], [13, 1, 9])
FAMILIES = {
    "llama": {},  # untied head
    "gemma": {},  # tied embeddings
    "gemma2": {"final_logit_softcapping": 0.5},  # tied + softcapping small enough to bend real logits
    "granite": {"logits_scaling": 4.0},  # divides
    "cohere": {"logit_scale": 0.0625, "tie_word_embeddings": True},  # multiplies
}


def model_for(family: str, attention: str = "auto"):
    torch.manual_seed(0)
    overrides = FAMILIES[family]
    if family == "cohere":  # not a tiny-<family> of build.py: the same sizes from its config class
        cfg = transformers.CohereConfig(**{**tiny_config("llama").to_dict(), "vocab_size": 1024, **overrides})
        return load_model(cfg, attention=attention, dtype="float32")
    return load_model(f"tiny-{family}", attention=attention, dtype="float32", **overrides)


def make_batch(padded: bool, seed: int = 0, vocab: int = 1024) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in LENGTHS:
        ids = torch.randint(3, vocab, (sum(row),), generator=g)
        labels = ids.clone()
        labels[:4] = -100  # a prompt without loss
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": [p for n in row for p in range(n)]})
    return collate_packed(rows, padded=padded, pad_token_id=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest value: fp32 summation order moves single small
    elements by more than an elementwise rtol allows."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def loss_and_grads(model, loss, batch):
    model.zero_grad(set_to_none=True)
    value = loss(model, batch)
    (value * 0.37).backward()  # scaled, as the loop scales by world * accum / N
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_matches_full_loss_and_every_gradient(family, padded):
    model = model_for(family, attention="eager" if padded else "auto")
    batch = make_batch(padded)
    ref, ref_grads = loss_and_grads(model, CausalLMLoss(model, "full"), batch)
    # 5 label tokens a chunk: several chunks and a ragged last one
    chunked = make_loss(model, "chunked", chunk_tokens=5, padded=padded)
    got, grads = loss_and_grads(model, chunked, batch)

    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name
    # host-computed targets (what the prefetcher passes) give the very same loss
    with_targets = {**batch, **label_targets(batch["labels"])}
    torch.testing.assert_close(chunked(model, with_targets).detach(), got, rtol=0, atol=0)
    # and without gradients (evaluation)
    with torch.no_grad():
        torch.testing.assert_close(chunked(model, batch), ref, rtol=1e-6, atol=1e-5)


def test_a_forward_that_reads_the_heads_weight_trains_chunked():
    """Mamba2ForCausalLM (transformers 5.25) casts the hidden states to `lm_head.weight.dtype` before
    its head: the stand-in that captures them shows the head's weight, and the loss is the full one."""

    class Reading(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            return CausalLMOutputWithPast(logits=self.lm_head(hidden.to(self.lm_head.weight.dtype)).float())

    torch.manual_seed(0)
    model = Reading(tiny_config("llama", vocab_size=1024))
    batch = make_batch(False)
    ref, ref_grads = loss_and_grads(model, CausalLMLoss(model, "full"), batch)
    got, grads = loss_and_grads(model, make_loss(model, "chunked", chunk_tokens=5), batch)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and all(rel_err(g, ref_grads[n]) < 1e-5 for n, g in grads.items())


def test_tied_head_gets_both_gradients():
    model = model_for("gemma")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    batch = make_batch(False)
    _, ref = loss_and_grads(model, CausalLMLoss(model, "full"), batch)
    _, got = loss_and_grads(model, CausalLMLoss(model, "chunked", chunk_tokens=3), batch)
    name = "model.embed_tokens.weight"
    assert rel_err(got[name], ref[name]) < 1e-5
    # the embedding rows of input tokens that are never targets get only the lookup's gradient
    assert got[name].abs().sum() > 0


def test_label_targets_pick_the_shifted_label_positions():
    labels = torch.tensor([[5, -100, 7, 8, -100], [-100, 3, 4, -100, -100]])
    t = label_targets(labels)
    # position t predicts labels[t + 1]; flat positions index [B * L]
    assert t["loss_positions"].tolist() == [1, 2, 5, 6]
    assert t["loss_targets"].tolist() == [7, 8, 3, 4]


@pytest.mark.parametrize(("vocab", "chunk"), [(32000, 2048), (128256, 2048), (262144, 1024)])
def test_auto_chunk_holds_a_bounded_slice_of_the_vocabulary(vocab, chunk):
    model = load_model(tiny_config("llama", vocab_size=vocab), dtype="float32")
    loss = CausalLMLoss(model, "chunked")
    assert loss.chunk == chunk  # 2048 tokens unless a chunk's fp32 logits would pass 1 GiB (Gemma's 262k vocabulary)
    assert loss.chunk * loss.vocab * 4 <= loss_mod.CHUNK_BYTES


def logit_rows_saved(model, loss, batch) -> int:
    """The most rows of any [.., vocab] activation autograd saves while the loss runs forward."""
    params = {p.data_ptr() for p in model.parameters()}
    vocab, rows = model.config.vocab_size, [0]

    def pack(t):
        if t.data_ptr() not in params and t.dim() and t.shape[-1] == vocab:
            rows.append(t.numel() // vocab)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model, batch)
    return max(rows)


def test_chunked_keeps_no_logits_beyond_one_chunk():
    """The full loss saves [T, V] logits for backward (the negative case); the chunked one never
    more than one chunk's, and those only inside its forward."""
    model = model_for("llama")
    batch = make_batch(False)
    tokens = batch["input_ids"].numel()
    assert logit_rows_saved(model, CausalLMLoss(model, "full"), batch) >= tokens - 1
    assert logit_rows_saved(model, CausalLMLoss(model, "chunked", chunk_tokens=5), batch) == 5


def test_probe_refuses_logits_that_are_not_the_head(monkeypatch):
    """A model that changes its logits after the head in a way raypack does not know is refused
    before training; here a forward hook doubles them."""
    model = model_for("llama")

    def double(module, args, kwargs, output):
        output.logits = output.logits * 2
        return output

    model.register_forward_hook(double, with_kwargs=True)
    with pytest.raises(UnsupportedLossError, match="train.loss: full"):
        make_loss(model, "chunked")
    make_loss(model, "full")  # the full loss trains it as it is


def test_probe_would_catch_a_known_transform_if_it_were_missed(monkeypatch):
    """Without the config trait (logits_scaling), Granite's logits differ and the probe says so."""
    model = model_for("granite")
    make_loss(model, "chunked")
    monkeypatch.setattr(loss_mod, "output_transforms", lambda config: [])
    with pytest.raises(UnsupportedLossError, match="differ by"):
        make_loss(model, "chunked")


def test_head_that_is_not_a_linear_layer_is_refused():
    model = model_for("llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(UnsupportedLossError, match="not a torch Linear"):
        CausalLMLoss(model, "chunked")


def test_unknown_loss_name():
    with pytest.raises(ValueError, match="train.loss"):
        CausalLMLoss(model_for("llama"), "fused")


def test_a_batch_without_label_tokens_has_zero_loss_and_gradients():
    model = model_for("llama")
    batch = make_batch(False)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    value, grads = loss_and_grads(model, make_loss(model, "chunked", chunk_tokens=5), batch)
    assert value.item() == 0.0
    assert all(g.abs().max() == 0 for g in grads.values())


def test_under_precision_mixed_the_head_and_loss_compute_in_bf16_as_the_models_forward_does():
    """The torch engine's DDP keeps fp32 weights (the master copy) and runs the forward under
    autocast; the head and loss, called after that forward, compute in bf16 too: the probe is
    exact, and loss and gradients are the full loss's under autocast (rounded once more: dW's
    chunks are summed in fp32). A head in the weights' fp32 was refused by the probe (issue 60)."""
    from checkpoints import saved

    from raypack.config import TrainConfig
    from raypack.train import engines
    from raypack.train.objectives.loss import probe, probe_batch, token_loss_sum

    cfg = TrainConfig(engine="torch", zero_stage=0)  # precision mixed, as GPU users run it
    weights, compute = engines.weights_dtype(cfg, "bfloat16"), engines.compute_dtype(cfg, "bfloat16")
    model = load_model(str(saved("tiny-llama", vocab_size=97)), dtype=str(weights).removeprefix("torch."))
    engine = engines.build(model, cfg, dtype=compute, world_size=1, total_steps=1)
    assert (next(engine.module.parameters()).dtype, compute) == (torch.float32, torch.bfloat16)
    loss = make_loss(engine, "chunked", chunk_tokens=5)  # refused before the head followed the compute dtype
    assert probe(loss, engine, engine.module, probe_batch(97, padded=False)) == 0.0
    with pytest.raises(UnsupportedLossError, match="tolerance 1e-04"):  # the head in fp32: what users got
        probe(CausalLMLoss(engine.module, "chunked"), engine, engine.module, probe_batch(97, padded=False))

    batch = make_batch(padded=False, vocab=97)
    grads = []
    for fn in (lambda: loss(engine, batch),
               lambda: token_loss_sum(engine(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                      batch["labels"])):
        engine.module.zero_grad(set_to_none=True)
        value = fn()
        value.backward()
        grads.append((value.detach(), {n: p.grad.clone() for n, p in engine.module.named_parameters()}))
    (ours, g_ours), (full, g_full) = grads
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=0)
    for name, g in g_full.items():
        assert g_ours[name].dtype == torch.float32, name
        torch.testing.assert_close(g_ours[name], g, rtol=2e-2, atol=2e-2 * g.abs().max().item(), msg=name)
