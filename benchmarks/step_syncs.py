"""What a train step makes the host wait for, before and after issue 35's lean step, side by side
in one run: collectives, host reads of tensor values and explicit synchronizes, per optimizer
step, by where they come from (raypack, DeepSpeed, ...); and on a GPU, tokens/s and the
synchronizing CUDA calls torch's sync debug mode reports.

    PYTHONPATH=. python benchmarks/step_syncs.py             # one GPU: ~1.2B Llama, 16k-token rows, bf16
                                                             # no GPU: tiny Llama, bf16, counts only
    PYTHONPATH=. python benchmarks/step_syncs.py --smoke     # 3 measured steps: proves the script runs

One rank (world 1) in this process, and with --world 2 (the default for --smoke) two ranks spawned
over gloo on the CPU, each running the same steps:

- `before`: the step as raypack ran it up to issue 35 (`baseline_step` below: N gathered over the
  default group and read, a device sync, the loss and times gathered and read), on DeepSpeed's
  settings of then (its bf16 overflow check and synchronized throughput timer on, the preset's
  overlap_comm on one rank, its own clipping, which reads the norm's validity on the host);
- `after`: raypack's step as its loop runs it (raypack/train/loop.py's `take_step`: the ranks'
  stop votes, `train_step`, the previous step's values read a step late through
  raypack/train/stepvalues.py) on raypack's DeepSpeed config (raypack/train/engines/deepspeed_engine.py).

Both run DeepSpeed ZeRO-2 with torch AdamW, the chunked loss, gradient clipping at 1.0, one
packed row per step. `SyncCounter` counts in the main thread (the prefetcher's host work is not
the step's): every c10d collective torch dispatches, every read of a tensor's value on the host
(`.item()`, `float()`, `bool()`: aten._local_scalar_dense; `.tolist()`, `.cpu()`, `.numpy()`) and
every synchronize (torch.cuda's, DeepSpeed's accelerator's, CUDA events' and streams'). On the
CPU every tensor is a host tensor, so a read there counts whether or not it would wait on CUDA
(raypack's read a step late reads pinned host memory on CUDA), and DeepSpeed's CPU accelerator
skips the syncs it makes only where a device runs asynchronously (ZeRO's overlap_comm epilogue):
the CPU counts are what each side asks for, the GPU run says what waits.
Results: benchmarks/results/step_syncs_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, smoke_banner, versions, write_results  # noqa: E402

ORIGINS = ("raypack", "deepspeed", "optimi", "transformers")
"""Where an event is attributed: the innermost frame in one of these packages (else `torch`)."""
READS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}


def _origin_of_caller() -> tuple[str, str]:
    """(package, "module.function") of the innermost frame in one of ORIGINS, above the counter's own."""
    frame = sys._getframe(3)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        where = f"{Path(path).stem}.{frame.f_code.co_name}"
        if path.endswith("/benchmarks/step_syncs.py"):
            if frame.f_code.co_name == "baseline_step":
                return "raypack", where  # the `before` step: raypack's code of then, kept here
        else:
            for name in ORIGINS:
                if f"/{name}/" in path:
                    return name, where
        frame = frame.f_back
    return "torch", ""


class SyncCounter:
    """Counts, in the calling thread, what makes the host wait (see the module doc): `events` is
    a list of (kind, origin, where, what) in order: kind one of collective, read, sync, mark;
    origin the package and `where` its function ("module.function") that asked for it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []
        self._stack = contextlib.ExitStack()

    def mark(self, name: str) -> None:
        self.events.append(("mark", "", "", name))

    def add(self, kind: str, what: str) -> None:
        self.events.append((kind, *_origin_of_caller(), what))

    def _what(self, tensor, name: str) -> str:
        """How a read of `tensor` by `name` is recorded (benchmarks/loop_syncs.py says what it read)."""
        return name

    def dispatched(self, name: str, args: tuple) -> None:
        """One aten op (`name`, its `args`) as torch dispatches it: a collective or a read is recorded."""
        if name.startswith("c10d."):
            self.add("collective", name)
        elif name.startswith("aten._local_scalar_dense"):
            self.add("read", self._what(args[0], "item"))

    def computed(self, args: tuple, out) -> None:
        """An op's output, after it ran (loop_syncs.ReadCounter follows host tensors through it)."""

    def __enter__(self) -> SyncCounter:
        counter = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.dispatched(str(func), args)
                out = func(*args, **(kwargs or {}))
                counter.computed(args, out)
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in READS:
                    counter.add("read", counter._what(args[0], func.__name__))
                return func(*args, **(kwargs or {}))

        def counted(owner, attr: str, label: str):
            original = getattr(owner, attr)

            def wrapper(*a, **k):
                counter.add("sync", label)
                return original(*a, **k)

            self._stack.callback(setattr, owner, attr, original)
            setattr(owner, attr, wrapper)

        counted(torch.cuda, "synchronize", "torch.cuda.synchronize")
        counted(torch.cuda.Event, "synchronize", "Event.synchronize")
        counted(torch.cuda.Stream, "synchronize", "Stream.synchronize")
        from deepspeed.accelerator import get_accelerator

        counted(type(get_accelerator()), "synchronize", "accelerator.synchronize")
        self._stack.enter_context(Dispatch())
        self._stack.enter_context(Function())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


