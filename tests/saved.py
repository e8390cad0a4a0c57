"""What autograd keeps for backward, measured: the memory estimate's checks
(tests/unit/train/memory/test_mixers.py, test_vision.py) compare their arithmetic to it."""

from __future__ import annotations

import torch


def saved_bytes(model, fn) -> int:
    """Bytes of the tensors autograd saves while `fn` runs, each storage once, the weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
