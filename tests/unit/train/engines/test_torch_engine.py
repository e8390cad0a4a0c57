"""The torch engine (raypack/train/engines/torch_engine.py) on two gloo processes, without Ray.

- Its checkpoints resume exactly: two steps, a save (each rank into its own folder, merged as
  Ray's upload merges them), two more steps; a fresh engine loaded from the merged folder takes
  the same two steps to the same weights bit for bit, with the schedule where it was. Under DDP,
  FSDP2 resharding (zero_stage 3) and LoRA on FSDP2 (the frozen base left out).
- The checkpoint read offline on the CPU (`raypack export`'s reader) holds the trained weights whole.
- Under FSDP2 ranks > 0 build on the meta device and get rank 0's weights; each rank's digest of
  its frozen shards is the one `adapters.expected_digests(..., "fsdp")` computes offline, and
  their `frozen_sum` shares add up to the whole model's (what a resize compares).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from paths import REPO

VOCAB = 97
rng = np.random.default_rng(0)
EXAMPLES = {0: [[13, 5], [21]], 1: [[3, 8, 11], [4]]}  # each rank's micro-batches, by example length
ROWS = {r: [[rng.integers(1, VOCAB, n).tolist() for n in mb] for mb in mbs] for r, mbs in EXAMPLES.items()}


def _row(examples):
    ids = [t for e in examples for t in e]
    return {"input_ids": ids, "labels": ids, "position_ids": [p for e in examples for p in range(len(e))],
            "num_tokens": len(ids), "example_ids": list(range(len(examples)))}


def _engine(stage: int, lora: bool):
    from raypack.config import PeftConfig, TrainConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model
    from raypack.train import engines

    cfg = TrainConfig(engine="torch", num_workers=2, zero_stage=stage, grad_accum=2, grad_clip=1.0, warmup_steps=1)
    torch.manual_seed(0)
    with engines.building(cfg, dtype=torch.float32, world_size=2):
        model = load_model("tiny-llama", dtype="float32", vocab_size=VOCAB)
    if lora:
        model = apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8), "tiny-llama")
    meta = any(p.is_meta for p in model.parameters())
    return engines.build(model, cfg, dtype=torch.float32, world_size=2, total_steps=6), meta


def _steps(engine, rank: int, n: int) -> list[float]:
    from raypack.train.loop import global_count
    from raypack.train.step import forward_backward
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step

    loss = make_loss(engine, "chunked", chunk_tokens=7)
    step = prepare_step([_row(mb) for mb in ROWS[rank]])
    total = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
    out = []
    for _ in range(n):
        out.append(float(forward_backward(engine, step.batches, 2 * 2 / total, loss)))
        engine.step()
    return out


def _whole(engine) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in engine.module.named_parameters()}


def _rank(rank: int, store: str, folder: str, stage: int, lora: bool, out: str) -> None:
    import torch.distributed as dist

    from raypack.model.adapters import frozen_digest, frozen_sum

    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    a, meta = _engine(stage, lora)
    _steps(a, rank, 2)
    mine = Path(folder) / f"rank{rank}"
    a.save(mine, {"step": 2}, frozen=lora)
    at_save = _whole(a)
    losses_a, weights_a = _steps(a, rank, 2), _whole(a)
    lr_a = a.scheduler.get_last_lr()
    dist.barrier()
    if rank == 0:  # as Ray's upload merges every rank's folder into one checkpoint
        for r in range(2):
            shutil.copytree(Path(folder) / f"rank{r}", Path(folder) / "merged", dirs_exist_ok=True)
    dist.barrier()
    b, _ = _engine(stage, lora)
    state = b.load(Path(folder) / "merged", frozen=lora)
    probed = None
    if lora:  # as a worker's setup takes it: after the loss probe's forward, which has no backward
        from raypack.train.objectives.loss import make_loss

        make_loss(b, "chunked", chunk_tokens=7)
        probed = frozen_digest(b.module)
    losses_b, weights_b = _steps(b, rank, 2), _whole(b)
    digest, share = (frozen_digest(b.module), frozen_sum(b.module)) if lora else (None, None)
    torch.save({"share": share, "meta": meta, "state": state, "losses": (losses_a, losses_b), "lr": (lr_a, b.scheduler.get_last_lr()),
                "weights": (weights_a, weights_b), "at_save": at_save, "digest": digest, "probed": probed, "full": b.full_state_dict()}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("stage,lora", [(0, False), (3, False), (2, True)], ids=["ddp", "fsdp3", "fsdp2-lora"])
def test_a_checkpoint_resumes_bit_for_bit_and_reads_back_offline(tmp_path, stage, lora):
    from tests.unit.train.engines.test_torch_engine import _rank  # by module name: the children import it

    from raypack.model.adapters import apply_adapters, expected_digests, frozen_sum
    from raypack.train.engines import read_offline

    out = str(tmp_path / "out")
    torch.multiprocessing.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "ckpt"), stage, lora, out),
                                nprocs=2)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r, g in enumerate(got):
        assert g["state"] == {"step": 2}
        assert g["losses"][0] == g["losses"][1], f"rank {r}"
        assert g["lr"][0] == g["lr"][1]
        for name, w in g["weights"][0].items():
            assert torch.equal(w, g["weights"][1][name]), f"rank {r}: {name}"
    # FSDP2: rank 1 built on the meta device, rank 0 with the weights it broadcast
    assert [g["meta"] for g in got] == ([False, True] if stage else [False, False])

    saved = read_offline(tmp_path / "ckpt" / "merged", adapters=lora)
    assert (saved.engine, saved.zero_stage, saved.world_size, saved.state) == ("torch", stage, 2, {"step": 2})
    assert saved.dtype == torch.float32
    at_save = got[0]["at_save"]
    expected = {n for n in at_save if "lora_" in n} if lora else set(at_save)  # LoRA: the adapters alone
    assert set(saved.weights) == expected
    for name in expected:
        assert torch.equal(saved.weights[name], at_save[name]), name
    assert set(got[0]["full"]) >= expected  # the whole state dict on rank 0 (FSDP2: there alone)
    assert (not got[1]["full"]) == (stage > 0)
    if lora:
        from raypack.config import PeftConfig
        from raypack.model.build import load_model

        torch.manual_seed(0)
        model = apply_adapters(load_model("tiny-llama", dtype="float32", vocab_size=VOCAB),
                               PeftConfig(method="lora", r=4, alpha=8), "tiny-llama")
        assert expected_digests(model, 2, "fsdp") == [g["digest"] for g in got] == [g["probed"] for g in got]
        assert expected_digests(model, 2, "fsdp") != expected_digests(model, 2, "replicated")
        # the checksum a resize compares: the two ranks' shares of their shards add up to the whole's
        assert sum(g["share"] for g in got) % (1 << 64) == frozen_sum(model) != got[0]["share"]


def test_the_torch_engine_keeps_its_master_weights_in_the_model():
    """precision mixed: fp32 weights (the master copy) where DeepSpeed keeps bf16 ones and its own
    fp32 copy; DDP builds them in fp32, FSDP2 in the compute dtype and casts each rank's shards
    (test_fsdp.py); with LoRA the frozen base in the compute dtype; bf16 precision keeps bf16."""
    from raypack.config import TrainConfig
    from raypack.train import engines

    torch_mixed = TrainConfig(engine="torch", zero_stage=0)
    assert engines.weights_dtype(torch_mixed, "bfloat16") == torch.float32
    assert engines.weights_dtype(TrainConfig(engine="torch", zero_stage=2), "bfloat16") == torch.bfloat16
    assert engines.weights_dtype(torch_mixed, "bfloat16", adapters=True) == torch.bfloat16
    assert engines.compute_dtype(torch_mixed, "bfloat16") == torch.bfloat16
    assert engines.weights_dtype(TrainConfig(engine="torch", precision="bf16"), "auto") == torch.bfloat16
    assert engines.weights_dtype(TrainConfig(), "bfloat16") == torch.bfloat16  # DeepSpeed


def test_a_checkpoint_of_the_other_engine_is_refused_by_name(tmp_path):
    from raypack.errors import InputError
    from raypack.train.checkpoint import check_engine

    (tmp_path / "ds").mkdir()
    with pytest.raises(InputError, match=r"was written by train.engine deepspeed, but this run trains with "
                                         r"train.engine torch, which can't read it; resume with train.engine: deepspeed"):
        check_engine(tmp_path, "torch", "ckpt")
    check_engine(tmp_path, "deepspeed", "ckpt")  # its own engine: fine


def test_no_module_outside_the_engines_imports_deepspeed():
    """The seam: DeepSpeed is imported in the DeepSpeed engine's modules alone,
    raypack/train/engines/deepspeed_engine.py and its checkpoints' conversion, universal.py."""
    import ast

    package = REPO / "raypack"
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "deepspeed" or n.startswith("deepspeed.") for n in names):
                found.append(str(path.relative_to(package)))
    assert sorted(set(found)) == ["train/engines/deepspeed_engine.py", "train/engines/universal.py"], found


