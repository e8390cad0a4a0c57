"""Runs that change size: a run stopped on N workers, resumed on M (`raypack train --resume RUN
train.num_workers=M`), and what a run trained, however often it changed size.

    pos = last_position(root)                     # the last checkpoint's position (rank 0's POSITION file)
    cfg, line = keep_step_size(cfg, pos, ...)     # grad_accum scaled so that a step trains as many packs
    check_resizable(cfg, pos)                     # what can't be resharded: one line before anything runs
    prepared = resized(cfg, prepared, root, ...)  # the epoch's rest planned again for the new ranks
                                                  # (and DeepSpeed's ZeRO state converted for them)
    totals = trained_totals(checkpoint)           # examples and label tokens trained, per epoch

The position a checkpoint holds indexes one plan's packs, and a plan holds its rank count; the
step logs (every rank's `steps_rank<R>.npz`) say which examples the epoch trained, whatever the
plan. So the epoch's rest is planned again for the new ranks (raypack/data/rest.py) and trained
from its first step; later epochs train the new ranks' full plan. The optimizer step keeps its
size (packs a step: data-parallel ranks x grad_accum, whose label tokens the loss is a mean over)
where the new rank count divides it; else the run says what changed. The schedule goes on: its
step count comes back from the checkpoint and its total is the steps done plus the steps left.

Weights and optimizer state: the torch engine's torch.distributed.checkpoint files reshard on
load (DDP's whole tensors and FSDP2's DTensor shards alike). DeepSpeed's ZeRO 1-3 partition the
fp32 master weights and Adam moments by rank count: `resized` converts the checkpoint to
DeepSpeed's universal checkpoint on the driver (raypack/train/engines/universal.py, into
`ds_universal/` beside its `ds/`), which the workers cut again for their count. What that is
tested to reshard exactly (`unconvertible`: ZeRO 1-3, bf16 weights, fp32 master weights, torch's
AdamW, no offload; full or LoRA) goes on;
any other DeepSpeed setting is refused in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from dataclasses import dataclass

import numpy as np

from raypack import runs, storage
from raypack.config import Config
from raypack.data.listing import Sources
from raypack.data.shards import Prepared
from raypack.errors import InputError
from raypack.train.checkpoint import POSITION
from raypack.train.engines import universal


@dataclass(frozen=True)
class Position:
    """Where the run's last checkpoint stands (`TrainState.position`), read on the driver."""

    epoch: int
    micro_step: int
    step: int
    plan: str
    """The fingerprint of the packed data the position indexes."""
    world_size: int
    grad_accum: int
    checkpoint: str
    """Its folder."""


def last_position(root: str) -> Position | None:
    """The position of the run's last registered checkpoint; None with no checkpoint, or one
    written before raypack recorded positions."""
    reported = runs.reported_checkpoints(root)
    if not reported:
        return None
    folder = f"{root}/{reported[-1]['checkpoint_dir_name']}"
    if not storage.exists(f"{folder}/{POSITION}"):
        return None
    return Position(**json.loads(storage.read_text(f"{folder}/{POSITION}")), checkpoint=folder)


def packs_per_step(num_workers: int, grad_accum: int, cfg: Config) -> int:
    return num_workers // cfg.train.sequence_parallel * grad_accum


def keep_step_size(cfg: Config, pos: Position | None, accum_given: bool) -> tuple[Config, str | None]:
    """`cfg` with grad_accum scaled so that an optimizer step trains as many packs as the
    checkpoint's did (2 workers x 2 -> 1 worker x 4), where its worker count divides them, and the
    line saying so; unchanged, with a line saying what changed, where it does not or where
    `accum_given` (train.grad_accum was overridden). No line when the size is the checkpoint's."""
    t = cfg.train
    if pos is None or pos.world_size in (0, t.num_workers):
        return cfg, None
    was = packs_per_step(pos.world_size, pos.grad_accum, cfg)
    head = f"[raypack] resuming on {t.num_workers} worker{'s' if t.num_workers > 1 else ''}, the checkpoint's {pos.world_size}: "
    ranks = packs_per_step(t.num_workers, 1, cfg)
    if not accum_given and was % ranks == 0:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=was // ranks))
        return cfg, (head + f"train.grad_accum {pos.grad_accum} -> {was // ranks}, so an optimizer step still "
                     f"trains {was} packs; the rest of epoch {pos.epoch + 1} is planned again for them")
    now = packs_per_step(t.num_workers, t.grad_accum, cfg)
    why = "as train.grad_accum says" if accum_given else f"{was} packs don't divide over {ranks} ranks"
    return cfg, (head + f"an optimizer step now trains {now} packs instead of {was} ({why}), with "
                 f"train.grad_accum {t.grad_accum}; the rest of epoch {pos.epoch + 1} is planned again for them")


