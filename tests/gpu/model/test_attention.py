"""CUDA varlen attention (flash-attn or torch varlen_attn, and the exact per-example path on CUDA)
against each example alone under eager attention: bf16, or fp32 where bf16 rounding would drown the check."""

from __future__ import annotations

import pytest
import torch
import transformers
from exactness import packed_vs_alone

from raypack.data.collate import collate_packed, move_batch
from raypack.model import attention as attn
from raypack.model.build import UnsupportedModelError, load_model

pytestmark = pytest.mark.gpu

LENGTHS = ([300, 41, 1, 150], [500, 77])
TOLERANCE = {  # (logits and loss, gradients), relative
    torch.bfloat16: (2e-2, 5e-2),  # a few ulps after two layers, more in gradients summed over 1000 tokens
    torch.float32: (1e-4, 1e-4),  # other reduction orders on the GPU; no TF32 in matmuls by default
}
SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
MOE = dict(num_local_experts=1, num_experts_per_tok=1)
"""One expert: in bf16 a rounding difference can flip a top-k choice between two experts (seen here:
0.19 relative logits for 4 experts on the CPU, 6e-7 in fp32), which says nothing about attention."""


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in LENGTHS:
        ids = torch.cat([torch.randint(3, 1024, (n,), generator=g) for n in lengths]).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": [p for n in lengths for p in range(n)]})
    return rows


def check_exact(model):
    ref = load_model(model.config, attention="eager", dtype=model.dtype).cuda().eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model.eval(), ref, lengths=LENGTHS, device="cuda")
    values, gradients = TOLERANCE[model.dtype]
    assert errors["logits"] < values, errors["logits"]
    assert errors["loss"] < values, errors["loss"]
    grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
    worst = max(grads, key=grads.get)
    assert grads[worst] < gradients, (worst, grads[worst])


def backends():
    return ["auto", "torch_varlen", "sdpa_varlen"] + (["flash_attn"] if attn.flash_attn_available() else [])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {"sliding_window": 64}), ("qwen3", {})])
def test_cuda_varlen_matches_each_example_alone(backend, family, overrides):
    torch.manual_seed(0)
    model = load_model(f"tiny-{family}", attention=backend, dtype="bfloat16", **overrides, **SIZES).cuda()
    check_exact(model)


@pytest.mark.parametrize("backend", backends())
def test_chunked_attention_on_cuda(backend):
    """Llama 4's chunked layers: the kernels run over cu_seqlens refined at chunk boundaries
    (with empty trailing segments), the exact path per chunk."""
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**SIZES, **MOE, intermediate_size=512, intermediate_size_mlp=512,
                                        num_hidden_layers=2, vocab_size=1024, attention_chunk_size=64,
                                        no_rope_layers=[1, 0], use_cache=False)  # fmt: skip
    check_exact(load_model(cfg, attention=backend, dtype="bfloat16").cuda())


def gpt_oss():
    return transformers.GptOssConfig(**SIZES, **MOE, intermediate_size=512, num_hidden_layers=2, vocab_size=1024,
                                     sliding_window=64, use_cache=False)  # fmt: skip


def test_sinks_exact_per_example_on_cuda_and_refused_by_the_kernels():
    """fp32: GPT-OSS's expert biases sum their gradient over every token, which bf16 rounds by
    several ulps whichever way the tokens are grouped (0.14 relative seen on the CPU)."""
    torch.manual_seed(0)
    check_exact(load_model(gpt_oss(), attention="sdpa_varlen", dtype="float32").cuda())
    for backend in [b for b in backends() if b != "sdpa_varlen"]:
        with pytest.raises(UnsupportedModelError, match="attention sinks"):
            load_model(gpt_oss(), attention=backend, dtype="bfloat16")


def test_softcap_exact_per_example_on_cuda():
    torch.manual_seed(0)
    for dtype in ("float32", "bfloat16"):
        model = load_model("tiny-gemma2", attention="sdpa_varlen", dtype=dtype, sliding_window=64, **SIZES)
        check_exact(model.cuda())


def test_torch_varlen_refuses_softcap_before_training():
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        load_model("tiny-gemma2", attention="torch_varlen", dtype="bfloat16")


def test_kernel_path_does_not_sync():
    batch = move_batch(collate_packed(_rows()), "cuda")
    total = batch["input_ids"].shape[1]
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q[:, :2]), torch.randn_like(q[:, :2])
    meta = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    chunked = torch.nn.Module()
    chunked.config = type("Cfg", (), {"layer_types": ["chunked_attention"], "attention_chunk_size": 64})()
    chunked.layer_idx = 0
    for module in (torch.nn.Module(), chunked):
        fn = attn._make_forward(None)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = fn(module, q, k, v, None, scaling=0.125, sliding_window=128, **meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.shape == (1, total, 8, 64)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_compiled_training_on_cuda(backend, checkpointing):
    """train.compile as training runs it, on CUDA (torch 2.11 on the GPU image): each checkpointed
    layer traced whole with the backend's kernel in its graph (the setup probe finds no graph
    break and no layer run eagerly), every layer run compiled in the training forward and backward,
    packed rows exact in bf16, and rows of other lengths compile nothing new."""
    from torch._dynamo.utils import counters

    from raypack.model import kernels
    from raypack.train.objectives.loss import probe_batch

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = load_model("tiny-llama", attention=backend, dtype="bfloat16", gradient_checkpointing=checkpointing,
                       **SIZES).cuda()  # fmt: skip
    ref = load_model(model.config, attention="eager", dtype=model.dtype).cuda().eval()
    ref.load_state_dict(model.state_dict())
    kernels.compile_layers(model)
    # refuses a graph break and a layer run eagerly; the probe's training forward compiles graphs
    assert kernels.check_compiled(model, move_batch(probe_batch(1024, padded=False), "cuda")) > 0
    model.eval()  # no dropout; the layers alone in training mode, where transformers checkpoints them
    for layer in kernels.decoder_layers(model, "test"):
        layer.training = True
    values, gradients = TOLERANCE[model.dtype]
    with kernels.eager_layers(model) as eager:
        errors = packed_vs_alone(model, ref, lengths=LENGTHS, device="cuda")
    assert not eager, f"layers {sorted(set(eager))} ran eagerly in training: compile compiled nothing for them"
    grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
    assert errors["logits"] < values and errors["loss"] < values, errors
    assert max(grads.values()) < gradients, max(grads.items(), key=lambda kv: kv[1])
    graphs = kernels.compiled_graphs()
    packed_vs_alone(model, ref, lengths=([200, 31, 7], [90]), device="cuda", seed=1)
    assert kernels.compiled_graphs() == graphs, "a new packed length recompiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