# --- the two steps ---------------------------------------------------------------------------------


def baseline_step(engine, step, loss) -> dict[str, float]:
    """raypack's train_step before issue 35 (commit e8964e6), for the `before` side."""
    import torch.distributed as dist

    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward

    t0 = time.perf_counter()
    world = dist.get_world_size()
    n_global = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    loss_sum = forward_backward(engine, step.batches, world * len(step.batches) / n_global, loss)
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    busy = time.perf_counter() - t0
    stats = global_count([float(loss_sum), step.tokens, busy], engine.device).cpu()
    return {"loss": float(stats[:, 0].sum()) / n_global, "tokens": float(stats[:, 1].sum())}


def loop_worker(cfg, engine, loss, counts, rank: int, total_steps: int):
    """The state raypack's loop steps with (raypack/train/loop.py's Worker), for the `after` side:
    its reporter logs each step's values (no trackers; reports, evals and checkpoints come only
    when due, not every step, and are not counted), and its StopWatch votes at every step (no
    driver asks here, so every vote is to go on: what a run's steps cost until a stop)."""
    from raypack.config import Config
    from raypack.train.checkpoint import TrainState
    from raypack.train.loop import Worker
    from raypack.train.metrics import Reporter
    from raypack.train.stop import StopWatch

    reporter = Reporter(rank=rank, total_steps=total_steps, report_every=None, static={},
                        gather=counts.gather if counts.world > 1 else None)
    reporter.start_clocks()
    return Worker(Config(train=cfg), data=None, rank=rank, engine=engine, loss=loss,
                  state=TrainState(), reporter=reporter, total_steps=total_steps, config={}, counts=counts,
                  stop=StopWatch(rank=rank))


def old_settings(ds: dict, world: int) -> dict:
    """DeepSpeed's config as raypack wrote it before issue 35: DeepSpeed's own defaults for the bf16
    overflow check and the throughput timer, and the preset's overlap_comm on one rank."""
    ds = {**ds, "bf16": {"enabled": ds["bf16"]["enabled"]}}
    ds.pop("timers", None)
    ds["zero_optimization"] = {**ds["zero_optimization"], "overlap_comm": True}
    return ds


def run_side(side: str, args, device: torch.device, world: int) -> dict:
    """Build the engine, run warm-up + measured steps of `side`, count and time them."""
    import torch.distributed as dist

    from benchmarks.loss_memory import build, make_rows
    from raypack.config import TrainConfig
    from raypack.train.engines import deepspeed_engine as engine_mod
    from raypack.train.loop import log_pending, take_step
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.stepvalues import HostCounts

    cfg = TrainConfig(num_workers=world, zero_stage=2, deepspeed_preset="zero2", grad_clip=1.0, warmup_steps=1,
                      lr=1e-4, use_gpu=device.type == "cuda")
    model = build(args, device.type)
    if args.smoke:
        model = model.to(torch.bfloat16)
    written = engine_mod.deepspeed_config(cfg, dtype=torch.bfloat16, world_size=world)
    config = old_settings(written, world) if side == "before" else written
    original = engine_mod.deepspeed_config
    engine_mod.deepspeed_config = lambda *a, **k: config  # setup_engine builds exactly `config`
    try:
        engine = engine_mod.setup_engine(model, cfg, dtype=torch.bfloat16, world_size=world,
                                         total_steps=args.warmup + args.steps)
    finally:
        engine_mod.deepspeed_config = original
    if side == "before" and "unscale_and_clip_grads" in vars(engine.optimizer):
        del engine.optimizer.unscale_and_clip_grads  # DeepSpeed's own clipping, as before issue 40
    loss = make_loss(engine, "chunked")
    rank = dist.get_rank()
    rows = make_rows(args.warmup + args.steps, args.tokens, loss.vocab, seed=args.seed + rank)
    steps = [prepare_step([r], pin=device.type == "cuda") for r in rows]
    counts = HostCounts.open(world, device)
    worker = loop_worker(cfg, engine, loss, counts, rank, len(steps))
    counter = SyncCounter()
    started, first = 0.0, 0
    import warnings

    with counter, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for i, step in enumerate(steps):
            if i == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started, first, warned_before = time.perf_counter(), len(counter.events), len(warned)
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")  # a warning per synchronizing CUDA call
            if side == "before":
                baseline_step(engine, step, loss)
            else:  # the loop's own step: the stop vote, enqueue this step, then read the last one
                assert take_step(worker, step, 0, 0.0), "a step with no stop asked for stopped"
            counter.mark(f"step {i + 1} enqueued")
        if side == "after":
            log_pending(worker)  # the last step's values, as the loop reads them at its last report
        if device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    measured = counter.events[first:]
    per_step = collections.Counter(f"{k}: {o} ({where})" for k, o, where, _ in measured if k != "mark")
    if device.type == "cuda":
        cuda_syncs = [w for w in warned[warned_before:] if "synchroniz" in str(w.message)]
        per_step["synchronizing CUDA calls (torch's sync debug mode)"] = len(cuda_syncs)
    engine.destroy()
    return {"per_step": {row: n / args.steps for row, n in sorted(per_step.items())},
            "tokens_per_s": sum(s.tokens for s in steps[args.warmup:]) * world / elapsed,
            "events": counter.events}


