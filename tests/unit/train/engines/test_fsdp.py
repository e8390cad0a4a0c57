"""FSDP2 for the torch engine (raypack/train/engines/fsdp.py).

- The mesh: HSDP's (nodes, ranks a node) only where the ranks fill several nodes equally, in order.
- The process group: gloo beside NCCL where FSDP2 offloads to the host (raypack/train/placement.py).
- One rank trains the bare model at every stage, unless it offloads.
- On two gloo processes, a saved bf16 folder as users load it (model.dtype bfloat16, precision
  mixed): rank 1 builds on the meta device, every shard is fp32 and holds the folder's values;
  the embedding and the head are units of their own; a stage-2 optimizer step of two micro-batches
  gathers and reduce-scatters each unit once. And HSDP, emulated as two nodes of one rank each
  (a (2, 1) mesh), trains the weights the flat mesh trains.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from paths import REPO

VOCAB = 97
ROWS = {0: [[[5, 9, 11, 3, 7], [8, 2, 6]], [[4, 4, 10, 12, 13, 14, 15]]],
        1: [[[21, 22, 23]], [[30, 31, 32, 33], [40, 41, 42, 43, 44, 45]]]}  # each rank's micro-batches


@pytest.mark.parametrize("layout,shape", [
    ([(0, 0, 1)], (1,)),
    ([(0, 0, 2), (0, 1, 2)], (2,)),  # one node: flat
    ([(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)], (2, 2)),  # two nodes of two: HSDP
    ([(0, 0, 1), (1, 0, 1)], (2, 1)),
    ([(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)], (4,)),  # unequal nodes: flat
    ([(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)], (4,)),  # a node's ranks not consecutive: flat
])
def test_the_mesh_is_hsdp_only_across_equal_nodes_in_rank_order(layout, shape):
    from raypack.train.engines.fsdp import mesh_shape

    assert mesh_shape(layout) == shape


def test_an_offloading_fsdp2_run_on_gpus_reduces_host_tensors_over_gloo():
    from raypack.config import TrainConfig
    from raypack.train.placement import backend, process_group

    offloaded = TrainConfig(engine="torch", zero_stage=2, use_gpu=True, offload_optimizer=True)
    assert backend(offloaded) == "cpu:gloo,cuda:nccl"
    assert backend(TrainConfig(engine="torch", zero_stage=3, use_gpu=True, offload_params=True)) == "cpu:gloo,cuda:nccl"
    assert backend(TrainConfig(engine="torch", zero_stage=2, use_gpu=True)) == "nccl"
    assert backend(TrainConfig(zero_stage=2, use_gpu=True, offload_optimizer=True)) == "nccl"  # DeepSpeed's CPU Adam
    assert backend(TrainConfig(engine="torch", zero_stage=2, offload_optimizer=True)) == "gloo"
    config, _ = process_group(TrainConfig(engine="torch", zero_stage=2, use_gpu=True, offload_optimizer=True), True)
    assert config.backend == "cpu:gloo,cuda:nccl"


def test_one_rank_trains_the_bare_model_at_every_stage_unless_it_offloads(one_rank_group):
    from torch.distributed.fsdp import FSDPModule

    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.train import engines

    for stage in (1, 2, 3):
        cfg = TrainConfig(engine="torch", num_workers=1, zero_stage=stage)
        model = load_model("tiny-llama", dtype=engines.weights_dtype(cfg, "bfloat16"), vocab_size=VOCAB)
        engine = engines.build(model, cfg, dtype=torch.bfloat16, world_size=1, total_steps=1)
        assert engine.module is model and engine.wrapped is model and not isinstance(model, FSDPModule), stage
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master copy, cast by the engine
    cfg = TrainConfig(engine="torch", num_workers=1, zero_stage=2, offload_optimizer=True)
    engine = engines.build(load_model("tiny-llama", dtype="float32", vocab_size=VOCAB), cfg, dtype=torch.float32,
                           world_size=1, total_steps=1)
    assert isinstance(engine.module, FSDPModule)


def _row(examples):
    ids = [t for e in examples for t in e]
    return {"input_ids": ids, "labels": ids, "position_ids": [p for e in examples for p in range(len(e))],
            "num_tokens": len(ids), "example_ids": list(range(len(examples)))}


def _counting(calls: dict):
    """Count FSDP2's all-gathers and reduce-scatters (its collectives call these two); returns
    what puts the uncounted ones back."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name, original in originals.items():
        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return lambda: [setattr(dist, name, f) for name, f in originals.items()]


