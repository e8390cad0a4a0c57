"""DPO's reference log-probabilities: computed once, before training, by a pass over the packed rows
with the frozen starting model, and kept beside them (`dpo.reference: precomputed`, the default).

    reference = precomputed(engine, loss, cfg, data, rank, gather)   # every rank, at setup, before restore

    <packed root>/reference/<key>/rank=R.parquet   example_id, logp: every sequence of rank R's
                                                   train and eval rows (Σ log p of its completion)
    <packed root>/reference/<key>/manifest.json    written last: the entry is complete

The key hashes the packed data's fingerprint and the reference model's identity: model.name, its
dtype, attention and kernels, the device type, and a checksum of the starting weights of every
rank (under ZeRO-3, each rank's partition), read before any step. With LoRA the reference is the
base with the adapters off, and the checksum is the base's. A resumed run, a restarted worker
group or a sweep trial over the same packed data and model finds the entry and reads it; a
changed model (other weights, another dtype) gets its own. No second model is held: the pass
runs the model being trained, before its first update (under LoRA, with the adapters off).

With LoRA the reference can also be taken on the fly (`dpo.reference: on_the_fly`): one no-grad
forward of each micro-batch with the adapters off, every epoch and every evaluation, instead of
one pass up front: the same work over one epoch, more after. benchmarks/dpo.py times both (the
CPU runs: precomputed faster from 0.7-1.7 epochs on; docs/guides/dpo.md), so `auto` precomputes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from raypack import storage
from raypack.config import Config
from raypack.data.shards import Prepared, iter_rank_packs
from raypack.model.adapters import is_peft_model, weights_digest
from raypack.train.objectives.dpo import DPOLoss, pair_batch
from raypack.train.prefetch import to_device

MANIFEST = "manifest.json"


def reference_key(data: Prepared, cfg: Config, device_type: str, digests: list[int]) -> str:
    """Hash of the packed data and of the reference model's identity (see the module docstring)."""
    m = cfg.model
    model = {"name": m.name, "dtype": m.dtype, "attention": m.attention, "kernels": m.kernels,
             "tiled_mlp_tokens": m.tiled_mlp_tokens, "trust_remote_code": m.trust_remote_code,
             "device": device_type, "loss": cfg.train.loss, "weights": digests}
    blob = json.dumps({"data": data.fingerprint, "model": model}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_digest(model: torch.nn.Module) -> int:
    """This rank's checksum of the reference's weights: LoRA's frozen base, else every weight."""
    return weights_digest(model, frozen_only=is_peft_model(model))


@torch.no_grad()
def rows_logps(loss: DPOLoss, forward, rows, padded: bool, pad_token_id: int, device) -> dict[int, float]:
    """{example_id: Σ log p of its completion} for every sequence of `rows` (one forward a row, an
    empty pack's too: under ZeRO-3 every rank must run as many forwards as the others)."""
    out: dict[int, float] = {}
    for row in rows:
        batch = to_device(pair_batch(row, padded, pad_token_id, loss.collate), device)
        batch.pop("completion_tokens")
        sequence = batch.pop("sequence")
        _, sums = loss.objective(forward, batch, sequence, len(row["example_ids"]), lambda s: s.sum())
        out.update(zip(row["example_ids"], sums.double().cpu().tolist()))
    return out


def precomputed(engine, loss: DPOLoss, cfg: Config, data: Prepared, rank: int) -> dict[int, float]:
    """This rank's reference log-probabilities, read from their entry or computed now (every rank
    calls it together, before the first step and before a checkpoint is restored)."""
    module = engine.module
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, reference_digest(module))
    folder = f"{data.root}/reference/{reference_key(data, cfg, engine.device.type, digests)}"
    # one answer for every rank, which all run the pass or none (on the engine's device: NCCL takes no host tensor)
    found = torch.tensor([float(storage.exists(f"{folder}/{MANIFEST}"))], device=engine.device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    path = f"{folder}/rank={rank}.parquet"
    if found.item():
        if rank == 0:
            print(f"[raypack] dpo: reusing the reference log-probabilities in {folder}", flush=True)
        return _read(path)
    t0 = time.perf_counter()
    adapters = is_peft_model(module)
    was_training = module.training
    module.eval()  # the reference is the model as it starts, without dropout
    try:
        with module.disable_adapter() if adapters else contextlib.nullcontext():
            logps = {}
            for folder_rows in (data.train_dir, data.eval_dir):
                if folder_rows:
                    logps.update(rows_logps(loss, engine, iter_rank_packs(folder_rows, rank), data.padded,
                                            data.pad_token_id, engine.device))
    finally:
        module.train(was_training)
    _write(path, logps)
    dist.barrier()
    if rank == 0:
        storage.write_text(f"{folder}/{MANIFEST}", json.dumps({"model": cfg.model.name, "ranks": len(digests),
                                                               "seconds": time.perf_counter() - t0}))
        print(f"[raypack] dpo: reference log-probabilities of {len(logps):,} sequences a rank computed in "
              f"{time.perf_counter() - t0:.1f} s ({folder})", flush=True)
    return logps


def _write(path: str, logps: dict[int, float]) -> None:
    table = pa.table({"example_id": pa.array(list(logps), pa.int64()),
                      "logp": pa.array(list(logps.values()), pa.float64())})
    fs, p = storage.resolve(path)
    fs.create_dir(p.rsplit("/", 1)[0], recursive=True)
    pq.write_table(table, p, filesystem=fs)


def _read(path: str) -> dict[int, float]:
    fs, p = storage.resolve(path)
    table = pq.read_table(p, filesystem=fs)
    return dict(zip(table["example_id"].to_pylist(), table["logp"].to_pylist()))


def make_dpo_loss(engine, base, cfg: Config, data: Prepared, rank: int, gather, collate=None) -> DPOLoss:
    """The DPO objective of a run, on `base` (the setup-probed CausalLMLoss): its reference
    precomputed (read, or computed now, before the first step), or with `dpo.reference:
    on_the_fly` taken per micro-batch with LoRA's adapters off. Every rank calls it at setup.
    `collate`: a VLM's VisionRows (dpo.pair_batch)."""
    module = engine.module
    adapters_off = module.disable_adapter if is_peft_model(module) else None
    loss = DPOLoss(base, cfg.dpo, gather, adapters_off=adapters_off, collate=collate)
    if cfg.dpo.reference == "on_the_fly":
        return loss
    return DPOLoss(base, cfg.dpo, gather, reference=precomputed(engine, loss, cfg, data, rank), collate=collate)
