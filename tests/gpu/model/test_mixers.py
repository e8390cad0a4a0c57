"""Hybrid layers on CUDA (raypack/model/mixers.py): packed rows against each example alone in
bf16, through whichever path runs here: the varlen kernels where their packages are installed
(flash-linear-attention and causal-conv1d for the gated delta rule and KDA, mamba-ssm and
causal-conv1d for Mamba-2, causal-conv1d for the short convolution), else the exact torch path. The path is
printed, so a run's log says which one it checked.

Marked `gpu` (skipped without CUDA). Not yet run on a GPU: written without one at hand.
"""

from __future__ import annotations

import pytest
import torch
from exactness import packed_vs_alone

from raypack.model import mixers
from raypack.model.build import load_model, tiny_config
from raypack.model.traits import decoder

pytestmark = pytest.mark.gpu

LENGTHS = ([300, 41, 1, 150], [500, 77])
"""Examples longer than a chunk of the scans (64), one of a single token."""
SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512)
MLA = {"kimi_linear": dict(num_key_value_heads=8, head_dim=None)}
"""Kimi-Linear's attention is MLA: as many key-value heads as query heads, its own head sizes."""


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "lfm2", "kimi_linear"])
def test_hybrid_packed_rows_match_examples_alone_on_cuda(family):
    torch.manual_seed(0)
    config = tiny_config(family, **{**SIZES, **MLA.get(family, {})})
    model = load_model(config, attention="auto", dtype="bfloat16").cuda().eval()
    ref = load_model(config, attention="eager", dtype="bfloat16").cuda().eval()
    ref.load_state_dict(model.state_dict())
    found = mixers.find(decoder(model))
    print(f"{family}: {mixers.describe(found, 'cuda')}")
    errors = packed_vs_alone(model, ref, lengths=LENGTHS, device="cuda")
    grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
    # bf16: the kernels and the examples alone round differently (the attention GPU tests' bounds)
    assert grads and errors["logits"] < 2e-2 and max(grads.values()) < 5e-2, errors


def test_the_installed_kernels_take_their_boundaries():
    """Where a mixer's kernel packages import here, each function transformers binds names the
    keyword that keeps examples apart (mixer_kernels.problem), so the kernels path runs: a
    signature the check misreads would send every GPU run down the slower torch path."""
    installed = [kind for kind in mixers.KINDS if all(mixers._PACKAGES[p] for p in kind.packages)]
    if not installed:
        pytest.skip("no mixer's kernel packages are installed")
    for kind in installed:
        assert mixers.kernels_problem(kind) is None, (kind.name, mixers.kernels_problem(kind))
        assert mixers.path(kind, "cuda") == "kernels"


def test_the_torch_path_neither_reads_nor_waits_for_the_device():
    """The torch path's per-batch work (raypack/model/mixers.py: `_segments`, `_buckets`) reads the
    host copy of the boundaries and copies its index from pinned memory: under torch's sync
    debug mode set to error, no synchronizing CUDA call."""
    from raypack.model.exact import keep_host_copy

    host = torch.tensor([0, 300, 341, 342, 492], dtype=torch.int32)
    cu = host.cuda()
    keep_host_copy(cu, host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        shapes, index = mixers._buckets(cu, 492, cu.device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert shapes == ((1, 1), (1, 41), (1, 150), (1, 300)) and index.device.type == "cuda" and index.numel() == 492


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "zamba2"])
def test_lora_on_out_proj_trains_through_mamba_kernels(family):
    """mamba-ssm installed: a Mamba-2 layer whose out_proj carries a LoRA adapter is kept off the
    fused kernel (which reads out_proj.weight itself); packed against each example alone in bf16
    with the adapters on, and out_proj's adapter gets a gradient."""
    if not all(mixers._PACKAGES[p] for p in mixers.KINDS[1].packages):
        pytest.skip("mamba-ssm and causal-conv1d are not both installed")
    from families import FAMILIES

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters

    torch.manual_seed(0)
    config = FAMILIES[family].build_config(family)
    cfg = PeftConfig(method="lora", r=4, alpha=8, dropout=0.0, target_modules=("in_proj", "out_proj"))
    model = apply_adapters(load_model(config, attention="auto", dtype="bfloat16"), cfg).cuda()
    ref = apply_adapters(load_model(config, attention="eager", dtype="bfloat16"), cfg).cuda()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)  # lora_B away from zero, so every adapter weight gets a gradient
    ref.load_state_dict(model.state_dict())
    model.train(), ref.train()  # training mode: where transformers would take the fused kernel
    errors = packed_vs_alone(model, ref, lengths=LENGTHS, device="cuda")
    grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
    assert any("out_proj.lora_B" in k for k in grads), sorted(grads)
    assert errors["logits"] < 2e-2 and max(grads.values()) < 5e-2, errors