def _train(cfg, folder: str, dtype: str, compute: torch.dtype, rank: int, steps: int, count: dict | None = None):
    from torch.distributed.fsdp import FSDPModule

    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.engines import fsdp
    from raypack.train.loop import global_count
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.step import forward_backward

    torch.manual_seed(0)
    with engines.building(cfg, dtype=compute, world_size=2):
        model = load_model(folder, dtype=dtype, vocab_size=VOCAB)
    meta = any(p.is_meta for p in model.parameters())
    engine = engines.build(model, cfg, dtype=compute, world_size=2, total_steps=max(steps, 1))
    loss = make_loss(engine, "chunked", chunk_tokens=7)
    step = prepare_step([_row(mb) for mb in ROWS[rank]])
    total = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    fsdp.reshard(engine.module)  # the loss probe's forward (no backward) left stage 2's weights gathered
    uncount = _counting(count) if count is not None else None
    losses = []
    for _ in range(steps):
        losses.append(float(forward_backward(engine, step.batches, 2 * 2 / total, loss)))
        engine.step()
    if uncount is not None:
        uncount()
    units = [name for name, m in engine.module.named_modules() if isinstance(m, FSDPModule)]
    fsdp.reshard(engine.module)
    p = next(engine.module.parameters())
    return SimpleNamespace(engine=engine, meta=meta, losses=losses, units=units, mesh=tuple(p.device_mesh.shape),
                           dtypes={q.dtype for q in engine.module.parameters()})


def _rank(rank: int, store: str, folder: str, out: str) -> None:
    import os

    import torch.distributed as dist

    from raypack.config import TrainConfig

    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    got = {}
    # as a user runs it: model.dtype bfloat16, precision mixed, stage 2, two micro-batches a step
    cfg = TrainConfig(engine="torch", num_workers=2, zero_stage=2, grad_accum=2, grad_clip=1.0, warmup_steps=0)
    calls: dict = {}
    user = _train(cfg, folder, "bfloat16", torch.bfloat16, rank, 1, count=calls)
    got["user"] = {"meta": user.meta, "dtypes": user.dtypes, "units": user.units, "calls": calls,
                   "mesh": user.mesh}
    # the weights: loaded afresh (the step above moved them)
    fresh = _train(cfg, folder, "bfloat16", torch.bfloat16, rank, 0)
    got["full"] = fresh.engine.full_state_dict()
    # HSDP, emulated: two nodes of one rank each; against the flat mesh, fp32, stage 3
    cfg = TrainConfig(engine="torch", num_workers=2, zero_stage=3, grad_accum=2, grad_clip=1.0, warmup_steps=0)
    for name, env in (("flat", {}), ("hsdp", {"NODE_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})):
        os.environ.update(env)
        run = _train(cfg, folder, "float32", torch.float32, rank, 2)
        got[name] = {"mesh": run.mesh, "losses": run.losses, "full": run.engine.full_state_dict()}
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_trains_a_saved_bf16_folder_as_users_load_it(tmp_path):
    from checkpoints import saved
    from transformers import AutoModelForCausalLM

    from tests.unit.train.engines.test_fsdp import _rank  # by module name: the children import it

    folder = str(saved("tiny-llama", vocab_size=VOCAB))
    out = str(tmp_path / "out")
    torch.multiprocessing.spawn(_rank, args=(str(tmp_path / "store"), folder, out), nprocs=2)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]

    # rank 1 built the structure on the meta device; every rank's shards are the fp32 master copy
    assert [g["user"]["meta"] for g in got] == [False, True]
    assert all(g["user"]["dtypes"] == {torch.float32} for g in got)
    assert got[0]["user"]["mesh"] == (2,)
    # the folder's bf16 values, bit for bit, in the shards (read back in the compute dtype)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    assert set(got[0]["full"]) == set(want)
    for name, w in want.items():
        assert torch.equal(got[0]["full"][name], w), name
    # units: 2 blocks, the embedding, the head, the root; each gathered and reduce-scattered once
    # in a step of two micro-batches (stage 2), not once a micro-batch
    units = got[0]["user"]["units"]
    assert {"model.embed_tokens", "lm_head", ""} < set(units) and len(units) == 5, units
    assert got[0]["user"]["calls"] == {"all_gather_single": len(units), "reduce_scatter_single": len(units)}
    # HSDP as two nodes of one rank: the same losses and weights as the flat mesh
    assert got[0]["hsdp"]["mesh"] == (2, 1) and got[0]["flat"]["mesh"] == (2,)
    assert got[0]["hsdp"]["losses"] == pytest.approx(got[0]["flat"]["losses"], rel=1e-6)
    for name, w in got[0]["flat"]["full"].items():
        torch.testing.assert_close(got[0]["hsdp"]["full"][name], w, rtol=1e-5, atol=1e-6, msg=name)
