"""`train_loop_per_worker`: what every Ray Train worker runs, in named phases.

    setup_worker (engine, loss probe, restore, reporter)
      └─ for each epoch: train_epoch
           └─ for each optimizer step: step.train_step ──> after_step: [evaluate] ──> report_and_checkpoint

Each worker reads only its own rank's packs from the folder the driver wrote, in the order of the
current epoch (raypack/data/shards.py: the plan's order in epoch 1, a seeded reorder of whole
optimizer steps after). The data position (epoch, micro-step within that epoch's order) travels
in every checkpoint (raypack/train/checkpoint.py), so a restarted worker group resumes exactly
after the last checkpointed step: the steps lost with a failure are redone, and no example is
skipped or trained twice in an epoch by the final model.

Loss: one step of either objective, SFT's token mean or DPO's pair mean, with an MoE model's
router loss riding it: raypack/train/step.py (the scaling that keeps it exact over micro-batches,
ranks and accumulation, and the skipped step without a label token). The token losses come from
raypack/train/objectives/loss.py (chunked: no [tokens, vocab] logits), the pairs' from raypack/train/objectives/dpo.py.

Stopping: SIGTERM or Ctrl-C to the driver, or a node of the run being preempted, is agreed on by
every rank before a step starts, each rank's vote riding the step's own host all_gather of its
label tokens (no collective of its own), so all of them stop after the same step, with a
checkpoint when the last one is old (raypack/train/stop.py).

Data: a background thread reads, collates and pins the next step's micro-batches while this one
computes (raypack/train/prefetch.py). The step never waits for the device: N is a host number
(summed over the ranks on the host), and the step's loss, gradient norm and device time are read
after the next step is enqueued (raypack/train/stepvalues.py), or before a report or checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from raypack.config import Config
from raypack.data.encode import load_image_processor, load_tokenizer
from raypack.data.image_layouts import processor_settings
from raypack.data.shards import Prepared, iter_epoch_packs, iter_rank_packs, rank_images
from raypack.model.adapters import apply_adapters, frozen_digest, frozen_sum, quantization_config, trainable_summary
from raypack.model.build import load_model, model_config
from raypack.model.facts import describe
from raypack.model.checkpointing import check_selective
from raypack.model.kernels import apply_kernels, check_compiled, compile_layers, compiled_graphs, tile_mlps
from raypack.model.ulysses import SequenceGroup, sequence_parallel
from raypack.model import mixers
from raypack.model.traits import decoder
from raypack.model.vision import ProcessorParts, freeze, trains_as_vlm
from raypack.train import engines
from raypack.train.engines import Engine
from raypack.train.handoff import receive
from raypack.train.checkpoint import TrainState, report_and_checkpoint, restore
from raypack.train.objectives.dpo import DPOLoss, reporter_fields
from raypack.train.objectives.dpo_reference import make_dpo_loss
from raypack.train.objectives.loss import CausalLMLoss, make_loss, probe_batch
from raypack.train.memory.auto import resolve_checkpointing
from raypack.train.objectives.expert_load import ExpertLoad
from raypack.train.metrics import Eta, Reporter, model_flops_per_token
from raypack.train.prefetch import StepBatch, prepare_step, to_device
from raypack.train.objectives.router_loss import RouterLoss, make_router_loss
from raypack.train.sequence import data_rank, make_groups, probe_split, step_source
from raypack.train.startup import Startup
from raypack.train.step import train_step
from raypack.train.stepvalues import HostCounts, Pending
from raypack.train.stop import StopWatch
from raypack.train.tracking import Trackers, TrackingTargets
from raypack.train.vision_rows import VisionRows

# --- setup --------------------------------------------------------------------------------------


def setup(cfg: Config, data: Prepared, world_size: int, clock: Startup | None = None, rank: int = 0,
          local_ranks: int = 1):
    clock = clock or Startup()
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    compute = engines.compute_dtype(cfg.train, m.dtype)
    dtype = engines.weights_dtype(cfg.train, m.dtype, adapters=m.peft.enabled)
    # the model described once (raypack/model/facts.py): the estimate and the build read it
    facts = describe(model_config(m.name, m.trust_remote_code, data.vocab_size), m.trust_remote_code)
    mode, why = resolve_checkpointing(cfg, "cuda" if cfg.train.use_gpu else "cpu", local_ranks,
                                      patches=data.stats.get("widest_patches"), facts=facts)
    if rank == 0:
        print(f"[raypack] gradient checkpointing: {mode} ({why})", flush=True)
    # Under ZeRO-3 (zero.Init) and FSDP2 (the meta device on ranks > 0) no rank's GPU holds the
    # whole model at any time (8 x 140 GB for 70B otherwise): engines.building. Not a tiny model
    # built from a config under DeepSpeed: zero.Init initialises it module by module, gathered,
    # drawing other numbers from train.seed than a plain build, so ZeRO-3 trained from another
    # start than ZeRO 0-2, the torch engine and export's rebuild of it. Built whole on every rank
    # (it is tiny), it is partitioned by deepspeed.initialize instead.
    whole = cfg.train.engine == "deepspeed" and m.name.startswith("tiny-")
    with contextlib.nullcontext() if whole else engines.building(cfg.train, dtype=compute, world_size=world_size):
        model = load_model(
            m.name,
            # Padded batches carry an attention_mask, which the model's own SDPA handles; packed rows
            # need a varlen attention. The packed data knows which it is.
            attention="sdpa" if data.padded else m.attention,
            dtype=dtype,
            trust_remote_code=m.trust_remote_code,
            gradient_checkpointing=mode,
            vocab_size=data.vocab_size,
            quantization=quantization_config(compute) if m.peft.method == "qlora" else None,
            facts=facts,
        )
    if rank == 0 and not data.padded and (found := mixers.find(decoder(model))):
        device_type = "cuda" if cfg.train.use_gpu else "cpu"
        print(f"[raypack] token mixers besides attention: {mixers.describe(found, device_type)}", flush=True)
    if m.freeze:  # a VLM's tower and/or projector (preflight refused it for a model without them)
        frozen = freeze(model, m.freeze)
        if rank == 0:
            print(f"[raypack] model.freeze: {', '.join(m.freeze)} ({len(frozen)} weights) frozen", flush=True)
    # before adapters wrap its modules
    apply_kernels(model, m.kernels, "cuda" if cfg.train.use_gpu else "cpu", compiled=cfg.train.compile)
    if m.peft.enabled:
        # The adapters' random init (and every draw after it) from train.seed alone, not from what
        # building the base left of the generator: ZeRO-3's zero.Init initialises the base another
        # way (gathered, on rank 0) than a plain build, and a loaded checkpoint draws nothing, so
        # without this ZeRO-3 trained other adapters than ZeRO 0-2 and the torch engine.
        torch.manual_seed(cfg.train.seed)
        model = apply_adapters(model, m.peft, m.name)
    if m.tiled_mlp_tokens:
        tile_mlps(model, m.tiled_mlp_tokens)
    if cfg.train.compile:
        compile_layers(model)  # compiled at the first use: seconds, once per layer class
    total = data.total_steps(cfg.train.grad_accum, cfg.train.epochs, cfg.train.max_steps)
    clock.mark("model")
    engine = engines.build(model, cfg.train, dtype=compute, world_size=world_size, total_steps=total)
    clock.mark("engine")
    return engine, total


# --- one optimizer step -----------------------------------------------------------------------


def global_count(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's `values` in one all_gather: a [world, len(values)] float64 tensor on `device`
    to sum or max. For evaluation, once an eval: a step's counts go over the host (stepvalues.py)."""
    local = torch.tensor(values, dtype=torch.float64)
    if torch.device(device).type == "cuda":
        local = local.pin_memory().to(device, non_blocking=True)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered)


