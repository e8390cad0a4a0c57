"""`raypack train --resume`: the config a run saved comes back, overrides on top; no Ray involved."""

from __future__ import annotations

import pytest

from raypack import storage
from raypack.commands.train import SAVED_CONFIG, resume_config
from raypack.config import ConfigError, dumps, load

from paths import TEST_ASSETS


def test_resume_reads_a_saved_run_folder():
    cfg = resume_config(str(TEST_ASSETS / "saved_run"), ["train.lr=0.5"])
    assert cfg.run.name == "saved-run" and cfg.pack.strategy == "bfd" and cfg.train.grad_accum == 2
    assert cfg.train.lr == 0.5  # the override wins
    assert cfg.tune == load().tune  # a section the file predates takes its defaults


def test_resume_round_trips_what_train_saves(tmp_path):
    cfg = load(None, ["run.name=r", "tune.strategies=[pad, bfd]", "data.paths=[a.jsonl, b.jsonl]"])
    storage.write_text(f"{tmp_path}/{SAVED_CONFIG}", dumps(cfg))
    assert resume_config(f"{tmp_path}/") == cfg


def test_resume_names_a_bad_saved_config(tmp_path):
    with pytest.raises(ConfigError, match="no raypack_config.yaml there"):
        resume_config(str(tmp_path))
    (tmp_path / SAVED_CONFIG).write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=rf"{SAVED_CONFIG}: train\.lr: expected a number"):
        resume_config(str(tmp_path))


def test_a_rerun_with_another_config_is_refused_and_the_saved_one_kept(tmp_path):
    from raypack.commands.train import check_same_config

    cfg = load(None, ["run.name=r", f"run.storage_path={tmp_path}"])
    assert check_same_config(cfg, str(tmp_path / "r")) is None  # no run yet
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / SAVED_CONFIG).write_text(dumps(cfg))
    assert check_same_config(cfg, str(tmp_path / "r")) == dumps(cfg)
    other = load(None, ["run.name=r", f"run.storage_path={tmp_path}", "train.lr=0.5", "pack.budget=64"])
    with pytest.raises(ConfigError, match=r"started with another config \(pack.budget: 1024 there, 64 here, and 1 more\).*--resume"):
        check_same_config(other, str(tmp_path / "r"))
    assert (tmp_path / "r" / SAVED_CONFIG).read_text() == dumps(cfg)


def test_a_finished_run_is_known_by_its_steps(tmp_path):
    import json
    import types

    from raypack.commands.train import RESULT, finished

    cfg = load(None, ["train.grad_accum=2", "train.epochs=1"])
    prepared = types.SimpleNamespace(total_steps=lambda accum, epochs, max_steps: 10 // accum * epochs)
    checked = types.SimpleNamespace(prepared=prepared)
    assert finished(str(tmp_path), cfg, checked) is None  # never finished
    (tmp_path / RESULT).write_text(json.dumps({"step": 5, "metrics": {}}))
    assert finished(str(tmp_path), cfg, checked)["step"] == 5
    more = load(None, ["train.grad_accum=2", "train.epochs=2"])  # asks for 10 steps: train on
    assert finished(str(tmp_path), more, checked) is None
    assert finished(str(tmp_path), cfg, types.SimpleNamespace(prepared=None)) is None  # data not packed yet


def test_reprepare_is_refused_for_a_run_with_checkpoints(tmp_path, capsys, monkeypatch):
    import ray

    from raypack.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's Ray may be up
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint_manager_snapshot.json").write_text("{}")
    assert main(["train", "--reprepare", f"run.storage_path={tmp_path}", "run.name=r"]) == 2
    err = capsys.readouterr().err
    assert "--reprepare: run 'r'" in err and "has checkpoints" in err and "run.name=NEW_NAME" in err
