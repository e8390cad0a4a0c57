"""What the training loop's steps make the host wait for, per model kind: a text model, two
hybrids, an MoE model with its router loss and a VLM on images, each through the loop's own code.

    PYTHONPATH=. python benchmarks/loop_syncs.py [--smoke] [--out FILE]

benchmarks/step_syncs.py counts one text model's step (its micro-batches made beforehand); here
each kind runs what raypack/train/loop.py's `train_epoch` runs per step: its rows through the
loop's step source (`loop._steps`: the Prefetcher thread and the kind's collate, `VisionRows`
for the VLM, the router's units for the MoE model), then `take_step` (the stop vote,
`train_step`, the router loss where there is one, the previous step's values read a step late),
on one rank under DeepSpeed ZeRO-2 (torch AdamW, the chunked loss, clipping at 1.0, bf16).

What is counted (step_syncs.SyncCounter, in the loop's thread, so the prefetch thread's host work
is not counted): every host read of a tensor's value (`.item()`, `.tolist()`, `.cpu()`,
`.numpy()`), collectives and synchronizes, by the package and function asking. On the CPU every
tensor is a host tensor; and an op whose output size depends on its input's values (`nonzero`,
boolean indexing, `unique`, `repeat_interleave` without `output_size`, `bincount`: a read on
CUDA too, with no `.item()` in sight) counts as a read of that input. To tell the reads that
would wait on CUDA from those that would not,
the step's batch is moved by copying it (as `.to("cuda")` makes a new tensor), so each read is of
one of:

    host copy      a tensor collate built on the host (or a view of one, or computed from host
                   tensors alone, which CUDA computes on the host too): pinned memory on CUDA,
                   read without waiting (the exact attention's, the mixers' and the vision
                   tower's boundaries, the tower's grid)
    a step late    the previous step's values (raypack/train/stepvalues.py): on CUDA copied to
                   pinned memory and read after the next step is enqueued
    device value   anything else: on CUDA a read of the device's memory, which waits for every
                   kernel before it (the loop's host runs ahead of the device no more)

Results: benchmarks/results/loop_syncs_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import command_line, machine, smoke_banner, versions, write_results  # noqa: E402
from benchmarks.step_syncs import SyncCounter, destroy_process_group  # noqa: E402

KINDS = {  # kind -> model.name and what it adds to the step
    "text": "tiny-llama",
    "hybrid (gated delta rule)": "tiny-qwen3_5",
    "hybrid (Mamba-2)": "tiny-nemotron_h",
    "MoE, router loss per example": "tiny-qwen3_moe",
    "VLM, bundled images": "tiny-qwen2_5_vl",
}


SHAPE_FROM_VALUES = frozenset({"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                               "repeat_interleave", "bincount"})
"""aten ops whose output's size depends on their input's values: on CUDA the host reads them back
(a sync), though no `.item()` appears; with a boolean index, `aten.index` and `index_put` too.
`repeat_interleave` counts only without `output_size` (the `.Tensor` overload the counter sees)."""


class ReadCounter(SyncCounter):
    """SyncCounter whose reads say what they read (see the module doc): `host` holds the storages
    of the step's host batch, refilled by the loop before each step."""

    def __init__(self) -> None:
        super().__init__()
        self.host: set[int] = set()
        self.moving = False

    def computed(self, args: tuple, out) -> None:
        """An op whose tensor inputs are all host tensors ran on the host (on CUDA too): its output
        is one (the grid's per-image counts from the host grid, say). Not while a batch is moved."""
        if self.moving:
            return
        inputs = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        if inputs and all(t.untyped_storage().data_ptr() in self.host for t in inputs):
            self.host |= {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor)}  # fmt: skip

    def _what(self, tensor, name: str) -> str:
        ptr = tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None
        return f"{name} of a host copy" if ptr in self.host else f"{name} of a device value"

    def dispatched(self, name: str, args: tuple) -> None:
        super().dispatched(name, args)
        op = name.split(".")[1] if "." in name else name
        if op in SHAPE_FROM_VALUES or (name.startswith("aten.index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())):
            self.add("read", self._what(args[0], op))


def copying_to_device(counter: ReadCounter, batch: dict, device) -> dict:
    """prefetch.to_device as CUDA makes it: the moved tensors are new ones (here copies), the
    host tensors of prefetch.HOST_COPIED kept beside them (exact.keep_host_copy)."""
    from raypack.model.exact import keep_host_copy
    from raypack.train.prefetch import HOST_COPIED

    counter.host |= {v.untyped_storage().data_ptr() for v in batch.values() if isinstance(v, torch.Tensor)}
    counter.moving = True  # the copies are the device's tensors
    moved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "cu_seq_lens_k"}
    counter.moving = False
    if "cu_seq_lens_q" in batch:
        moved["cu_seq_lens_k"] = moved["cu_seq_lens_q"]
    for key in HOST_COPIED:
        if isinstance(batch.get(key), torch.Tensor):
            keep_host_copy(moved[key], batch[key])
    return moved


def rows_for(kind: str, name: str, steps: int, tokens: int, vocab: int):
    """(rows, VisionRows or None): packed rows for `name`, each example restarting its positions."""
    if kind.startswith("VLM"):
        from benchmarks.vision_host import PROCESSOR, sample_row

        row, images = sample_row(tokens)
        return [dict(row) for _ in range(steps)], (images, str(PROCESSOR))
    from benchmarks.loss_memory import make_rows

    return make_rows(steps, tokens, vocab, seed=0), None


def run_kind(kind: str, name: str, args) -> dict:
    import warnings

    from benchmarks.step_syncs import loop_worker
    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.model.ulysses import SequenceGroup
    from raypack.train import loop
    from raypack.train import step as step_module
    from raypack.train.engines.deepspeed_engine import setup_engine
    from raypack.train.objectives.loss import make_loss, probe_batch
    from raypack.train.prefetch import prepare_step
    from raypack.train.objectives.router_loss import make_router_loss
    from raypack.train.stepvalues import HostCounts
    from raypack.train.vision_rows import VisionRows

    torch.manual_seed(0)
    cfg = TrainConfig(num_workers=1, zero_stage=2, deepspeed_preset="zero2", grad_clip=1.0, warmup_steps=1, lr=1e-4)
    model = load_model(name, attention="auto", dtype=torch.bfloat16, vocab_size=768)
    total = args.warmup + args.steps
    engine = setup_engine(model, cfg, dtype=torch.bfloat16, world_size=1, total_steps=total)
    loss = make_loss(engine, "chunked")
    probe = {k: v for k, v in probe_batch(loss.vocab, False).items() if k != "labels"}
    router = make_router_loss(engine.module, cfg, name, probe)
    rows, vision = rows_for(kind, name, total, args.tokens, loss.vocab)
    collate = prepare_step
    if vision is not None:
        collate = functools.partial(prepare_step, collate=VisionRows(engine.module, *vision))
    worker = loop_worker(cfg, engine, loss, HostCounts(world=1), 0, total)
    worker.router = router
    step_collate = functools.partial(collate, router_scope=router.scope if router is not None else None)
    data = types.SimpleNamespace(padded=False, pad_token_id=0)
    counter = ReadCounter()
    original = step_module.to_device  # where the step moves each micro-batch
    step_module.to_device = functools.partial(copying_to_device, counter)
    first = 0
    try:
        with counter, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with loop._steps(data, engine.device, SequenceGroup(1, 0), lambda: iter(rows), 1, step_collate) as steps:
                for i, step in enumerate(steps):
                    if i == args.warmup:
                        first = len(counter.events)
                    counter.host = set()
                    assert loop.take_step(worker, step, 0, 0.0), "a step with no stop asked for stopped"
                    counter.mark(f"step {i + 1} enqueued")
            loop.log_pending(worker)  # the last step's values, as the loop reads them at its last report
    finally:
        step_module.to_device = original
    engine.destroy()
    if router is not None:
        router.routers.remove()
    counted = collections.Counter()
    for k, origin, where, what in counter.events[first:]:
        if k == "mark":
            continue
        late = origin == "raypack" and where.startswith("stepvalues.")
        what = what.replace("of a device value", "a step late") if late else what
        counted[f"{k}: {what} | {origin} ({where})"] += 1
    return {row: n / args.steps for row, n in sorted(counted.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="1 warm-up and 1 measured step a kind: proves the script runs")
    p.add_argument("--tokens", type=int, default=256, help="tokens a packed row")
    p.add_argument("--steps", type=int, default=None, help="measured steps a kind (default 4; smoke 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.steps = args.steps or (1 if args.smoke else 4)
    args.warmup = 1 if args.smoke else args.warmup
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="loop_syncs_") as tmp:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", DS_ACCELERATOR="cpu")
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            for kind, name in KINDS.items():
                results[kind] = run_kind(kind, name, args)
        finally:
            destroy_process_group()
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    lines = ["# What the loop's steps wait for, by model kind, cpu", *smoke_banner(args.smoke), "",
             f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {machine()}. Versions: "
             f"{versions('deepspeed', 'transformers')}.", "",
             f"One rank, DeepSpeed ZeRO-2, torch AdamW, bf16, the chunked loss, clipping at 1.0; one {args.tokens}-token "
             f"packed row a step through the loop's step source and `take_step`; {args.warmup} warm-up and "
             f"{args.steps} measured steps a kind. Counts are means per measured step. `device value`: a read that "
             "would wait for the device on CUDA; `host copy` and `a step late` would not (the module doc says how "
             "the CPU tells them apart). `deepspeed (stage_1_and_2._optimizer_step)`: torch AdamW's `.item()` of its "
             "step counters, host tensors when it is not fused (the CPU); fused on CUDA, they stay on the device.", "",
             "| kind | model | device-value reads a step | host-copy reads | read a step late |", "|---|---|---|---|---|"]
    for kind, per_step in results.items():
        sums = {label: sum(n for row, n in per_step.items() if row.startswith("read:") and label in row.split("|")[0])
                for label in ("device value", "host copy", "a step late")}  # fmt: skip
        adam = sum(n for row, n in per_step.items() if "stage_1_and_2._optimizer_step" in row)
        lines.append(f"| {kind} | {KINDS[kind]} | {sums['device value'] - adam:.1f} (+ {adam:.1f} AdamW's, CPU only) | "
                     f"{sums['host copy']:.1f} | {sums['a step late']:.1f} |")
    for kind, per_step in results.items():
        lines += ["", f"## {kind} ({KINDS[kind]})", "", "| per step | what | where |", "|---|---|---|"]
        for row, n in per_step.items():
            what, where = row.split(" | ")
            lines.append(f"| {n:.1f} | {what} | {where} |")
    write_results("loop_syncs", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