def base_digests(engine) -> tuple[list[int], int]:
    """Every rank's checksum of its frozen weights, in rank order, and the checksum of them all
    that no sharding changes (the ranks' `frozen_sum`s added up): the same on every rank."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (frozen_digest(engine.module), frozen_sum(engine.module)))
    return [digest for digest, _ in parts], sum(part for _, part in parts) % (1 << 64)


@torch.no_grad()
def evaluate(engine, data: Prepared, group: SequenceGroup, loss: CausalLMLoss, collate=prepare_step) -> dict:
    """{"eval_loss": the token-mean loss over the held-out packs of every rank (of every group's
    shards)}, None without them; a mixture's (`data.eval_sources`) each source's too, as
    `eval_<name>_loss` (Hugging Face Trainer's name for a dict of eval sets): its eval steps hold its
    examples alone. `collate`: prefetch.prepare_step, or a VLM run's (the worker's `collate`)."""
    if not data.eval_dir:
        return {"eval_loss": None}
    engine.eval()
    names = [s["name"] for s in data.eval_sources]
    total, labels = torch.zeros((), dtype=torch.float64, device=engine.device), 0
    per = torch.zeros(2 * len(names), dtype=torch.float64, device=engine.device)  # loss sums, label tokens
    rows = functools.partial(iter_rank_packs, data.eval_dir, data_rank(dist.get_rank(), group.size))
    with _steps(data, engine.device, group, rows, 1, collate) as steps:
        for i, step in enumerate(steps):
            value = loss(engine, to_device(step.batches[0], engine.device))  # no sync per batch
            labels += step.label_tokens
            total += value
            if names:
                k = names.index(data.eval_source(i))
                per[2 * k] += value
                per[2 * k + 1] += step.label_tokens
    engine.train()
    summed = global_count([float(total), labels, *per.tolist()], engine.device).sum(0)
    out = {"eval_loss": float(summed[0] / summed[1].clamp_min(1))}
    out.update({f"eval_{n}_loss": float(summed[2 + 2 * k] / summed[3 + 2 * k]) for k, n in enumerate(names)
                if summed[3 + 2 * k] > 0})
    return out


def _steps(data: Prepared, device: torch.device, group: SequenceGroup, rows, accum: int, collate=prepare_step):
    """This rank's steps of `rows()` (a group's first rank reads and shares them, sequence.py);
    `collate`: prefetch.prepare_step, or DPO's (whole pairs and their reference)."""
    pin = device.type == "cuda"

    def prepare(rows: list[dict]) -> StepBatch:
        # Shards are pinned where they land, after the scatter.
        return collate(rows, padded=data.padded, pad_token_id=data.pad_token_id, pin=pin and group.size == 1)

    return step_source(group, rows, accum, prepare, data.pad_token_id, pin)


