"""`train_loop_per_worker`: what every Ray Train worker runs.

    setup  ──> restore ──> for each optimizer step: train_step ──> [evaluate] ──> report_and_checkpoint

Each worker reads only its own rank's packs, in plan order, from the folder the driver wrote.
The data position (epoch, micro-step) travels in every checkpoint, so a restarted worker group
resumes exactly after the last checkpointed step: the steps lost with a failure are redone, and
no example is skipped or trained twice by the final model.

Loss: one optimizer step's loss is Σ token losses / N, where N counts the label tokens of all its
micro-batches on all ranks. DeepSpeed divides each backward by the accumulation steps and averages
gradients over ranks, so each micro-batch's summed loss is scaled by world·accum/N to undo both.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import deepspeed
import numpy as np
import ray.train
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.integrations import HfDeepSpeedConfig

from raypack.config import Config
from raypack.data.collate import collate_packed, count_label_tokens, move_batch
from raypack.data.shards import Prepared, iter_rank_packs
from raypack.model.build import load_model, resolve_dtype
from raypack.train.engine import deepspeed_config, setup_engine
from raypack.train.metrics import Reporter, model_flops_per_token

CKPT_TAG = "ds"  # one fixed DeepSpeed tag: every Ray checkpoint folder holds exactly one


@dataclass
class TrainState:
    """Where the run is; saved with every checkpoint and restored after a failure."""

    epoch: int = 0
    micro_step: int = 0
    """Next plan step to run in this epoch (a multiple of grad_accum)."""
    step: int = 0
    """Optimizer steps taken so far."""
    plan: str = ""
    """Fingerprint of the packed data this position indexes; a resume onto another plan is refused."""
    steps_log: list[tuple[int, int, list[int]]] = field(default_factory=list)
    """(optimizer step, epoch, example_ids) per step this rank took: what the final model trained on."""
    tokens_seen: float = 0.0
    train_time_s: float = 0.0
    eval_time_s: float = 0.0
    """The Reporter's cumulative counts at the checkpoint, so curves and clocks go on after a restart."""


# --- setup --------------------------------------------------------------------------------------


def setup(cfg: Config, data: Prepared, world_size: int):
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    dtype = resolve_dtype(m.dtype)
    zero3 = None
    if cfg.train.zero_stage == 3:
        # While this object lives, transformers builds the model under deepspeed.zero.Init, so
        # each rank materializes only its partition instead of the whole model (8 x 140 GB for 70B).
        deepspeed.init_distributed()  # joins Ray Train's process group; the config checks world size
        zero3 = HfDeepSpeedConfig(deepspeed_config(cfg.train, dtype=dtype, world_size=world_size))
    model = load_model(
        m.name,
        # Padded batches carry an attention_mask, which the model's own SDPA handles; packed rows
        # need a varlen attention. The packed data knows which it is.
        attention="sdpa" if data.padded else m.attention,
        dtype=dtype,
        trust_remote_code=m.trust_remote_code,
        gradient_checkpointing=m.gradient_checkpointing,
        vocab_size=data.vocab_size,
    )
    steps_per_epoch = data.steps_per_rank // cfg.train.grad_accum
    total = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    engine, scheduler = setup_engine(model, cfg.train, dtype=model.dtype, world_size=world_size, total_steps=total)
    del zero3
    return engine, scheduler, total


