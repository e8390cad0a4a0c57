"""`model.gradient_checkpointing: auto`: each worker takes the fastest mode whose memory estimate
(raypack/train/memory/estimate.py) fits its device.

    mode, why = resolve_checkpointing(cfg, "cuda", ranks_here=1)   # on a worker, no weights

What a worker plans with (`choose_checkpointing`): its device's memory less CONTEXT_BYTES, less
AUTO_MARGIN of it for what the arithmetic misses; a shape the arithmetic can't size leaves `auto`
at full, saying why. The margin is a guess until a GPU run checks the estimate against measured peaks
(tests/gpu/train/test_memory.py, benchmarks/recompute.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from raypack.config import Config
from raypack.train.memory.engines import shard_ranks_of
from raypack.train.memory.estimate import CHECKPOINTING, GB, Arch, estimate

if TYPE_CHECKING:
    from raypack.model.facts import ModelFacts

AUTO_MARGIN = 0.10
"""Share of the device's memory (after CONTEXT_BYTES) that `auto` leaves unplanned."""
CONTEXT_BYTES = 4 * GB
"""What the estimate doesn't count on a GPU: CUDA context, NCCL buffers, fragmentation (~3-5 GB)."""


def usable_bytes(capacity: float, device_type: str) -> float:
    """What `auto` plans with on a device of `capacity` bytes (module doc)."""
    return (capacity - (CONTEXT_BYTES if device_type == "cuda" else 0)) * (1 - AUTO_MARGIN)


def choose_checkpointing(cfg: Config, arch: Arch, capacity: float, device_type: str = "cuda",
                         selective: bool = True, padded: tuple[int, int] | None = None,
                         patches: int | None = None, shard_ranks: int | None = None) -> tuple[str, str]:
    """model.gradient_checkpointing as a worker with `capacity` bytes of device memory runs it:
    the configured mode, or for `auto` the fastest of CHECKPOINTING whose estimate fits
    `usable_bytes` (full where none does: the smallest, and the run may still fit). Returns the
    mode and one line saying why. `selective`: whether this run may use it at all."""
    m = cfg.model
    if m.gradient_checkpointing != "auto":
        return m.gradient_checkpointing, "as configured"
    # selective is refused with tiled MLPs (they drop what it keeps) and under DeepSpeed's ZeRO-3 (config/__init__.py)
    zero3 = cfg.train.zero_stage == 3 and cfg.train.engine == "deepspeed"
    selective = selective and not (m.tiled_mlp_tokens or zero3)
    modes = [c for c in CHECKPOINTING if selective or c != "selective"]
    usable, unit = usable_bytes(capacity, device_type), GB
    sizes = {c: estimate(cfg, arch, checkpointing=c, padded=padded, patches=patches, shard_ranks=shard_ranks).total
             for c in modes}
    fits = [c for c in modes if sizes[c] <= usable]
    chosen = fits[0] if fits else "full"
    told = ", ".join(f"{c} {sizes[c] / unit:.1f} GB" for c in modes)
    room = (f"{usable / unit:.1f} GB usable of the {device_type} device's {capacity / unit:.1f} GB (less "
            f"{'CUDA context ' + format(CONTEXT_BYTES / unit, '.0f') + ' GB, ' if device_type == 'cuda' else ''}"
            f"{AUTO_MARGIN:.0%} margin)")
    why = (f"the fastest that fits: {told} estimated, {room}" if fits
           else f"no mode fits: {told} estimated, {room}; full needs least")
    return chosen, why


def device_bytes(device_type: str, ranks_here: int = 1) -> float:
    """Memory one rank can plan with: its GPU's, or on the CPU the host's shared by its `ranks_here` ranks."""
    if device_type == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_here, 1)


def resolve_checkpointing(cfg: Config, device_type: str, ranks_here: int = 1, patches: int | None = None,
                          facts: ModelFacts | None = None) -> tuple[str, str]:
    """`choose_checkpointing` on this worker: its device's memory, its model's shape from its
    description (`facts`, default the model's config described: no weights). A shape the
    arithmetic can't size leaves auto at full, saying why. Where the kernels rule selective out
    (kernels.check_selective_with), it is refused or left out."""
    from raypack.model.build import model_config  # transformers: only on a worker
    from raypack.model.facts import describe
    from raypack.model.kernels import check_selective_with, resolve_kernels

    m = cfg.model
    facts = facts or describe(model_config(m.name, m.trust_remote_code), m.trust_remote_code)
    kernels = resolve_kernels(m.kernels, facts.model_type, device_type, compiled=cfg.train.compile)
    selective = check_selective_with(kernels, cfg.train.compile, m.gradient_checkpointing)
    if m.gradient_checkpointing != "auto":
        return m.gradient_checkpointing, "as configured"
    try:
        arch = Arch.from_facts(facts)
        # FSDP2 shards within a node where the workers fill several (HSDP): the larger share
        shard_ranks = shard_ranks_of(cfg.train.num_workers, ranks_here)
        return choose_checkpointing(cfg, arch, device_bytes(device_type, ranks_here), device_type, selective,
                                    patches=patches, shard_ranks=shard_ranks)
    except (AttributeError, TypeError, ValueError) as e:  # a config without a Llama-like shape
        return "full", f"the memory estimate can't size this model ({e}); full needs least"