# --- the loop -------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One worker's run: what every phase below reads, and the state it advances."""

    cfg: Config
    data: Prepared
    rank: int
    engine: Engine
    loss: CausalLMLoss
    state: TrainState
    reporter: Reporter
    total_steps: int
    config: dict[str, Any]
    """The train_loop_config the worker was started with."""
    group: SequenceGroup = SequenceGroup(size=1, rank=0)
    """The ranks that share this rank's rows (train.sequence_parallel; a group of one without)."""
    router: RouterLoss | None = None
    """An MoE model's router load-balancing loss (raypack/train/objectives/router_loss.py); None: off."""
    tokenizer: Any = None
    """Rank 0's tokenizer, saved with the final model (loaded at setup, not in the step loop)."""
    counts: HostCounts = HostCounts(world=1)
    """The step's host numbers summed over the ranks (raypack/train/stepvalues.py)."""
    pending: Pending | None = None
    """The last step enqueued whose values are not read yet (read a step late)."""
    clock: Startup = field(default_factory=Startup)
    """This start-up's marks, the driver's and this worker's (raypack/train/startup.py)."""
    stop: StopWatch = field(default_factory=StopWatch)
    """Whether the run stops early (a signal to the driver, a node's preemption): raypack/train/stop.py."""
    collate: Any = prepare_step
    """Rows -> a step's micro-batches: prefetch.prepare_step, with a VLM run's images (`vision_rows`)."""

    @property
    def data_rank(self) -> int:
        """Whose packed rows this rank trains: its group's."""
        return data_rank(self.rank, self.group.size)


def train_loop_per_worker(config: dict) -> None:
    w = setup_worker(config)
    with sequence_parallel(w.group):  # attention splits rows over the group from here on
        for epoch in range(w.state.epoch, w.cfg.train.epochs):
            train_epoch(w, epoch)
            if w.state.step >= w.total_steps or w.stop.agreed:
                break
            check_epoch_read(w, epoch)
    w.reporter.close()
    w.stop.finish(w.state.step)