def test_a_worker_on_the_torch_engine_never_imports_deepspeed():
    import subprocess

    code = ("import sys, raypack.train.loop, raypack.train.checkpoint, raypack.train.engines.torch_engine; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_without_fsdp2s_unused_reduce_a_vlm_whose_tower_trains_is_refused(monkeypatch, one_rank_group):
    """torch 2.11 (the GPU image's) lacks FSDP2's set_reduce_scatter_unused_params: a VLM whose
    tower trains is refused there, naming the remedies; a text model, or the tower and projector
    frozen, still shards."""
    from torch.distributed.fsdp import FSDPModule

    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.model.traits import UnsupportedModelError
    from raypack.model.vision import freeze
    from raypack.train import engines

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    # offload: FSDP2 on one rank (without it one rank trains the bare model)
    cfg = TrainConfig(engine="torch", num_workers=1, zero_stage=2, offload_optimizer=True)
    with pytest.raises(UnsupportedModelError, match=r"no FSDP2 set_reduce_scatter_unused_params.*use torch >= 2.13"):
        engines.build(load_model("tiny-qwen2_5_vl", dtype="float32"), cfg, dtype=torch.float32, world_size=1, total_steps=1)
    frozen = load_model("tiny-qwen2_5_vl", dtype="float32")
    freeze(frozen, ("vision", "projector"))
    engines.build(frozen, cfg, dtype=torch.float32, world_size=1, total_steps=1)
    engines.build(load_model("tiny-llama", dtype="float32"), cfg, dtype=torch.float32, world_size=1, total_steps=1)


# --- DDP over a VLM (zero_stage 0) ------------------------------------------------------------------

TEXT = [{"input_ids": ids, "labels": ids, "position_ids": pos, "example_ids": [10**9 + k, 10**9 + k + 1],
         "num_tokens": len(ids)}
        for k, (ids, pos) in enumerate([([5, 17, 33, 9, 41, 12, 7, 88, 23], [0, 1, 2, 3, 4, 0, 1, 2, 3]),
                                        ([8, 3, 19, 60, 2, 11], [0, 1, 2, 0, 1, 2])])]
"""Rows of two examples without an image each (ids no image is stored under)."""


def _vlm_steps(rows: dict) -> dict[int, list[list[dict]]]:
    """Each rank's two optimizer steps of two micro-batches: rank 0 an image row and a text row,
    then text alone; rank 1 text alone, then two image rows. Each step, one rank's micro-batches
    skip the vision tower that the other's run."""
    return {0: [[rows[0][0], TEXT[0]], TEXT], 1: [TEXT, [rows[1][0], rows[1][1]]]}


def _vlm_run(folder: str, data: str, world: int, rank: int) -> dict:
    import functools
    import pickle

    from engine_views import grads, params

    from raypack.config import TrainConfig
    from raypack.model.build import load_model
    from raypack.train import engines
    from raypack.train.loop import global_count
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.step import forward_backward
    from raypack.train.vision_rows import VisionRows

    with open(data, "rb") as f:
        rows, images, processor = pickle.load(f)
    steps = _vlm_steps(rows)
    # world 1: the reference, every rank's micro-batches of a step accumulated in one process
    mine = steps[rank] if world == 2 else [steps[0][k] + steps[1][k] for k in range(2)]
    accum = len(mine[0])
    cfg = TrainConfig(engine="torch", num_workers=world, zero_stage=0, grad_accum=accum, grad_clip=0.0,
                      warmup_steps=0, min_lr_ratio=1.0, lr=1e-3)
    # fp32 compute from the saved bf16 folder: what's compared is DDP's reduction, bit for bit
    # but for the order of the ranks' sums; precision is test_loss.py's
    engine = engines.build(load_model(folder, dtype="float32"), cfg, dtype=torch.float32, world_size=world,
                           total_steps=2)
    loss_fn = make_loss(engine, "chunked")
    collate = functools.partial(prepare_step, collate=VisionRows(engine.module, images, processor))
    out: dict = {"losses": [], "ddp": type(engine.wrapped).__name__,
                 "search": getattr(engine.wrapped, "find_unused_parameters", None)}
    for k, group in enumerate(mine):
        step = collate(group)
        n = float(global_count([step.label_tokens], engine.device)[:, 0].sum())
        total = forward_backward(engine, step.batches, world * accum / n, loss_fn)
        out["losses"].append(float(global_count([float(total)], engine.device)[:, 0].sum()) / n)
        if k == 0:
            out["grads"] = grads(engine)
        engine.step()
    out["params"] = params(engine)
    return out


def _vlm_rank(rank: int, store: str, folder: str, data: str, out: str) -> None:
    import torch.distributed as dist

    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.save(_vlm_run(folder, data, 2, rank), f"{out}.{rank}")
    dist.destroy_process_group()


def test_ddp_trains_a_vlm_from_a_saved_folder_without_the_unused_parameter_search(tmp_path, one_rank_group):
    """DDP over a VLM: no find_unused_parameters (its graph walk marked the head, which the chunked
    loss calls after the forward, unused, and the first backward failed: issue 60); a micro-batch
    without images still reduces the tower's weights, with zeros. Two gloo ranks' two steps, each
    with a rank whose micro-batches have no image, equal one process accumulating them all:
    losses, every gradient of the first step (the tower's included) and the weights after two."""
    import pickle

    from checkpoints import saved
    from tests.unit.train.engines.test_torch_engine import _vlm_rank  # by module name: the children import it
    from tests.unit.train.test_vision_rows import prepared_rows

    folder = str(saved("tiny-qwen2_5_vl"))
    data = tmp_path / "rows.pkl"
    data.write_bytes(pickle.dumps(prepared_rows(steps=2)))
    out = str(tmp_path / "out")
    torch.multiprocessing.spawn(_vlm_rank, args=(str(tmp_path / "ranks"), folder, str(data), out), nprocs=2)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert [(g["ddp"], g["search"]) for g in got] == [("DistributedDataParallel", False)] * 2
    reference = _vlm_run(folder, str(data), 1, 0)  # in this process's group of one
    towers = 0
    for g in got:
        assert g["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
            towers += "visual" in name and bool(grad.abs().max() > 0)
        # Adam moves an entry whose gradient is rounding noise by up to lr either way (as in
        # tests/ray/train/test_loop_vision.py): those entries are left out, the rest within a tenth of a step
        for name, p in reference["params"].items():
            signal = reference["grads"][name].abs() > 1e-7
            torch.testing.assert_close(g["params"][name][signal], p[signal], rtol=1e-4, atol=1e-4, msg=name)
    assert towers, "no vision-tower gradient was compared"
