"""What torch.autocast leaves in fp32 under the torch engine's `precision: mixed`, cast as autocast
casts a matmul.

Unsharded (DDP, or the bare model on one rank), the torch engine keeps the trained weights in
fp32, the master copy, and runs the forward under `torch.autocast(bf16)`, which casts the inputs
of the ops it has a rule for. It has none for grouped matmuls (`torch._grouped_mm`,
`F.grouped_mm`: pytorch#174763), and transformers' grouped experts (integrations/moe.py
`_grouped_mm`, every MoE family's default experts path in transformers 5) cast the input to the
weight's dtype instead: the experts, most of an MoE's FLOPs, multiplied fp32 weights in fp32, on a
GPU too (benchmarks/fp32_matmuls.py found it). FSDP2 casts the gathered weights itself and
DeepSpeed's model is bf16, so only this path needs it.

    cast_grouped_experts()   # once, before the forward; idempotent

Under autocast the input and the weights go to autocast's dtype, as autocast does for `mm`: the
weight's cast is differentiable, so its gradient reaches the fp32 master weight in fp32. Outside
autocast nothing changes.
"""

from __future__ import annotations

import functools

import torch


def cast_grouped_experts() -> bool:
    """Wrap transformers' grouped-experts matmul with autocast's cast; False where this
    transformers has no such function (its experts run through ops autocast covers)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    original = getattr(moe, "_grouped_mm", None)
    if original is None:
        return False
    if getattr(original, "raypack_autocast", False):
        return True

    @functools.wraps(original)
    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            input, weight = input.to(dtype), weight.to(dtype)
        return original(input, weight, offs=offs)

    grouped_mm.raypack_autocast = True
    moe._grouped_mm = grouped_mm  # _grouped_linear looks it up in the module at each call
    return True
