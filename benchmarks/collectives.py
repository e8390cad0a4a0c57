"""Collectives an optimizer step makes, per engine and stage: calls and bytes, against the stage's minimum.

    PYTHONPATH=. python benchmarks/collectives.py            # 2 gloo ranks, tiny Llama, grad_accum 2
    PYTHONPATH=. python benchmarks/collectives.py --smoke    # the same, fewer tokens

A collective's count and size are facts of the engine's code, the same over gloo on the CPU as
over NCCL on GPUs, and they decide a multi-GPU step's communication time. Counted on two ranks
spawned here, each engine's own code (raypack/train/engines), one warm-up optimizer step and one
measured, each of `--accum` micro-batches (the optimizer step's own collectives included):

- every torch.distributed collective called from Python (FSDP2's all-gathers and
  reduce-scatters, DeepSpeed's through deepspeed.comm, raypack's own), by wrapping the functions
  of torch.distributed while the step runs; bytes are the tensors each rank sends;
- DDP's gradient all-reduces, which its C++ reducer issues without Python: counted by a comm hook
  that passes each bucket to torch's own `allreduce_hook`.

The minimum a step needs, per stage (W: the trained weights' bytes in the dtype reduced or gathered):
DDP (zero_stage 0) one all-reduce of the gradients (W, fp32); FSDP2 and ZeRO stages 1-2 one
reduce-scatter of the gradients and one all-gather of the updated weights a step; stage 3 the
same reduce-scatter, and the weights gathered for each micro-batch's forward and backward.
Results: benchmarks/results/collectives_<device>_<date>.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import command_line, machine, smoke_banner, versions, write_results  # noqa: E402

RUNS = (("torch", 0), ("torch", 1), ("torch", 2), ("torch", 3), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3))
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_single", "broadcast", "all_gather",
               "reduce_scatter", "reduce", "all_to_all_single", "all_to_all", "_reduce_scatter_base",
               "_all_gather_base", "all_gather_object", "broadcast_object_list", "all_reduce_coalesced",
               "all_gather_coalesced")
VOCAB = 97
ACCUM = 2
"""Micro-batches an optimizer step: the bounds below are for this many."""
BOUNDS = {
    ("torch", 0): 1.05,  # DDP: one all-reduce of the gradients, after the last micro-batch
    # FSDP2 stages 1-2 gather the weights and reduce-scatter the gradients once a step (fsdp.accumulate)
    ("torch", 1): 1.05,
    ("torch", 2): 1.05,
    # stage 3's gathers are its minimum; its reduce-scatters run every micro-batch, as DeepSpeed's
    # ZeRO-3 does (the gradients stay sharded between micro-batches: the stage's memory): measured
    # 1.34 (tiny-llama, 2 ranks), the bound that measurement x1.05
    ("torch", 3): 1.34 * 1.05,
    ("deepspeed", 1): 1.05,  # ZeRO-1 all-reduces the accumulated gradients once a step, then gathers the weights
    # ZeRO-2 reduces each micro-batch's gradients as they come (all-reduces here): accum x the
    # gradients, DeepSpeed's design (it keeps no unreduced gradients); measured 1.67, bound x1.05
    ("deepspeed", 2): 1.67 * 1.05,
    # below its minimum: ZeRO-3 keeps weights under its persistence threshold whole on every rank
    # (a tiny model's are most of them), never gathered
    ("deepspeed", 3): 1.05,
}
"""Largest total bytes a step / the stage's minimum total, with grad_accum ACCUM."""


def _bytes(name: str, args, kwargs) -> int:
    """What this rank sends: a gather's or scatter's input (their second tensor: `(output, input)`),
    or the one tensor of an all-reduce or broadcast."""
    from torch.utils import _pytree as pytree

    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0
    sent = tensors[1] if len(tensors) > 1 and ("gather" in name or "scatter" in name) else tensors[0]
    return sent.numel() * sent.element_size()


