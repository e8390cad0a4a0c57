"""Elastic runs, the config's and the driver's side (raypack/train/elastic.py): `num_workers:
[min, max]` read and checked in one line, the size Ray Train restarted the workers on read from
the fit's result, the step size kept on the new count. No Ray."""

from __future__ import annotations

import json
import types

import pytest

from raypack.config import Config, load
from raypack.errors import ConfigError, InputError
from raypack.train import elastic
from raypack.train.checkpoint import POSITION
from raypack.train.remote import RESIZED


def test_num_workers_min_max_is_an_elastic_run_planned_for_its_max_and_round_trips():
    cfg = load(None, ["train.num_workers=[1, 4]", "train.engine=torch"])
    assert (cfg.train.num_workers, cfg.train.elastic) == (4, (1, 4))
    assert elastic.scaling_workers(cfg, local=False) == (1, 4) and elastic.at_least(cfg, False).train.num_workers == 1
    # a local instance has one node, none to lose or gain: a fixed run on max workers
    assert elastic.scaling_workers(cfg, local=True) == 4 and elastic.at_least(cfg, True) == cfg
    assert Config.from_dict(cfg.to_dict()).train == cfg.train  # the run's saved config is elastic too
    fixed = load(None, ["train.num_workers=3"])
    assert (fixed.train.elastic, elastic.scaling_workers(fixed, False), elastic.at_least(fixed, False)) == ((), 3, fixed)


@pytest.mark.parametrize(("value", "expected"), [
    ("[2, 1]", "[min, max] with 1 <= min <= max, got [2, 1]"),
    ("[0, 2]", "[min, max] with 1 <= min <= max, got [0, 2]"),
    ("[1, 2, 3]", "an int, or [min, max], got [1, 2, 3]"),
])
def test_a_bad_range_is_refused_in_one_line_naming_the_field(value, expected):
    with pytest.raises(ConfigError) as e:
        load(None, [f"train.num_workers={value}", "train.engine=torch"])
    assert str(e.value) == f"override train.num_workers={value}: train.num_workers: expected {expected}"


def test_an_elastic_run_on_unconvertible_deepspeed_or_split_rows_or_split_examples_is_refused_before_it_starts():
    # DeepSpeed as its universal checkpoint reshards it exactly (bf16, mixed, ZeRO 1-3): it goes on
    elastic.check_elastic(load(None, ["train.num_workers=[1, 2]", "model.dtype=bfloat16"]))
    offload = load(None, ["train.num_workers=[1, 2]", "model.dtype=bfloat16", "train.offload_optimizer=true"])
    with pytest.raises(InputError) as e:
        elastic.check_elastic(offload)
    assert str(e.value).startswith("train.num_workers=[1, 2]: a run that changes size reshards its DeepSpeed ZeRO "
                                   "state, which offloaded to the host") and "\n" not in str(e.value)
    with pytest.raises(InputError, match="which with model.dtype=float32 raypack can't"):
        elastic.check_elastic(load(None, ["train.num_workers=[1, 2]", "model.dtype=float32"]))
    with pytest.raises(ConfigError, match="a fixed int with train.sequence_parallel > 1"):
        load(None, ["train.num_workers=[2, 4]", "train.engine=torch", "train.sequence_parallel=2"])
    wrapped = load(None, ["train.num_workers=[1, 2]", "train.engine=torch", "pack.strategy=wrapped"])
    with pytest.raises(InputError, match=r"^train.num_workers=\[1, 2\]: pack.strategy=wrapped splits examples"):
        elastic.check_elastic(wrapped)
    elastic.check_elastic(load(None, ["train.num_workers=[1, 2]", "train.engine=torch"]))
    # LoRA, its base held whole (as tests/ray/train/test_trainer_multinode.py runs it) or in shards
    for stage in ("train.zero_stage=2", "train.zero_stage=3"):
        elastic.check_elastic(load(None, ["train.num_workers=[1, 2]", "model.dtype=bfloat16", stage,
                                          "model.peft.method=lora"]))


def test_the_fits_return_value_says_the_count_the_workers_were_restarted_on():
    assert elastic.resized_to(types.SimpleNamespace(return_value={RESIZED: 3})) == 3
    assert elastic.resized_to(types.SimpleNamespace(return_value=None)) is None
    assert elastic.resized_to(object()) is None