def setup_worker(config: dict) -> Worker:
    """Build the engine, probe the loss, restore the last checkpoint and start the clocks."""
    cfg = Config.from_dict(config["cfg"])
    data = Prepared.from_dict(receive(config))  # waits while the driver prepares it (train.overlap_start)
    clock = Startup(dict(config.get("startup", {})))
    clock.mark("received")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    engine, total_steps = setup(cfg, data, world, clock, rank, ctx.get_local_world_size())
    host_counts = HostCounts.open(world, engine.device)
    # Probes the model once (a short forward on every rank): a model the chunked loss can't
    # reproduce exactly stops here, before any step.
    loss = make_loss(engine, cfg.train.loss, cfg.train.loss_chunk_tokens, padded=data.padded)
    probe = to_device(probe_batch(loss.vocab, data.padded), engine.device)
    _, changed = check_selective(engine.module, probe, cfg.model.gradient_checkpointing)
    if changed and rank == 0:
        print(f"[raypack] gradient checkpointing: full ({changed})", flush=True)
    if cfg.train.compile:  # a layer that can't compile whole, recompute included, stops here
        check_compiled(engine.module, probe)
    router = setup_router(engine, cfg, probe)
    group = make_groups(cfg.train.sequence_parallel)
    images = vision_rows(engine.module, cfg, data, data_rank(rank, group.size))
    if cfg.train.objective == "dpo":  # its reference log-probabilities: before a checkpoint is restored
        loss = make_dpo_loss(engine, loss, cfg, data, rank, global_count, collate=images)
        loss.router = router  # after the reference pass, which needs no router loss
    base = base_digests(engine) if cfg.model.peft.enabled else None
    state = restore(engine, rank, data.fingerprint, base, resized=data.resized, world_size=world)
    state.world_size, state.grad_accum = world, cfg.train.grad_accum  # the shape its checkpoints are taken under
    counts = trainable_summary(engine.module)
    t = cfg.train
    reporter = Reporter(
        rank=rank,
        total_steps=total_steps,
        report_every=t.report_every_steps,
        static=_epoch_static(data, state.epoch, total_steps, world if t.elastic else 0),  # renewed each epoch
        trackers=Trackers.open(TrackingTargets(**config["tracking"]), cfg.run.name, cfg.to_dict(), rank),
        # From the config, not the parameters: under ZeRO-3 each rank holds only a partition.
        flops_per_token=model_flops_per_token(engine.module.config, data.length_sq_mean, data.length_mean,
                                              counts["trainable_params"] if base else None),
        totals=state.totals,
        epochs=t.epochs,
        eta=Eta(total_steps, t.eval_every_steps, t.checkpoint_every_steps),
        gather=host_counts.gather if world > 1 else None,
        experts=ExpertLoad(router.layers, router.experts) if router is not None else None,
        **(reporter_fields() if isinstance(loss, DPOLoss) else {}),
    )
    reporter.start_clocks()
    if base and rank == 0:
        print(f"[raypack] {cfg.model.peft.method}: training {counts['trainable_params']:,} adapter parameters of "
              f"{counts['total_params']:,} ({counts['trainable_params'] / counts['total_params']:.2%}); the base is frozen",
              flush=True)
    tokenizer = load_tokenizer(cfg.tokenize.tokenizer, cfg.tokenize.chat_template) if rank == 0 else None
    if tokenizer is not None and trains_as_vlm(engine.module.config):  # the final model/ gets its image processor too
        tokenizer = ProcessorParts(tokenizer, load_image_processor(cfg.tokenize.tokenizer),
                                   processor_settings(cfg.tokenize.tokenizer))
    if router is not None and rank == 0:
        print(f"[raypack] router load-balancing loss: {router.describe()}", flush=True)
    probe_split(engine, group, loss)  # a model that can't split its rows stops here, before any step
    if rank == 0 and group.size > 1:
        print(f"[raypack] sequence parallel: {world} workers in {world // group.size} groups of {group.size}; each "
              f"row's tokens split {group.size} ways, at most {-(-cfg.pack.budget // group.size)} a worker", flush=True)
    collate = prepare_step if images is None else functools.partial(prepare_step, collate=images)
    clock.mark("setup")
    return Worker(cfg, data, rank, engine, loss, state, reporter, total_steps, config, group, router,
                  tokenizer, host_counts, clock=clock, stop=StopWatch(config.get("stop_key"), rank, t.stop_checkpoint_after_s,
                                                           checkpoint_step=state.step), collate=collate)