class Counting:
    """Wraps torch.distributed's collectives while active; `counts[name] = [calls, bytes]`."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.active = False
        self._depth = 0  # a collective that calls another (all_gather_into_tensor's single) counts once
        self._saved: dict = {}

    def install(self) -> None:
        from torch.distributed import distributed_c10d

        for name in COLLECTIVES:
            for module in (dist, distributed_c10d):
                fn = getattr(module, name, None)
                if fn is None or (module, name) in self._saved:
                    continue
                self._saved[(module, name)] = fn
                setattr(module, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.active and not self._depth:
                entry = self.counts[name]
                entry[0] += 1
                entry[1] += _bytes(name, args, kwargs)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__wrapped__ = fn
        return counted

    @staticmethod
    def ddp_hook(state, bucket):
        """DDP's bucket through torch's own allreduce_hook, whose dist.all_reduce is counted."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)


def _rows(rank: int, tokens: int, accum: int) -> list[dict]:
    g = torch.Generator().manual_seed(rank)
    rows = []
    for _ in range(accum):
        ids = torch.randint(3, VOCAB, (tokens,), generator=g).tolist()
        half = tokens // 2
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(half)) + list(range(tokens - half)),
                     "num_tokens": tokens, "example_ids": [0, 1]})
    return rows


def run(engine_name: str, stage: int, counting: Counting, rank: int, tokens: int, accum: int) -> dict:
    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.step import forward_backward

    cfg = TrainConfig(engine=engine_name, num_workers=2, zero_stage=stage, grad_accum=accum, grad_clip=1.0,
                      warmup_steps=0, lr=1e-4)
    torch.manual_seed(0)
    with engines.building(cfg, dtype=torch.float32, world_size=2):
        model = load_model("tiny-llama", dtype="float32", vocab_size=VOCAB)
    engine = engines.build(model, cfg, dtype=torch.float32, world_size=2, total_steps=2)
    if engine_name == "torch" and stage == 0:
        engine.wrapped.register_comm_hook(None, Counting.ddp_hook)
    # the whole weights' bytes (fp32 here), not a rank's shard (FSDP2's DTensors, ZeRO-3's partitions)
    trained = sum(4 * (getattr(p, "ds_numel", None) or (p.shape.numel())) for p in engine.module.parameters()
                  if p.requires_grad)
    loss = make_loss(engine, "chunked")
    step = prepare_step(_rows(rank, tokens, accum))
    n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    for k in range(2):
        counting.active = k == 1  # the warm-up step builds what is built once
        forward_backward(engine, step.batches, 2 * accum / n, loss)
        engine.step()
        counting.active = False
    engine.destroy()
    out = {name: tuple(v) for name, v in counting.counts.items()}
    counting.counts.clear()
    return {"collectives": out, "weight_bytes": trained}