def restore(engine, rank: int, plan: str) -> TrainState:
    """Load the last reported checkpoint, if any: weights, optimizer, schedule and data position."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return TrainState(plan=plan)
    with checkpoint.as_directory() as path:
        _, client = engine.load_checkpoint(path, tag=CKPT_TAG)
        state = TrainState(**{k: v for k, v in client["train_state"].items() if k != "steps_log"})
        state.steps_log = read_steps_log(Path(path) / f"steps_rank{rank}.npz")
    if state.plan != plan:
        # The position is an index into one plan's packs; on another plan it would skip or
        # repeat examples. Changing data, tokenize, pack, ranks or grad_accum needs a new run.
        raise RuntimeError(
            f"checkpoint {checkpoint.path} was taken on packed data {state.plan or '<unknown>'}, but this run's "
            f"data is {plan}: the data, tokenize or pack config, num_workers or grad_accum changed. "
            "Resume with the original config, or start a new run.name."
        )
    return state


# --- one optimizer step -----------------------------------------------------------------------


def next_group(rows: Iterator[dict], accum: int) -> list[dict]:
    return list(itertools.islice(rows, accum))


def global_count(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's `values` in one all_gather: a [world, len(values)] tensor to sum or max."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy over label tokens, predicting token t+1 from position t."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def forward_backward(engine, batches: list[dict], scale: float) -> torch.Tensor:
    """Backward every micro-batch of one optimizer step; the caller runs the final engine.step()."""
    total = torch.zeros((), device=engine.device)
    for i, batch in enumerate(batches):
        # move_batch keeps cu_seq_lens_q and _k one tensor; two copies would cost a device
        # comparison (a sync) in every attention layer.
        batch = move_batch(batch, engine.device)
        labels = batch.pop("labels")
        loss_sum = token_loss_sum(engine(**batch).logits, labels)
        engine.backward(loss_sum * scale)
        total += loss_sum.detach()
        if i < len(batches) - 1:
            engine.step()  # a no-op for the weights until the accumulation boundary
    return total


def train_step(engine, group: list[dict], padded: bool, pad_token_id: int, read_s: float = 0.0) -> dict[str, float]:
    t0 = time.perf_counter()
    batches = [collate_packed([row], padded=padded, pad_token_id=pad_token_id) for row in group]
    labels = sum(count_label_tokens(b) for b in batches)
    tokens = sum(int(row["num_tokens"]) for row in group)
    wait = read_s + time.perf_counter() - t0
    world = dist.get_world_size()
    # The one host sync before compute: every rank needs N, the step's global label count.
    n_global = float(global_count([labels], engine.device)[:, 0].sum())
    scale = world * len(batches) / max(n_global, 1.0)
    t1 = time.perf_counter()
    loss_sum = forward_backward(engine, batches, scale)
    engine.step()
    loss_value = float(loss_sum)  # waits for the device, so `busy` covers the real compute
    busy = time.perf_counter() - t1
    stats = global_count([loss_value, tokens, busy], engine.device)
    return {
        "loss": float(stats[:, 0].sum()) / max(n_global, 1.0),
        "label_tokens": n_global,
        "tokens": float(stats[:, 1].sum()),
        "step_time_s": read_s + time.perf_counter() - t0,
        "data_wait_s": wait,
        "rank_imbalance": float(stats[:, 2].max() / stats[:, 2].mean().clamp_min(1e-9)),
        "world_size": world,
    }


@torch.no_grad()
def evaluate(engine, data: Prepared, rank: int) -> float | None:
    """Token-mean loss over the held-out packs of every rank."""
    if not data.eval_dir:
        return None
    engine.eval()
    loss, labels = torch.zeros((), dtype=torch.float64, device=engine.device), 0
    for row in iter_rank_packs(data.eval_dir, rank):
        batch = collate_packed([row], padded=data.padded, pad_token_id=data.pad_token_id)
        labels += count_label_tokens(batch)
        batch = move_batch(batch, engine.device)
        target = batch.pop("labels")
        loss += token_loss_sum(engine(**batch).logits, target)  # no sync per batch
    engine.train()
    total = global_count([float(loss), labels], engine.device).sum(0)
    return float(total[0] / total[1].clamp_min(1))


# --- report and checkpoint -----------------------------------------------------------------------


def report_and_checkpoint(engine, state: TrainState, metrics: dict, rank: int, checkpoint: bool, final: bool) -> None:
    if not checkpoint:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raypack-ckpt-") as path:
        client = {"train_state": {k: v for k, v in asdict(state).items() if k != "steps_log"}}
        engine.save_checkpoint(path, tag=CKPT_TAG, client_state=client)
        write_steps_log(Path(path) / f"steps_rank{rank}.npz", state.steps_log)
        if final:
            save_hf_model(engine, Path(path) / "model", rank)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(path))


def write_steps_log(path: Path, log: list[tuple[int, int, list[int]]]) -> None:
    """The step log as flat arrays (8 bytes an example), not JSON: it is rewritten every checkpoint."""
    ids = [np.asarray(example_ids, dtype=np.int64) for _, _, example_ids in log]
    np.savez(
        path,
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


def save_hf_model(engine, path: Path, rank: int) -> None:
    """A plain Hugging Face folder next to the DeepSpeed state, loadable with from_pretrained."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # a collective: every rank calls it
    else:
        state = engine.module.state_dict()
    if rank == 0:
        engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)