def check_resizable(cfg: Config, pos: Position | None) -> None:
    """Refuse, before anything is prepared, a resume on another worker count whose state can't be
    resharded or whose epoch's rest can't be told from the step logs."""
    from raypack.data.strategies import STRATEGIES

    t = cfg.train
    if pos is None or pos.world_size in (0, t.num_workers):
        return
    where = f"train.num_workers={t.num_workers}: the checkpoint {pos.checkpoint} was taken on {pos.world_size} workers"
    if t.engine == "deepspeed" and (why := unconvertible(cfg)):
        raise InputError(f"{where}, and DeepSpeed's ZeRO state {why} can't be resharded by raypack (its universal "
                         f"checkpoint is tested for ZeRO 1-3 with model.dtype bfloat16, train.precision mixed and "
                         f"torch's AdamW only); resume with train.num_workers={pos.world_size}, or start a new run "
                         "from the exported model (raypack export)")
    if STRATEGIES[cfg.pack.strategy].splits_examples:
        raise InputError(f"{where}, and pack.strategy={cfg.pack.strategy} splits examples across steps, so the step "
                         f"logs can't say which pieces trained; resume with train.num_workers={pos.world_size}")


def unconvertible(cfg: Config) -> str | None:
    """What keeps a DeepSpeed checkpoint of `cfg`'s from going on on another worker count, in a
    few words; None where its universal checkpoint reshards it exactly (tests/unit/train/engines/
    test_universal.py: fp32 master weights and Adam moments bit for bit, ZeRO 1-3, full and LoRA)."""
    t = cfg.train
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if t.use_gpu else "float32")
    if t.zero_stage == 0:  # not tested through a resize (in bf16 the config refuses ZeRO-0 itself)
        return "at train.zero_stage=0"
    if t.offload_optimizer or t.offload_params:
        return "offloaded to the host (train.offload_optimizer, train.offload_params)"
    if t.precision != "mixed" or t.optimizer != "torch":
        return f"with train.precision={t.precision} and train.optimizer={t.optimizer}"
    if dtype != "bfloat16":
        return f"with model.dtype={dtype}"
    if cfg.model.peft.method == "qlora":  # 4-bit base weights: CUDA only, not tested here
        return "with model.peft.method=qlora"
    return None


def epoch_trained(folder: str, epoch: int) -> np.ndarray:
    """The example ids epoch `epoch` trained, from every rank's step log in checkpoint `folder`."""
    out = [z["example_ids"][np.repeat(z["epoch"], np.diff(z["offsets"])) == epoch] for z in _logs(folder)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def resized(cfg: Config, prepared: Prepared, root: str, sources: Sources, *, vocab_size: int | None = None,
            tower=None) -> Prepared:
    """`prepared` (the packed data for `cfg`'s ranks) with the rest of the checkpoint's epoch
    planned again for them, when the run's last checkpoint indexes other packed data: the
    `Prepared.resized` record the workers start that epoch from. `prepared` as it is otherwise."""
    from raypack.data.rest import pack_rest

    pos = last_position(root)
    if pos is None or pos.plan == prepared.fingerprint:
        return prepared
    n = cfg.train.data_parallel
    out = f"{root}/packed_rest"
    trained = epoch_trained(pos.checkpoint, pos.epoch)
    rest = pack_rest(cfg, n, out, sources, pos.epoch, trained, vocab_size=vocab_size, tower=tower)
    print(f"[raypack] epoch {pos.epoch + 1}: {len(trained)} examples trained by step {pos.step}; the other "
          f"{rest['examples']} planned again as {rest['steps_per_rank'] // cfg.train.grad_accum} steps for {n} ranks "
          f"x {cfg.train.grad_accum} (in {out})", flush=True)
    if cfg.train.engine == "deepspeed" and pos.world_size != cfg.train.num_workers:
        converted = universal.convert(pos.checkpoint)
        print(f"[raypack] step {pos.step}'s DeepSpeed ZeRO state, partitioned for {pos.world_size} workers, "
              f"converted for {cfg.train.num_workers} (DeepSpeed's universal checkpoint, in {converted})", flush=True)
    record = {**rest, "epoch": pos.epoch, "step": pos.step, "from": pos.plan}
    key = hashlib.sha256(json.dumps([prepared.fingerprint, pos.plan, pos.step, pos.epoch]).encode()).hexdigest()[:16]
    return dataclasses.replace(prepared, fingerprint=f"{prepared.fingerprint}-rest{key}", resized=record)


def trained_totals(folder: str) -> dict:
    """What the run trained, from the final checkpoint's step logs (every rank's, a resize's
    folded in): {"examples", "label_tokens", "epochs": [{"examples", "label_tokens"}, ...]};
    label tokens are absent from logs written before raypack kept them."""
    epochs: dict[int, list[int]] = {}
    for z in _logs(folder):
        counts = np.diff(z["offsets"])
        labels = z["labels"] if "labels" in z else None
        for i, e in enumerate(z["epoch"].tolist()):
            row = epochs.setdefault(e, [0, 0])
            row[0] += int(counts[i])
            row[1] += int(labels[i]) if labels is not None else 0
    per = [{"examples": epochs[e][0], "label_tokens": epochs[e][1]} for e in sorted(epochs)]
    return {"examples": sum(p["examples"] for p in per), "label_tokens": sum(p["label_tokens"] for p in per),
            "epochs": per}


def _logs(folder: str) -> list[dict[str, np.ndarray]]:
    """Every rank's step log in checkpoint `folder` (a local folder or a URI), as arrays."""
    fs, _ = storage.resolve(folder)
    out = []
    for f in storage.list_files(folder, ".npz"):
        if f.rsplit("/", 1)[-1].startswith("steps_rank"):
            with fs.open_input_file(f) as handle:
                z = np.load(io.BytesIO(handle.read()))
                out.append({k: z[k] for k in z.files})
    return out