def _checkpoint(root, world: int, accum: int, step: int = 4) -> None:
    folder = root / "checkpoint_1"
    folder.mkdir(parents=True)
    (folder / POSITION).write_text(json.dumps({"epoch": 0, "micro_step": step * accum, "step": step, "plan": "p",
                                               "world_size": world, "grad_accum": accum}))
    (root / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_1", "metrics": {"step": step}}]}))


def test_going_on_keeps_the_step_size_of_the_last_checkpoint_or_of_the_start_in_one_line(tmp_path, capsys):
    started = load(None, ["train.num_workers=[1, 2]", "train.engine=torch", "train.grad_accum=2"])
    on_one = elastic.going_on(started, 1, str(tmp_path), started)  # no checkpoint yet: the configured step
    assert (on_one.train.num_workers, on_one.train.grad_accum, on_one.train.elastic) == (1, 4, (1, 2))
    assert capsys.readouterr().out == (
        "[raypack] the cluster holds 1 worker now, not 2 (train.num_workers=[1, 2]): going on from the start (no "
        "checkpoint yet); train.grad_accum 2 -> 4, so an optimizer step still trains 4 packs\n")
    _checkpoint(tmp_path, world=2, accum=2)  # back on 2 before a checkpoint on 1: the checkpoint's own shape
    back = elastic.going_on(on_one, 2, str(tmp_path), started)
    assert (back.train.num_workers, back.train.grad_accum) == (2, 2)
    assert capsys.readouterr().out == ("[raypack] the cluster holds 2 workers now, not 1 (train.num_workers=[1, 2]): "
                                       "going on from step 4's checkpoint\n")


def test_data_an_elastic_size_cant_be_planned_for_says_which_size_in_its_one_line():
    from raypack.data.prepare import _check_every_rank_trains

    cfg = load(None, ["train.num_workers=[1, 2]", "train.engine=torch", "train.grad_accum=1"])
    plan = types.SimpleNamespace(num_steps=1)
    with pytest.raises(InputError) as e, elastic.planning(cfg):
        _check_every_rank_trains(plan, [12, 0], cfg, 2, 1)  # one example, two ranks: rank 1 idle
    assert str(e.value).startswith("train.num_workers=[1, 2], the data planned for 2 workers: data.paths: rank 1 of "
                                   "2 gets no label token") and "\n" not in str(e.value), e.value
    with pytest.raises(InputError, match="^data.paths: rank 1"), elastic.planning(load(None, ["train.grad_accum=1"])):
        _check_every_rank_trains(plan, [12, 0], load(None, ["train.grad_accum=1"]), 2, 1)  # a fixed size: as it was


def test_workers_restarted_on_another_count_than_the_data_is_planned_for_return_it_untrained(monkeypatch):
    from raypack.train import remote

    size = {"world": 1}
    monkeypatch.setattr(remote.ray.train, "get_context", lambda: types.SimpleNamespace(get_world_size=lambda: size["world"]))
    monkeypatch.setattr(remote.raycompat, "quiet_report_log", lambda: None)
    cfg = load(None, ["train.num_workers=[1, 2]", "train.engine=torch"])
    assert remote.worker_loop({"cfg": cfg.to_dict()}) == {RESIZED: 1}  # planned for 2, restarted on 1
    size["world"] = 3
    assert remote.worker_loop({"cfg": cfg.to_dict()}) == {RESIZED: 3}
    trained = []
    monkeypatch.setattr("raypack.train.loop.train_loop_per_worker", trained.append)
    size["world"] = 2
    assert remote.worker_loop({"cfg": cfg.to_dict()}) is None and len(trained) == 1  # its own count: it trains
    fixed = load(None, ["train.num_workers=2"])
    size["world"] = 1  # a fixed size is Ray Train's to keep: never returned for
    assert remote.worker_loop({"cfg": fixed.to_dict()}) is None and len(trained) == 2


def test_how_often_an_elastic_run_looks_for_capacity_come_back_reaches_ray_train():
    from raypack.train.trainer import scaling_config

    cfg = load(None, ["train.num_workers=[1, 2]", "train.engine=torch", "train.elastic_resize_interval_s=15"])
    scaling = scaling_config(cfg, local=False)
    assert (scaling.num_workers, scaling.elastic_resize_monitor_interval_s) == ((1, 2), 15)
    assert scaling_config(load(None, ["train.engine=torch"]), local=False).elastic_resize_monitor_interval_s == 60
    with pytest.raises(ConfigError, match=r"train.elastic_resize_interval_s: expected seconds, >= 0"):
        load(None, ["train.num_workers=[1, 2]", "train.elastic_resize_interval_s=-1"])