def _rank(rank: int, store: str, tokens: int, accum: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DS_ACCELERATOR="cpu",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("COLLECTIVES_PORT", "29561"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    counting = Counting()
    counting.install()
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for engine_name, stage in RUNS:
            results[(engine_name, stage)] = run(engine_name, stage, counting, rank, tokens, accum)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def minimum(engine_name: str, stage: int, weight_bytes: int, accum: int) -> dict[str, tuple[int, int]]:
    """The stage's minimum a step: {collective kind: (calls, bytes sent by a rank)} over 2 ranks.
    A reduce-scatter sends the whole gradient; an all-gather sends a rank's half of the weights."""
    if stage == 0:
        return {"all-reduce": (1, weight_bytes)}
    gathers = 1 if stage < 3 else 2 * accum
    return {"reduce-scatter": (1, weight_bytes), "all-gather": (gathers, gathers * weight_bytes // 2)}


KIND = {"all_gather_single": "all-gather", "reduce_scatter_single": "reduce-scatter", "all_reduce": "all-reduce", "all_reduce (DDP's buckets)": "all-reduce", "reduce_scatter_tensor": "reduce-scatter",
        "_reduce_scatter_base": "reduce-scatter", "reduce_scatter": "reduce-scatter", "all_gather_into_tensor": "all-gather",
        "_all_gather_base": "all-gather", "all_gather": "all-gather", "all_gather_coalesced": "all-gather",
        "all_reduce_coalesced": "all-reduce"}


def total_ratio(engine_name: str, stage: int, got: dict, accum: int) -> float:
    """Σ bytes of every collective a step / Σ bytes of the stage's minimum."""
    least = sum(b for _, b in minimum(engine_name, stage, got["weight_bytes"], accum).values())
    return sum(b for _, b in got["collectives"].values()) / least


def by_kind(collectives: dict) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for name, (calls, sent) in collectives.items():
        entry = out[KIND.get(name, name)]
        entry[0] += calls
        entry[1] += sent
    return {k: tuple(v) for k, v in out.items()}


def measure(tokens: int, accum: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="collectives_") as tmp:
        out = f"{tmp}/out"
        # by its importable name: the children unpickle it (the smoke test loads this file under another)
        from benchmarks.collectives import _rank as rank_main

        torch.multiprocessing.spawn(rank_main, args=(f"{tmp}/store", tokens, accum, out), nprocs=2)
        return torch.load(f"{out}.0", weights_only=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="16-token rows: proves the script runs")
    p.add_argument("--tokens", type=int, default=None, help="tokens a packed row (default 64)")
    p.add_argument("--accum", type=int, default=ACCUM, help="micro-batches an optimizer step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tokens = args.tokens or (16 if args.smoke else 64)
    results = measure(tokens, args.accum)
    lines = ["# Collectives an optimizer step makes, per engine and stage, cpu (2 gloo ranks)", *smoke_banner(args.smoke),
             "", f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {machine()}. Versions: "
             f"{versions('deepspeed')}.", "",
             f"tiny-llama (vocab {VOCAB}) in fp32, 2 ranks, {args.accum} micro-batches of one {tokens}-token packed row "
             "an optimizer step, the chunked loss, clipping at 1.0; the second optimizer step counted (the first "
             "builds what is built once). Bytes: what one rank sends. Minimum: the module docstring's.", "",
             "Bytes are what a rank hands the collective (a gather's or scatter's input, an all-reduce's "
             "tensor), not the wire's: a ring all-reduce moves twice a reduce-scatter's.", "",
             "| engine | stage | collective | calls | bytes | minimum calls | minimum bytes | bytes / minimum |",
             "|---|---|---|---|---|---|---|---|"]
    for (engine_name, stage), got in results.items():
        kinds = by_kind(got["collectives"])
        least = minimum(engine_name, stage, got["weight_bytes"], args.accum)
        for kind in sorted(set(kinds) | set(least)):
            calls, sent = kinds.get(kind, (0, 0))
            m_calls, m_bytes = least.get(kind, (0, 0))
            ratio = f"{sent / m_bytes:.2f}" if m_bytes else "-"
            lines.append(f"| {engine_name} | {stage} | {kind} | {calls} | {sent:,} | {m_calls} | {m_bytes:,} | {ratio} |")
    verdicts: list[str] = []
    lines.append("")
    for (engine_name, stage), got in results.items():
        ratio = total_ratio(engine_name, stage, got, args.accum)
        bound = BOUNDS[(engine_name, stage)]
        if bound is not None and args.accum == ACCUM and ratio > bound:
            verdicts.append(f"{engine_name} {stage}: {ratio:.2f} > {bound:.2f}")
        lines.append(f"- {engine_name} stage {stage}: all collectives' bytes / the minimum's: {ratio:.2f}"
                     + (f" (bound {bound:.2f})" if bound is not None else ""))
    lines += ["", f"Every engine and stage within its bound (BOUNDS, grad_accum {ACCUM}): "
              + ("yes" if not verdicts else "no: " + "; ".join(verdicts))]
    lines += ["", "## By function", "", "| engine | stage | function | calls | bytes |", "|---|---|---|---|---|"]
    for (engine_name, stage), got in results.items():
        for name, (calls, sent) in sorted(got["collectives"].items()):
            lines.append(f"| {engine_name} | {stage} | {name} | {calls} | {sent:,} |")
    write_results("collectives", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
