"""What a checkpoint holds and how a worker writes and restores it.

    state = restore(engine, rank, data.fingerprint)        # the last reported checkpoint, if any
    report_and_checkpoint(engine, state, metrics, rank, checkpoint=True, final=False)

A checkpoint folder (one `ray.train.Checkpoint`) holds the engine's state under its tag (`ds/`
for DeepSpeed, `torch/` for the torch engine: weights, optimizer, schedule, and the `TrainState`
as its client state; raypack/train/engines/), one step log per rank
(`steps_rank<R>.npz`: the example ids of every optimizer step that rank took, 8 bytes an
example, and its label tokens), rank 0's position (`raypack_position.json`: epoch, micro-step,
step, plan, worker count and grad_accum, which the driver reads to resume on another worker
count, raypack/train/resize.py), and, at the last step, a Hugging Face `model/` folder with the
tokenizer beside it.
With LoRA (`model.peft`) the engine state holds the adapters and their optimizer state only,
not the frozen base weights (they are loaded again from where they came from, and a checksum of
them travels in the TrainState, so a resume onto other base weights is refused); the last
checkpoint holds `adapter/` (peft's format), the merged `model/` and, for a base built from a
config, `base/` (raypack/model/adapters.py, `save_adapted`).
The data position (epoch, micro-step within that epoch's order) and the packed data's
fingerprint travel in the TrainState, so a restarted worker group resumes exactly after the last
checkpointed step, and a resume onto other packed data is refused.

A checkpoint resumes only on the engine that wrote it (each reads only its own layout): a resume
with the other train.engine is refused, naming both.

Offline, on the CPU and without Ray, `read_saved(folder)` reads a checkpoint's engine state
back: the TrainState and the trained weights whole (what `raypack export` writes out).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch

from raypack.errors import InputError
from raypack.model.adapters import is_peft_model, save_adapted
from raypack.train import engines
from raypack.train.engines import Engine
from raypack.train.metrics import Totals


POSITION = "raypack_position.json"
"""Rank 0's `TrainState.position()` beside the engine state, which the driver reads without the engine."""
LOGGED = ("steps_log", "steps_labels")
"""TrainState fields kept per rank in `steps_rank<R>.npz`, not in the engine's client state."""


@dataclass
class TrainState:
    """Where the run is; saved with every checkpoint and restored after a failure."""

    epoch: int = 0
    micro_step: int = 0
    """Micro-steps of this epoch's order already run (a multiple of grad_accum): the position in
    `shards.epoch_order`, not a stored step."""
    step: int = 0
    """Optimizer steps taken so far."""
    plan: str = ""
    """Fingerprint of the packed data this position indexes; a resume onto another plan is refused."""
    steps_log: list[tuple[int, int, list[int]]] = field(default_factory=list)
    """(optimizer step, epoch, example_ids) per step this rank took: what the final model trained on."""
    totals: Totals = field(default_factory=Totals)
    """The running totals the Reporter adds to, so curves and clocks go on after a restart."""
    base_digest: list[int] = field(default_factory=list)
    """With adapters: every rank's checksum of its frozen base weights (`adapters.frozen_digest`)."""
    base_sum: int | None = None
    """With adapters: the checksum of the frozen base weights no sharding changes (the ranks'
    `adapters.frozen_sum`s added up); None in a checkpoint from before it was kept."""
    steps_labels: list[int] = field(default_factory=list)
    """Label tokens of each step in `steps_log` on this rank: what the run's `trained` totals add up."""
    world_size: int = 0
    grad_accum: int = 0
    """The shape the position was taken under (set at every start): a resume on another worker
    count plans the epoch's rest again from the step logs (raypack/train/resize.py)."""

    def to_client_state(self) -> dict[str, Any]:
        """What the engine's checkpoint carries (the step log goes to its own file)."""
        return {k: v for k, v in asdict(self).items() if k not in LOGGED}

    def position(self) -> dict[str, Any]:
        """What the driver reads back before a resume (POSITION), engine-independent."""
        return {k: getattr(self, k) for k in ("epoch", "micro_step", "step", "plan", "world_size", "grad_accum")}

    @classmethod
    def from_client_state(cls, saved: dict[str, Any]) -> TrainState:
        known = {f.name for f in fields(cls)} - {*LOGGED, "totals"}
        return cls(**{k: v for k, v in saved.items() if k in known}, totals=Totals(**saved.get("totals", {})))