def vision_rows(model, cfg: Config, data: Prepared, rank: int) -> VisionRows | None:
    """A VLM's collate: each example's images (this rank's, looked up by example id) and
    positions beside its tokens (raypack/train/vision_rows.py), for prepare_step and for DPO's
    pairs; None for a text model."""
    if not trains_as_vlm(model.config):
        return None
    return VisionRows(model, rank_images(data, rank), cfg.tokenize.tokenizer)


def setup_router(engine, cfg: Config, probe: dict[str, Any]) -> RouterLoss | None:
    """The router loss of an MoE model (None: a dense model, or a coefficient of 0), or a refusal
    before any step (router_loss.check_router_setting; a router not found)."""
    probe = {k: v for k, v in probe.items() if k != "labels"}
    router = make_router_loss(engine.module, cfg.train, cfg.model.name, probe)
    if router is not None:
        router.probe(engine, probe, cfg.model.name)
    return router


def train_epoch(w: Worker, epoch: int) -> None:
    """Train epoch `epoch` from the state's position in it, up to the run's last step."""
    state, accum = w.state, w.cfg.train.grad_accum
    if epoch != state.epoch:
        state.epoch, state.micro_step = epoch, 0
    # per-epoch plans have their own balance
    w.reporter.static = _epoch_static(w.data, epoch, w.total_steps, w.state.world_size if w.cfg.train.elastic else 0)
    rows = functools.partial(iter_epoch_packs, w.data, w.data_rank, epoch, start_step=state.micro_step)
    # The plan gives every rank the same multiple of `accum` steps, so a short group is the epoch end.
    dpo = isinstance(w.loss, DPOLoss)
    collate = w.loss.prepare_step if dpo else functools.partial(
        w.collate, router_scope=w.router.scope if w.router is not None else None)
    with _steps(w.data, w.engine.device, w.group, rows, accum, collate) as steps:
        while state.step < w.total_steps:
            t0 = time.perf_counter()
            if (step := next(steps, None)) is None:
                break
            if not take_step(w, step, epoch, time.perf_counter() - t0):  # asked to stop: after the last step
                stop_here(w, epoch)
                return
            after_step(w, epoch)


def take_step(w: Worker, step, epoch: int, wait_s: float) -> bool:
    """The loop's optimizer step on `step`, prefetched micro-batches (waited for `wait_s`): its
    host numbers and the ranks' stop votes in one gather, then forward, backward and update
    enqueued, the previous step's values read. False, with no step taken, when the ranks agree to
    stop after the last one. What every step of a run costs: benchmarks/step_syncs.py counts this."""
    state = w.state
    offload = w.cfg.model.offload_checkpoints
    pending = train_step(w.engine, step, w.loss, w.counts, state.step + 1, wait_s=wait_s, offload=offload, stop=w.stop,
                         router=w.router)  # SFT's and DPO's alike: raypack/train/step.py
    if pending is None:
        return False
    pending.host["lr"] = w.engine.scheduler.get_last_lr()[0]
    if w.cfg.train.compile:  # graphs Dynamo compiled so far: a count that grows is recompiling
        pending.host["compiled_graphs"] = float(compiled_graphs())
    if pending.host["skipped_steps"] and w.rank == 0:
        print(f"[raypack] step {state.step + 1}: no rank has a label token; skipped (no update)", flush=True)
    state.step += 1
    state.micro_step += w.cfg.train.grad_accum
    state.steps_log.append((state.step, epoch, step.example_ids))
    state.steps_labels.append(int(getattr(step, "label_tokens", 0)))
    # The previous step's values: read now, with this step enqueued behind it.
    log_pending(w)
    w.pending = pending
    if "first_step" not in w.clock.marks:  # this start's first step: read at once, once
        log_pending(w)
        w.clock.mark("first_step")
        if w.rank == 0:
            print(f"[raypack] start-up: {w.clock.line()}", flush=True)
    return True


