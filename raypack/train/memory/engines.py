"""What each engine keeps per GPU for the weights, gradients and optimizer state: the estimate's
(raypack/train/memory/estimate.py) engine-specific terms. Arithmetic, not a measurement.

P parameters, P_t of them trained, N ranks, c the compute dtype's bytes (2 for bf16, 4 for fp32).

DeepSpeed (train.engine: deepspeed): the model's own weights in bf16, 2 P, whole on
every GPU under ZeRO 0-2; under ZeRO-3 a 1/N shard plus the gathered working set (the larger of the
embedding and two layers, capped by the preset's stage3_max_live_parameters). Gradients 2 P_t,
sharded 1/N for ZeRO >= 2, plus one reduce bucket (the preset's reduce_bucket_size). Optimizer:
fp32 master + m + v = 12 B per trained parameter (precision mixed) or bf16 master + m + v + Kahan
= 8 B (bf16), sharded 1/N; on the host with offload (16 B with the fp32 gradients).

The torch engine (train.engine: torch) keeps its master weights in the model itself:
- stored weights: fp32 (4 B) for precision mixed, bf16 (2 B) for bf16; with LoRA the frozen base
  in the compute dtype and only the trained weights in fp32. Whole on every GPU at zero_stage 0,
  1/S under FSDP2 (1-3), S the ranks a shard group holds: N, or under HSDP (several nodes) the
  ranks of one node, which the worker counts (`shard_ranks`; `raypack plan` can't, and says N).
- the forward's copy in the compute dtype, c P, where the stored dtype is another (mixed on a GPU):
  under DDP autocast's cache of the casts (whole, kept through the backward); under FSDP2 the
  gathered weights: every layer's from its forward to its backward without resharding (1-2), at
  zero_stage 3 the root (embeddings, norm, head) and two layers (one computing, one prefetched).
  FSDP2 gathers into new buffers even where the dtypes agree, so the copy is counted there too.
- gradients in the stored dtype, P_t whole under DDP (its buckets are the gradients:
  gradient_as_bucket_view), 1/S under FSDP2 plus one layer's unsharded gradients in flight; at
  zero_stage 1-2 with grad_accum > 1, the micro-batches before the step's last accumulate every
  layer's unsharded gradients (FSDP2 keeps them in its reduce dtype, fp32 under mixed: the stored
  dtype) until the last one reduce-scatters them, so P_t whole as well.
- optimizer: m + v, 8 B per trained parameter (mixed) or m + v + Kahan in bf16, 6 B (bf16),
  sharded 1/S under FSDP2; CPUOffloadPolicy moves the shards of weights, gradients and optimizer
  state to the host together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from raypack.config import Config

OPTIMIZER_BYTES = {"mixed": 12, "bf16": 8}
"""DeepSpeed, per trained parameter, by train.precision: fp32 master + m + v; bf16 master + m + v + Kahan."""
MOMENT_BYTES = {"mixed": 8, "bf16": 6}
"""The torch engine, per trained parameter: fp32 m + v; bf16 m + v + Kahan (the weights are the master)."""


@dataclass(frozen=True)
class State:
    """Bytes per GPU (and per rank on its host) of the weights, gradients and optimizer state."""

    weights: float
    grads: float
    optimizer: float
    host: float = 0.0


def compute_bytes(cfg: Config) -> int:
    """Bytes of one element in the dtype the forward computes in on a GPU: bf16 (model.dtype auto's
    choice there), or fp32 where model.dtype says float32."""
    return 4 if cfg.model.dtype == "float32" and cfg.train.precision == "mixed" else 2


def engine_state(cfg: Config, arch: Any, trained: float, zero: Mapping[str, Any], base_weights: float | None,
                 shard_ranks: int | None = None) -> State:
    """The engine's weights, gradients and optimizer state for `cfg` on `arch`, `trained` of its
    parameters trained. `zero`: the DeepSpeed preset's ZeRO section; `base_weights`: QLoRA's
    quantized base weights' bytes (None: not QLoRA); `shard_ranks`: the ranks FSDP2 shards over
    (None: all of them; `shard_ranks_of`)."""
    if cfg.train.engine == "torch":
        return torch_state(cfg, arch, trained, base_weights, shard_ranks)
    return deepspeed_state(cfg, arch, trained, zero, base_weights)


def deepspeed_state(cfg: Config, arch: Any, trained: float, zero: Mapping[str, Any], base_weights: float | None) -> State:
    t, n, p = cfg.train, cfg.train.num_workers, arch.params
    c = 2  # the module's weights and gradients in bf16, as DeepSpeed's bf16 setting keeps them on a GPU
    if base_weights is not None:  # ZeRO 0-2 (the config refuses 3): whole on every GPU
        weights = base_weights
    elif t.zero_stage < 3:
        weights = c * p
    else:
        live = min(zero.get("stage3_max_live_parameters", p), max(arch.vocab * arch.hidden, 2 * arch.layer_params))
        weights = c * p / n + c * live
    if cfg.model.peft.enabled:  # the adapters and modules_to_save copies are weights beside the frozen ones
        weights += c * trained / (n if t.zero_stage == 3 else 1)
    bucket = c * zero.get("reduce_bucket_size", 0)
    grads = bucket if t.offload_optimizer else c * trained / (n if t.zero_stage >= 2 else 1) + bucket
    optimizer = 0.0 if t.offload_optimizer else OPTIMIZER_BYTES[t.precision] * trained / n
    host = 16 * trained / n if t.offload_optimizer else 0.0
    return State(weights, grads, optimizer, host)


def shard_ranks_of(workers: int, ranks_here: int) -> int:
    """The ranks FSDP2 shards over, from this worker's view: one node's where the workers fill
    several nodes equally (HSDP: fsdp.mesh_shape, which also needs them in node order; where they
    aren't, the flat mesh shards over all, and this smaller group overestimates, the safe side)."""
    return ranks_here if 0 < ranks_here < workers and workers % ranks_here == 0 else workers


def torch_state(cfg: Config, arch: Any, trained: float, base_weights: float | None,
                shard_ranks: int | None = None) -> State:
    t, n, p = cfg.train, cfg.train.num_workers, arch.params
    c = compute_bytes(cfg)
    adapters = cfg.model.peft.enabled
    stored = 2 if t.precision == "bf16" else 4  # the trained weights' dtype: the master copy
    frozen = p - trained if adapters else 0.0
    base = c * frozen if base_weights is None else base_weights  # LoRA's base: the compute dtype (or NF4)
    shards = (shard_ranks or n) if t.zero_stage > 0 else 1
    at_rest = (base + stored * trained) / shards
    root = arch.vocab * arch.hidden * (1 if arch.tied else 2)
    if t.zero_stage == 0:  # autocast's cached casts of the trained weights, where the dtypes differ
        gathered = c * trained if stored != c else 0.0
    elif t.zero_stage < 3:
        gathered = c * p
    else:
        gathered = c * min(p, root + 2 * arch.layer_params)
    unit = arch.layer_params * (trained / p if p else 0.0)  # one layer's trained weights
    # stages 1-2: the step's unsharded gradients, accumulated until its last micro-batch (module doc)
    accumulated = stored * trained if 0 < t.zero_stage < 3 and t.grad_accum > 1 else 0.0
    grads = stored * (trained / shards + (unit if t.zero_stage > 0 else 0.0)) + accumulated
    optimizer = MOMENT_BYTES[t.precision] * trained / shards
    if t.offload_optimizer or t.offload_params:  # CPUOffloadPolicy: the shards live on the host
        host = at_rest + stored * trained / shards + optimizer
        return State(gathered, stored * unit + accumulated, 0.0, host)
    return State(at_rest + gathered, grads, optimizer)