# --- the loop -------------------------------------------------------------------------------------


def train_loop_per_worker(config: dict) -> None:
    cfg = Config.from_dict(config["cfg"])
    data = Prepared.from_dict(config["data"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    engine, scheduler, total_steps = setup(cfg, data, world)
    state = restore(engine, rank, data.fingerprint)
    model_config = engine.module.config
    reporter = Reporter(
        rank=rank,
        total_steps=total_steps,
        report_every=cfg.train.report_every_steps,
        static={
            **data.report_stats(),
            "total_steps": total_steps,
            "steps_per_epoch": data.steps_per_rank // cfg.train.grad_accum,
        },
        tb_dir=config.get("tensorboard_dir") if cfg.train.tensorboard else None,
        mlflow_uri=(os.environ.get("MLFLOW_TRACKING_URI") or config.get("mlflow_uri")) if cfg.train.mlflow else None,
        run_name=cfg.run.name,
        # From the config, not the parameters: under ZeRO-3 each rank holds only a partition.
        flops_per_token=model_flops_per_token(model_config, data.length_sq_mean, data.length_mean),
    )
    reporter.resume_from(state.step, state.tokens_seen, state.train_time_s, state.eval_time_s)
    accum = cfg.train.grad_accum

    for epoch in range(state.epoch, cfg.train.epochs):
        if epoch != state.epoch:
            state.epoch, state.micro_step = epoch, 0
        rows = iter_rank_packs(data.train_dir, rank, start_step=state.micro_step)
        # The plan gives every rank the same multiple of `accum` steps, so a short group is the epoch end.
        while state.step < total_steps:
            t0 = time.perf_counter()
            if len(group := next_group(rows, accum)) < accum:
                break
            values = train_step(engine, group, data.padded, data.pad_token_id, read_s=time.perf_counter() - t0)
            values["lr"] = scheduler.get_last_lr()[0]
            state.step += 1
            state.micro_step += accum
            state.steps_log.append((state.step, epoch, [i for row in group for i in row["example_ids"]]))
            reporter.log_step(state.step, values)

            final = state.step == total_steps
            ckpt_due = final or _every(state.step, cfg.train.checkpoint_every_steps)
            eval_due = final or _every(state.step, cfg.train.eval_every_steps)
            if ckpt_due or eval_due or reporter.due(state.step):
                t_eval = time.perf_counter()
                extra = {"eval_loss": evaluate(engine, data, rank)} if eval_due else {}
                reporter.exclude(time.perf_counter() - t_eval)
                metrics = reporter.summary(state.step, epoch, extra)
                state.tokens_seen, state.train_time_s, state.eval_time_s = (
                    reporter.tokens_seen, reporter.train_time_s, reporter.eval_time_s)
                report_and_checkpoint(engine, state, metrics, rank, checkpoint=ckpt_due, final=final)
        if state.step >= total_steps:
            break
        if state.micro_step != data.steps_per_rank:
            # Every rank must run the plan's steps; fewer means a shard is missing or unreadable
            # from this node (e.g. a node-local storage_path on a multi-node cluster).
            raise RuntimeError(
                f"rank {rank} read {state.micro_step} of {data.steps_per_rank} packs from "
                f"{data.train_dir}/rank={rank}; is run.storage_path shared by every node?"
            )
    reporter.close()


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
