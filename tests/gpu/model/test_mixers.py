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