def log_pending(w: Worker) -> None:
    """Read the last enqueued step's values (waiting for it on the device) and log them."""
    if w.pending is not None:
        pending, w.pending = w.pending, None
        w.reporter.log_step(pending.step, pending.resolve())


def stop_here(w: Worker, epoch: int) -> None:
    """Every rank agreed to stop after this step: report, with a checkpoint if one is wanted."""
    log_pending(w)
    if w.stop.checkpoint:
        t_ckpt, m, step = time.perf_counter(), w.cfg.model, w.state.step
        # the steps since the last report, or, when it was this step's, the step alone
        metrics = w.reporter.summary(step, epoch) if w.reporter.unreported else {"step": step, "epoch": epoch}
        report_and_checkpoint(w.engine, w.state, metrics, w.rank, checkpoint=True, final=False, merge=m.peft.merge,
                              trust_remote_code=m.trust_remote_code)
        w.stop.checkpointed(time.perf_counter() - t_ckpt, w.state.step)


def after_step(w: Worker, epoch: int) -> None:
    """Evaluate, report and checkpoint, each when it is due (all of them at the last step)."""
    t, step = w.cfg.train, w.state.step
    final = step == w.total_steps
    ckpt_due = (final and t.save_final) or _every(step, t.checkpoint_every_steps)
    eval_due = final or _every(step, t.eval_every_steps)
    if not (ckpt_due or eval_due or w.reporter.due(step)):
        return
    # Every step of the window is read before a report, and before a checkpoint saves weights
    # that a diverged step would have updated (stepvalues.DivergedError).
    log_pending(w)
    extra = {}
    if eval_due:
        t_eval = time.perf_counter()
        if isinstance(w.loss, DPOLoss):  # eval_loss and TRL's eval_rewards/...
            extra.update(w.loss.evaluate(w.engine, w.data, w.data_rank))
        else:
            extra.update(evaluate(w.engine, w.data, w.group, w.loss, w.collate))
        w.reporter.exclude(time.perf_counter() - t_eval)
    metrics = w.reporter.summary(step, epoch, extra)
    if final:  # after the trackers had theirs: a dict of phases, not a scalar
        metrics["startup_s"] = w.clock.phases()
    if final and w.state.base_digest and base_digests(w.engine) != (w.state.base_digest, w.state.base_sum):
        raise RuntimeError("the frozen base weights changed during training: an optimizer or hook wrote to them")
    m = w.cfg.model
    t_ckpt = time.perf_counter()
    report_and_checkpoint(w.engine, w.state, metrics, w.rank, checkpoint=ckpt_due, final=final,
                          tokenizer=w.tokenizer if final else None, merge=m.peft.merge,
                          trust_remote_code=m.trust_remote_code)
    if ckpt_due:
        w.reporter.checkpointed(time.perf_counter() - t_ckpt)
        w.stop.checkpointed(time.perf_counter() - t_ckpt, step)
    else:
        w.reporter.reported(time.perf_counter() - t_ckpt)


def check_epoch_read(w: Worker, epoch: int) -> None:
    """Every rank must run the plan's steps; fewer means a shard is missing or unreadable from
    this node (e.g. a node-local storage_path on a multi-node cluster)."""
    folder, epoch_steps, _ = w.data.epoch_rows(epoch)
    if w.state.micro_step != epoch_steps:
        raise RuntimeError(
            f"rank {w.rank} read {w.state.micro_step} of {epoch_steps} packs from "
            f"{folder}/rank={w.data_rank}; is run.storage_path shared by every node?"
        )


def _epoch_static(data: Prepared, epoch: int, total_steps: int, workers: int = 0) -> dict[str, float]:
    """What every report of this epoch carries besides the step's values; `workers`: an elastic
    run's worker count, whose curve in the trackers steps where the run changed size."""
    _, epoch_steps, _ = data.epoch_rows(epoch)
    return {**data.report_stats(epoch), "total_steps": total_steps, "steps_per_epoch": epoch_steps // data.grad_accum,
            **({"workers": workers} if workers else {})}


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
