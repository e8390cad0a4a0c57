"""Sequence-parallel against one rank, in real processes: `world` gloo ranks split into groups of
N, every group training the same packed rows with each rank holding 1/N of their tokens
(raypack/model/ulysses.py, collate.shard_batch). Per family, the loss summed over the group and
every gradient all-reduced over it must equal one rank's run on the whole rows (which
tests/unit/model/test_families.py shows equals each example run alone).

    errors = run(world=4, sizes=(2, 4), families=[...], lora=False)   # {f"{family}/{N}": {what: rel err}}
"""

from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from exactness import make_rows, random_lora_b, rel_err
from families import FAMILIES

from raypack.config import PeftConfig
from raypack.data.collate import collate_packed, shard_batch
from raypack.model.adapters import apply_adapters
from raypack.model.build import load_model
from raypack.model.kernels import decoder_layers
from raypack.model.ulysses import SequenceGroup, sequence_parallel
from raypack.train.objectives.loss import label_targets

LENGTHS = ([21, 6], [13, 1, 9], [4, 30])
"""Rows of 27, 23 and 34 tokens: every N in (2, 4) cuts an example and pads the row."""
LORA = PeftConfig(method="lora", r=4, alpha=8, target_modules=("all-linear",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(family: str, lora: bool, checkpointing: str = "none"):
    torch.manual_seed(0)
    model = load_model(FAMILIES[family].build_config(family), attention="sdpa_varlen", dtype="float32",
                       gradient_checkpointing=checkpointing)  # fmt: skip
    if lora:
        model = random_lora_b(apply_adapters(model, LORA))
    model.eval()
    for layer in decoder_layers(model, "test"):  # transformers checkpoints a layer in training mode only
        layer.training = checkpointing != "none"
    return model


def _loss(model, batch) -> torch.Tensor:
    """Σ cross-entropy at the batch's loss positions (what the chunked loss computes, from logits)."""
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_positions", "loss_targets")}
    logits = model(**kwargs).logits.reshape(-1, model.config.vocab_size)
    return F.cross_entropy(logits[batch["loss_positions"]].float(), batch["loss_targets"], reduction="sum")


def _compare(model, batches, group: SequenceGroup) -> dict[str, float]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    with sequence_parallel(group):  # the backward too: checkpointed layers recompute their attention in it
        loss = sum(_loss(model, shard_batch(b, group.size, pad_token_id=2)[group.rank]) for b in batches)
        loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group.process_group)
    sharded = {}
    for name, p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group.process_group)
        sharded[name] = grad.clone()
    model.zero_grad(set_to_none=True)
    whole = sum(_loss(model, b) for b in batches)  # one rank, the whole rows
    whole.backward()
    errors = {"loss": rel_err(loss, whole.detach())}
    floor = 1e-3 * max(p.grad.abs().max().item() for _, p in params if p.grad is not None)
    for name, p in params:
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        errors[f"grad:{name}"] = (sharded[name] - ref).abs().max().item() / max(ref.abs().max().item(), floor)
    return errors


def _worker(rank: int, world: int, port: int, sizes, families, lora: bool, out: str, checkpointing: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {}
    for n in sizes:
        for first in range(0, world, n):
            pg = dist.new_group(list(range(first, first + n)))
            if first <= rank < first + n:
                groups[n] = SequenceGroup(size=n, rank=rank - first, process_group=pg)
    rows, _ = make_rows(LENGTHS, vocab=512)
    batches = []
    for row in rows:
        batch = collate_packed([row])
        batch.update(label_targets(batch["labels"]))
        batches.append(batch)
    results = {}
    for family in families:
        model = _model(family, lora, checkpointing)
        for n in sizes:
            try:
                results[f"{family}/{n}"] = _compare(model, copy.deepcopy(batches), groups[n])
            except Exception as e:  # reported, not raised: the other ranks would wait for ever
                results[f"{family}/{n}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
                dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def run(world: int, sizes, families, lora: bool = False, checkpointing: str = "none") -> dict[str, dict]:
    """Each family's rows split over each size's groups against one rank's whole rows: relative
    errors per key `family/size`. `checkpointing`: the layers' model.gradient_checkpointing."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "errors.json")
        mp.spawn(_worker, args=(world, _free_port(), tuple(sizes), list(families), lora, out, checkpointing),
                 nprocs=world)
        return json.loads(Path(out).read_text())