def restore(engine: Engine, rank: int, plan: str, base: tuple[list[int], int] | None = None,
            resized: dict[str, Any] | None = None, world_size: int = 1) -> TrainState:
    """Load the last reported checkpoint, if any: weights, optimizer, schedule and data position.
    `base`: with adapters, the checksums of the frozen base weights this run loaded (loop.base_digests).
    `resized`: the packed data's `Prepared.resized`, when the epoch's rest was planned again for
    this run's `world_size` ranks (a resume on another worker count): the position then moves to
    its start, and this rank takes over the step logs of the old ranks r with r % world_size == rank."""
    base_digest, base_sum = base or ([], None)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return TrainState(plan=plan, base_digest=base_digest, base_sum=base_sum)
    with checkpoint.as_directory() as path:
        check_engine(path, engine.name, checkpoint.path)
        # With adapters the checkpoint leaves the frozen base weights out (see the module doc).
        client = engine.load(Path(path), frozen=is_peft_model(engine.module))
        state = TrainState.from_client_state(client)
        moved = resized is not None and state.plan == resized["from"] and state.step == resized["step"]
        logs = sorted(Path(path).glob("steps_rank*.npz"), key=lambda f: int(f.stem.removeprefix("steps_rank")))
        for log in logs:
            r = int(log.stem.removeprefix("steps_rank"))
            if r == rank or (moved and r % world_size == rank):
                entries, labels = read_steps_log(log), read_steps_labels(log)
                state.steps_log += entries
                state.steps_labels += labels
    if moved:
        state.plan, state.epoch, state.micro_step = plan, int(resized["epoch"]), 0
    if state.plan != plan:
        # The position is an index into one plan's packs; on another plan it would skip or
        # repeat examples. Changing data, tokenize or pack needs a new run; another worker count
        # or grad_accum comes with a `resized` record (the driver planned the epoch's rest again).
        raise InputError(
            f"checkpoint {checkpoint.path} was taken on packed data {state.plan or '<unknown>'}, but this run's "
            f"data is {plan}: the data, tokenize or pack config, num_workers or grad_accum changed. "
            "Resume with the original config, or start a new run.name."
        )
    if moved and state.base_sum is None and len(set(state.base_digest)) > 1:
        raise InputError(
            f"checkpoint {checkpoint.path} was taken before raypack kept a checksum of the sharded base weights that "
            f"holds on another worker count, so the base this resume loaded can't be checked against it; resume with "
            f"train.num_workers={len(state.base_digest)}"
        )
    if not same_base(state, base_digest, base_sum, moved):
        raise InputError(
            f"checkpoint {checkpoint.path} trained adapters on other base weights than this run loaded (their "
            "checksums differ): model.name now names other weights, or the base model's init is not reproducible. "
            "Resume with the original base model, or start a new run.name."
        )
    state.base_digest, state.base_sum = list(base_digest), base_sum  # this run's ranks'
    return state


def same_base(saved: TrainState, digests: list[int], total: int | None, resized: bool) -> bool:
    """Whether the checkpoint's ranks held the frozen base weights this run's ranks hold: by their
    checksums (adapters.frozen_digest) rank for rank; on another worker count (`resized`), whose
    ranks cut the shards otherwise, by the checksum no sharding changes (adapters.frozen_sum), or,
    in a checkpoint from before it was kept, where every rank held them whole (one checksum, repeated)."""
    if saved.base_digest == digests:
        return True
    if not resized:
        return False
    if saved.base_sum is not None:
        return saved.base_sum == total
    return len(set(saved.base_digest)) == 1 and set(saved.base_digest) == set(digests)


def check_engine(path: str | Path, engine: str, where: str) -> None:
    """Refuse a checkpoint another train.engine wrote: each engine reads only its own layout."""
    saved = engines.saved_by(path)
    if saved is not None and saved != engine:
        raise InputError(f"checkpoint {where} was written by train.engine {saved}, but this run trains with "
                         f"train.engine {engine}, which can't read it; resume with train.engine: {saved}, or start "
                         "a new run.name (or export the checkpoint and train from the exported model/)")


