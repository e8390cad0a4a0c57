"""Where a run's files go, and the paths a config carries to processes with another working dir."""

from __future__ import annotations

from raypack.config import load
from raypack.runtime import absolute_paths, run_dir, storage_path


def test_storage_path_and_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(None, ["run.storage_path=./results/", "run.name=r1"])
    assert storage_path(cfg) == str(tmp_path / "results")
    assert run_dir(cfg) == f"{tmp_path}/results/r1"
    assert run_dir(load(None, ["run.storage_path=s3://b/runs/", "run.name=r1"])) == "s3://b/runs/r1"


def test_absolute_paths_resolve_existing_local_paths_only(tmp_path, monkeypatch):
    (tmp_path / "data.jsonl").write_text("")
    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = load(None, ["data.paths=[data.jsonl, s3://b/x.jsonl]", "tokenize.tokenizer=tok", "model.name=tiny-llama"])
    out = absolute_paths(cfg)
    assert out.data.paths == (str(tmp_path / "data.jsonl"), "s3://b/x.jsonl")
    assert out.tokenize.tokenizer == str(tmp_path / "tok")
    assert out.model.name == "tiny-llama"  # not a path here: a name for load_model
    assert out.pack == cfg.pack and out.train == cfg.train
