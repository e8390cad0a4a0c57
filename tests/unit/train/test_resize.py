"""A resume on another worker count, the driver's side (raypack/train/resize.py): the step size
kept where it divides, what can't be resharded refused in one line, the epoch's trained examples
and the run's totals read back from every rank's step log, the rest's steps counted. No Ray."""

from __future__ import annotations

import json

import pytest

from raypack.config import load
from raypack.data.shards import Prepared
from raypack.errors import InputError
from raypack.train.checkpoint import POSITION, TrainState, same_base, write_steps_log
from raypack.train.resize import Position, check_resizable, epoch_trained, keep_step_size, last_position, trained_totals


def _pos(world: int, accum: int, epoch: int = 0) -> Position:
    return Position(epoch=epoch, micro_step=8, step=4, plan="p", world_size=world, grad_accum=accum, checkpoint="CKPT")


def test_grad_accum_keeps_the_step_size_where_the_new_count_divides_it_else_one_line_says_what_changed():
    cfg = load(None, ["train.num_workers=1", "train.grad_accum=2", "train.engine=torch"])
    same, line = keep_step_size(cfg, _pos(2, 2), accum_given=False)
    assert same.train.grad_accum == 4
    assert line == ("[raypack] resuming on 1 worker, the checkpoint's 2: train.grad_accum 2 -> 4, so an optimizer "
                    "step still trains 4 packs; the rest of epoch 1 is planned again for them")
    three = load(None, ["train.num_workers=3", "train.grad_accum=2", "train.engine=torch"])
    kept, line = keep_step_size(three, _pos(2, 2, epoch=1), accum_given=False)
    assert kept.train.grad_accum == 2
    assert line == ("[raypack] resuming on 3 workers, the checkpoint's 2: an optimizer step now trains 6 packs instead "
                    "of 4 (4 packs don't divide over 3 ranks), with train.grad_accum 2; the rest of epoch 2 is planned "
                    "again for them")
    given, line = keep_step_size(cfg, _pos(2, 2), accum_given=True)
    assert given.train.grad_accum == 2 and "(as train.grad_accum says)" in line
    assert keep_step_size(cfg, _pos(1, 2), accum_given=False) == (cfg, None)  # its own size: nothing to say
    assert keep_step_size(cfg, None, accum_given=False) == (cfg, None)


@pytest.mark.parametrize("override,why", [
    ("train.zero_stage=0 model.dtype=float32", "at train.zero_stage=0"),  # (ZeRO-0 in bf16: the config refuses)
    ("train.offload_params=true", "offloaded to the host"),
    ("train.precision=bf16", "with train.precision=bf16 and train.optimizer=torch"),
    ("model.dtype=float16", "with model.dtype=float16"),
    ("model.dtype=auto", "with model.dtype=float32"),  # auto on the CPU
])
def test_deepspeed_state_its_universal_checkpoint_doesnt_reshard_exactly_is_refused_in_one_line(override, why):
    deepspeed = load(None, ["train.num_workers=1", "train.engine=deepspeed", "model.dtype=bfloat16",
                            "train.zero_stage=3", *override.split()])
    with pytest.raises(InputError) as e:
        check_resizable(deepspeed, _pos(2, 2))
    assert str(e.value).startswith(f"train.num_workers=1: the checkpoint CKPT was taken on 2 workers, and DeepSpeed's "
                                   f"ZeRO state {why}")
    assert "resume with train.num_workers=2" in str(e.value) and "\n" not in str(e.value)
    check_resizable(deepspeed, _pos(1, 2))  # the checkpoint's own count: nothing to reshard