def report_and_checkpoint(
    engine: Engine, state: TrainState, metrics: dict, rank: int, checkpoint: bool, final: bool, tokenizer=None,
    merge: bool = True, trust_remote_code: bool = False,
) -> None:
    """Report `metrics`, with a checkpoint if due; the final one also holds a Hugging Face
    `model/` folder (with `tokenizer`, when given, so AutoTokenizer loads from it too), and with
    adapters `adapter/` (`model/` only if `merge`)."""
    if not checkpoint:
        ray.train.report(metrics)
        return
    adapters = is_peft_model(engine.module)
    with tempfile.TemporaryDirectory(prefix="raypack-ckpt-") as path:
        engine.save(Path(path), state.to_client_state(), frozen=adapters)
        write_steps_log(Path(path) / f"steps_rank{rank}.npz", state.steps_log, state.steps_labels)
        if rank == 0:
            (Path(path) / POSITION).write_text(json.dumps(state.position()))
        if final:
            state_dict = engine.full_state_dict()
            if rank == 0 and adapters:
                save_adapted(engine.module, state_dict, path, merge=merge, tokenizer=tokenizer,
                             trust_remote_code=trust_remote_code)
            elif rank == 0:
                save_hf_model(engine.module, state_dict, Path(path) / "model", tokenizer)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(path))


def write_steps_log(path: Path, log: list[tuple[int, int, list[int]]], labels: list[int] | None = None) -> None:
    """The step log as flat arrays (8 bytes an example), not JSON: it is rewritten every checkpoint.
    `labels`: each step's label tokens on this rank (absent from logs written before they were kept)."""
    ids = [np.asarray(example_ids, dtype=np.int64) for _, _, example_ids in log]
    np.savez(
        path,
        **({"labels": np.asarray(labels, dtype=np.int64)} if labels is not None and len(labels) == len(log) else {}),
        step=np.array([s for s, _, _ in log], dtype=np.int64),
        epoch=np.array([e for _, e, _ in log], dtype=np.int64),
        offsets=np.cumsum([0] + [len(i) for i in ids]),
        example_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
    )


def read_steps_log(path: Path) -> list[tuple[int, int, list[int]]]:
    if not path.exists():
        return []
    z = np.load(path)
    o = z["offsets"]
    return [(int(s), int(e), z["example_ids"][o[i]:o[i + 1]].tolist()) for i, (s, e) in enumerate(zip(z["step"], z["epoch"]))]


def read_steps_labels(path: Path) -> list[int]:
    """Each logged step's label tokens on that rank; [] for a log that has none."""
    if not path.exists():
        return []
    z = np.load(path)
    return z["labels"].tolist() if "labels" in z.files else []


def save_hf_model(model, state: dict, path: Path, tokenizer=None) -> None:
    """A plain Hugging Face folder next to the DeepSpeed state, loadable with from_pretrained:
    the model, and the tokenizer it was trained with."""
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) == 1 and (saved := floats.pop()) != model.dtype:
        # The torch engine trains fp32 master weights and saves them in the dtype it computed in;
        # transformers writes the module's own dtype into config.json, which from_pretrained
        # ("auto") would load the weights in.
        config = json.loads((Path(path) / "config.json").read_text())
        config["dtype"] = str(saved).removeprefix("torch.")
        (Path(path) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


# --- reading a checkpoint back, offline ----------------------------------------------------------


@dataclass
class Saved:
    """What one checkpoint's engine state holds, read on the CPU (`read_saved`)."""

    state: TrainState
    engine: str
    """The train.engine that wrote it."""
    zero_stage: int
    world_size: int
    dtype: torch.dtype
    """The dtype the model trained in (DeepSpeed's bf16/fp16 setting, the torch engine's compute dtype)."""
    weights: dict[str, torch.Tensor]
    """The trained weights, whole: fp32 master weights under DeepSpeed's ZeRO 1-3 and the torch
    engine's precision mixed; under ZeRO-0 (no master copy outside the optimizer) the module's own,
    in `dtype`. With adapters, those alone."""

    @property
    def layout(self) -> str:
        """How each rank held the frozen weights (adapters.expected_digests)."""
        return digest_layout(self.engine, self.zero_stage)


def digest_layout(engine: str, zero_stage: int) -> str:
    """`replicated`, DeepSpeed's `zero3` flat partitions, or FSDP2's `fsdp` dim-0 shards."""
    if engine == "torch":
        return "fsdp" if zero_stage > 0 else "replicated"
    return "zero3" if zero_stage == 3 else "replicated"


def read_saved(folder: str | Path, adapters: bool) -> Saved:
    """The engine state of the checkpoint in `folder` (local), its weights put together from every
    rank's shard by the engine's own reader (DeepSpeed's `zero_to_fp32`, torch.distributed.checkpoint).
    `adapters`: the run trained adapters, so the frozen base weights are not in it."""
    saved = engines.read_offline(folder, adapters)
    return Saved(TrainState.from_client_state(saved.state), saved.engine, saved.zero_stage, saved.world_size,
                 saved.dtype, saved.weights)
