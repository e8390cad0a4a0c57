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