def test_state_that_cant_be_resharded_or_rest_that_cant_be_told_is_refused_in_one_line():
    for stage in (1, 2, 3):  # DeepSpeed's universal checkpoint: ZeRO 1-3 in bf16, mixed
        check_resizable(load(None, ["train.num_workers=1", "model.dtype=bfloat16", f"train.zero_stage={stage}"]),
                        _pos(2, 2))
    wrapped = load(None, ["train.num_workers=1", "train.engine=torch", "pack.strategy=wrapped"])
    with pytest.raises(InputError, match="pack.strategy=wrapped splits examples across steps"):
        check_resizable(wrapped, _pos(2, 2))
    check_resizable(load(None, ["train.num_workers=3", "train.engine=torch"]), _pos(2, 2))
    # LoRA, its base held whole or in shards: checkpoint.same_base compares the checksum no sharding changes
    lora = ["train.num_workers=1", "model.dtype=bfloat16", "model.peft.method=lora"]
    for stage in (["train.zero_stage=2"], ["train.zero_stage=3"], ["train.engine=torch", "train.zero_stage=0"],
                  ["train.engine=torch", "train.zero_stage=3"]):
        check_resizable(load(None, [*lora, *stage]), _pos(2, 2))
    saved = TrainState(base_digest=[5, 6], base_sum=11)  # two ranks' shards' checksums; their sum
    assert same_base(saved, [5, 6], 11, resized=False) and not same_base(saved, [5, 7], 11, resized=False)
    assert same_base(saved, [4, 3, 2], 11, resized=True) and not same_base(saved, [4, 3, 2], 12, resized=True)
    assert not same_base(saved, [11], 11, resized=False)  # the same count cuts the same shards
    older = TrainState(base_digest=[7, 7])  # from before base_sum was kept: every rank's whole base
    assert same_base(older, [7], 1, resized=True) and not same_base(older, [8], 1, resized=True)


def test_the_epochs_trained_examples_and_the_totals_come_from_every_ranks_log(tmp_path):
    write_steps_log(tmp_path / "steps_rank0.npz", [(1, 0, [4, 2]), (2, 0, [7]), (3, 1, [2])], [10, 5, 6])
    write_steps_log(tmp_path / "steps_rank1.npz", [(1, 0, [1]), (2, 0, [3, 9]), (3, 1, [4, 7])], [3, 8, 9])
    assert sorted(epoch_trained(str(tmp_path), 0).tolist()) == [1, 2, 3, 4, 7, 9]
    assert sorted(epoch_trained(str(tmp_path), 1).tolist()) == [2, 4, 7]
    assert trained_totals(str(tmp_path)) == {
        "examples": 9, "label_tokens": 41,
        "epochs": [{"examples": 6, "label_tokens": 26}, {"examples": 3, "label_tokens": 15}]}


def test_the_last_position_is_the_last_registered_checkpoints(tmp_path):
    assert last_position(str(tmp_path)) is None
    for name, step in (("checkpoint_a", 4), ("checkpoint_b", 8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / POSITION).write_text(json.dumps(
            {"epoch": 0, "micro_step": 2 * step, "step": step, "plan": "f", "world_size": 2, "grad_accum": 2}))
    snapshot = {"checkpoint_results": [{"checkpoint_dir_name": n, "metrics": {}} for n in ("checkpoint_a", "checkpoint_b")]}
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    pos = last_position(str(tmp_path))
    assert (pos.step, pos.world_size, pos.checkpoint) == (8, 2, f"{tmp_path}/checkpoint_b")


def test_a_resized_epoch_reads_its_rest_and_counts_the_steps_done_before_it():
    data = Prepared(root="r", fingerprint="f-rest", train_dir="r/train", eval_dir=None, steps_per_rank=40,
                    padded=False, pad_token_id=0, vocab_size=10, length_mean=1.0, length_sq_mean=1.0, stats={},
                    grad_accum=4, resized={"epoch": 0, "step": 9, "dir": "r/rest", "steps_per_rank": 28,
                                           "stats": {}, "from": "f"})
    assert data.epoch_rows(0) == ("r/rest", 28, False)
    assert data.epoch_rows(1) == ("r/train", 40, True)
    assert data.total_steps(4, epochs=1, max_steps=None) == 9 + 7
    assert data.total_steps(4, epochs=2, max_steps=None) == 9 + 7 + 10
    assert data.total_steps(4, epochs=2, max_steps=12) == 12