def _rank_main(rank: int, world: int, store: str, args, out: str) -> None:
    """One spawned rank of a --world 2 run: both sides, results to `out` from rank 0."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {side: run_side(side, args, torch.device("cpu"), world) for side in ("before", "after")}
    if rank == 0:
        torch.save({side: {k: v for k, v in r.items() if k != "events"} for side, r in results.items()}, out)
    destroy_process_group()


@contextlib.contextmanager
def _restored(saved: dict[str, str | None]):
    """Put back the environment DeepSpeed's launch variables were set in (a smoke test runs in pytest)."""
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(args, device: str, world: int) -> dict:
    """Both sides on `world` ranks: one in this process, more spawned (CPU only)."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")}
    with tempfile.TemporaryDirectory(prefix="step_syncs_") as tmp, _restored(saved):
        if world > 1:
            out = f"{tmp}/out.pt"
            from benchmarks.step_syncs import _rank_main as main  # by module name: a child imports it

            torch.multiprocessing.spawn(main, args=(world, f"{tmp}/store", args, out), nprocs=world)
            return torch.load(out)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if device == "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            return {side: run_side(side, args, torch.device(device), 1) for side in ("before", "after")}
        finally:
            destroy_process_group()


def destroy_process_group() -> None:
    """Through DeepSpeed, which then forgets the groups it cached: a later engine in this process
    (a test's) would find them destroyed."""
    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed as dist

    if deepspeed.comm.comm.cdb is None:  # DeepSpeed never joined it (a torch engine's group)
        dist.destroy_process_group()
    else:
        deepspeed.comm.destroy_process_group()


def table(results: dict, gpu: bool) -> list[str]:
    rows = sorted(set(results["before"]["per_step"]) | set(results["after"]["per_step"]))
    lines = ["| per optimizer step | before | after |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {row} | {results['before']['per_step'].get(row, 0):.1f} | "
                     f"{results['after']['per_step'].get(row, 0):.1f} |")
    if gpu:
        lines.append(f"| tokens/s | {results['before']['tokens_per_s']:,.0f} | {results['after']['tokens_per_s']:,.0f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny Llama, 256 tokens, 3 measured steps: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens a packed row (default 16384; smoke 256)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (default 128256; smoke 768)")
    p.add_argument("--steps", type=int, default=None, help="measured optimizer steps (default 10; smoke 3)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    p.add_argument("--world", type=int, nargs="+", default=None,
                   help="ranks (default: 1 on a GPU; 1 and 2 on the CPU, the 2 spawned over gloo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # The counts need no GPU: on the CPU the tiny model, counts only (its times say nothing).
    smoke = args.smoke
    device = gpu_or_smoke(__file__, True, "") if not torch.cuda.is_available() else "cuda"
    args.smoke = args.smoke or device == "cpu"  # benchmarks.loss_memory.build: the tiny model
    args.tokens = args.tokens or (256 if args.smoke else 16384)
    args.steps = args.steps or (3 if smoke else 10)
    worlds = args.world or ([1] if device == "cuda" else [1, 2])
    results = {world: measure(args, device, world) for world in worlds}
    lines = [f"# What a train step waits for, before and after issue 35, {device_name()}, {time.strftime('%Y-%m-%d')}",
             *smoke_banner(smoke), "", f"Command: `{command_line(__file__, argv)}`", "",
             f"Machine: {machine()}. Versions: {versions('deepspeed', 'ray')}.", "",
             f"Model: {'tiny-llama' if args.smoke else 'Llama-3.2-1B shape'}, bf16, DeepSpeed ZeRO-2, torch AdamW, the "
             f"chunked loss, clipping at 1.0; one {args.tokens}-token packed row a step; {args.warmup} warm-up and "
             f"{args.steps} measured steps. Counts are means per measured step, by where they come from "
             "(the module doc says what each kind is and what the CPU can't show). Both sides run today's model "
             "code: transformers' packed-row detection in its mask code (a read a forward, until issue 40) is gone "
             "from both. `deepspeed (stage_1_and_2._optimizer_step)`: torch AdamW's `.item()` of its step counters, "
             "host tensors when it is not fused (the CPU); fused on CUDA, they stay on the device, unread.", ""]
    for world, r in results.items():
        lines += [f"## {world} rank{'s' if world > 1 else ''}", "", *table(r, device == "cuda"), ""]
    write_results("step_syncs", smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
