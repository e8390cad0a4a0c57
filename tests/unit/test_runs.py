"""Run folders: where a run lives, its saved config, resuming it from any working folder, trial
names. No Ray involved."""

from __future__ import annotations

import dataclasses

import pytest

from raypack import storage
from raypack.config import ASSETS, dumps, load
from raypack.errors import ConfigError
from raypack.runs import (SAVED_CONFIG, SWEEP_CONFIG, absolute_paths, at, check_same_config, local_path, run_dir,
                          save_config, saved_config, storage_path, trial_config, trial_name)

from paths import REPO, TEST_ASSETS


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
    cfg = load(None, ["data.paths=[data.jsonl, s3://b/x.jsonl]", "tokenize.tokenizer=tok", "model.name=tiny-llama",
                      "run.storage_path=out"])
    out = absolute_paths(cfg)
    assert out.data.paths == (str(tmp_path / "data.jsonl"), "s3://b/x.jsonl")
    assert out.tokenize.tokenizer == str(tmp_path / "tok")
    assert out.model.name == "tiny-llama"  # not a path here: a name for load_model
    assert out.pack == cfg.pack and out.train == cfg.train
    assert out.run.storage_path == str(tmp_path / "out")  # a saved config resumes from anywhere
    assert load(None, ["tokenize.tokenizer=org/name"]).tokenize.tokenizer == absolute_paths(
        load(None, ["tokenize.tokenizer=org/name"])).tokenize.tokenizer  # a hub name stays a name


def test_bundled_assets_are_found_from_any_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no raypack/assets here
    assert local_path("raypack/assets/tokenizer") == str(ASSETS / "tokenizer")
    assert local_path("./raypack/assets/sample/chat.jsonl") == str(ASSETS / "sample" / "chat.jsonl")
    cfg = absolute_paths(load(None, ["tokenize.tokenizer=raypack/assets/tokenizer",
                                     "data.paths=[raypack/assets/sample/chat.jsonl]"]))
    assert cfg.tokenize.tokenizer == str(ASSETS / "tokenizer") and cfg.data.paths == (str(ASSETS / "sample/chat.jsonl"),)


def test_resume_reads_a_saved_run_folder():
    cfg = saved_config(str(TEST_ASSETS / "saved_run"), ["train.lr=0.5"])
    # the run is the folder it was found in, whatever name and storage path it saved
    assert cfg.run.name == "saved_run" and cfg.run.storage_path == str(TEST_ASSETS)
    assert cfg.pack.strategy == "bfd" and cfg.train.grad_accum == 2
    assert cfg.train.lr == 0.5  # the override wins
    assert cfg.tune == load().tune  # a section the file predates takes its defaults


def test_a_run_saved_before_the_eval_cap_keeps_its_uncapped_split_and_packed_key(tmp_path):
    """A config saved before data.eval_max_examples existed resumes with no cap, and its packed
    data keeps the key it was made under (that of raypack before the cap: pinned here), so its
    checkpoints still index it; a run saved now keeps the default cap."""
    from raypack.data.cache import packed_key

    quickstart = str(REPO / "jobs" / "configs" / "quickstart.yaml")

    old = load(quickstart, [f"run.storage_path={tmp_path}"])
    save_config(old)
    path = tmp_path / "quickstart" / SAVED_CONFIG
    path.write_text("\n".join(line for line in path.read_text().splitlines() if "eval_max_examples" not in line))
    resumed = saved_config(str(tmp_path / "quickstart"))
    assert resumed.data.eval_max_examples is None
    # the quickstart's key at 2 ranks in raypack before the cap (fb44f35), with no cap now; cache
    # format 7 (vision rows: the tokenized rows gained image columns) rekeyed every config, so runs
    # packed before it resume only with the version that packed them (trainer._check_same_data)
    assert packed_key(load(quickstart, ["data.eval_max_examples=null"]), 2) == "cb26e554bcb6cb16"
    assert load(quickstart).data.eval_max_examples == 2000


def test_resume_round_trips_what_train_saves(tmp_path):
    cfg = load(None, ["run.name=r", f"run.storage_path={tmp_path}", "tune.strategies=[pad, bfd]",
                      f"data.paths=[{tmp_path}/a.jsonl, {tmp_path}/b.jsonl]"])
    save_config(cfg)
    assert saved_config(f"{tmp_path}/r/") == cfg
    assert dumps(saved_config(f"{tmp_path}/r")) == dumps(cfg)


def test_resume_works_from_another_working_folder_and_after_a_move(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(None, ["run.storage_path=./results", "run.name=r", "tokenize.tokenizer=raypack/assets/tokenizer"])
    save_config(cfg)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    back = saved_config("../results/r")
    assert run_dir(back) == f"{tmp_path}/results/r"  # not ./results/r under the new working folder
    assert back.tokenize.tokenizer == str(ASSETS / "tokenizer")
    (tmp_path / "results").rename(tmp_path / "moved")
    assert run_dir(saved_config(str(tmp_path / "moved" / "r"))) == f"{tmp_path}/moved/r"


def test_resume_names_a_bad_saved_config(tmp_path):
    with pytest.raises(ConfigError, match="no raypack_config.yaml there"):
        saved_config(str(tmp_path))
    (tmp_path / SAVED_CONFIG).write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=rf"{SAVED_CONFIG}: train\.lr: expected a number"):
        saved_config(str(tmp_path))


def test_saved_sweep_config_points_at_where_the_sweep_now_is(tmp_path):
    cfg = load(None, ["run.storage_path=/somewhere/else", "run.name=old", "tune.num_samples=3"])
    moved = tmp_path / "sweeps" / "mine"
    moved.mkdir(parents=True)
    (moved / SWEEP_CONFIG).write_text(dumps(cfg))
    back = saved_config(str(moved), file=SWEEP_CONFIG, what="sweep")
    assert back.run.storage_path == str(tmp_path / "sweeps") and back.run.name == "mine"
    assert back.tune == cfg.tune
    with pytest.raises(ConfigError, match="not a raypack sweep"):
        saved_config(str(tmp_path), file=SWEEP_CONFIG, what="sweep")


def test_a_rerun_with_another_config_is_refused_and_the_saved_one_kept(tmp_path):
    cfg = load(None, ["run.name=r", f"run.storage_path={tmp_path}"])
    check_same_config(cfg, str(tmp_path / "r"))  # no run yet
    save_config(cfg)
    check_same_config(cfg, str(tmp_path / "r"))  # the same config: no error
    other = load(None, ["run.name=r", f"run.storage_path={tmp_path}", "train.lr=0.5", "pack.budget=64"])
    with pytest.raises(ConfigError, match=r"started with another config \(pack.budget: 1024 there, 64 here, and 1 more\).*--resume"):
        check_same_config(other, str(tmp_path / "r"))
    assert (tmp_path / "r" / SAVED_CONFIG).read_text() == dumps(cfg)
    save_config(other)  # never overwritten
    assert (tmp_path / "r" / SAVED_CONFIG).read_text() == dumps(cfg)


def test_at_places_a_config_in_a_folder(tmp_path):
    cfg = at(load(), str(tmp_path / "a" / "b"))
    assert cfg.run.storage_path == str(tmp_path / "a") and cfg.run.name == "b"
    assert storage.absolute(run_dir(cfg)) == str(tmp_path / "a" / "b")
    assert dataclasses.replace(cfg, run=load().run) == load()


def test_trial_config():
    cfg = load(None, ["train.lr=0.01", "pack.batch_size=4"])
    params = {"strategy": "pad", "budget": 512, "lr": 3e-3}
    t = trial_config(cfg, params, "/tmp/exp/runs", "abc_00001", batch_size=2.378)
    assert (t.pack.strategy, t.pack.budget, t.pack.batch_size, t.train.lr) == ("pad", 512, 2.378, 3e-3)
    assert t.run.name == "pad-b512-lr0.003-abc_00001" and t.run.storage_path == "/tmp/exp/runs"
    assert t.model == cfg.model and t.data == cfg.data  # the rest is the base config's
    assert trial_config(cfg, {**params, "strategy": "bfd"}, "/r").pack.batch_size == 4  # no equal-work size: as set
    assert trial_name({"strategy": "bfd", "budget": 256, "lr": 1e-6}) == "bfd-b256-lr1e-06"


def test_orphan_checkpoints_are_the_folders_ray_never_registered(tmp_path):
    import json as _json

    from raypack.runs import CHECKPOINTS, orphan_checkpoints

    root = tmp_path / "run"
    for name in ("checkpoint_a", "checkpoint_b", "checkpoint_c", "packed"):
        (root / name).mkdir(parents=True)
    # no snapshot: none was registered (a run stopped while it saved its first checkpoint)
    assert orphan_checkpoints(str(root)) == [f"{root}/checkpoint_{x}" for x in "abc"]
    (root / CHECKPOINTS).write_text(_json.dumps({"checkpoint_results": [
        {"checkpoint_dir_name": "checkpoint_a"}, {"checkpoint_dir_name": "checkpoint_b"}]}))
    assert orphan_checkpoints(str(root)) == [f"{root}/checkpoint_c"]


def test_a_mixture_run_started_again_with_another_weight_is_a_different_run(tmp_path, monkeypatch):
    """The saved config of a mixture reloads with every source's paths absolute; the same run name
    with a changed weight is refused naming the source's field, as another mixture."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    sources = "data.sources=[{paths: [a.jsonl], weight: 0.7}, {paths: [b.jsonl], weight: 0.3}]"
    cfg = load(None, [sources, "run.storage_path=out", "run.name=mix"])
    save_config(cfg)
    assert saved_config(run_dir(cfg)).data.sources[1].paths == (str(tmp_path / "b.jsonl"),)
    check_same_config(cfg, run_dir(cfg))  # the same config again: fine
    changed = load(None, [sources.replace("0.3", "0.4"), "run.storage_path=out", "run.name=mix"])
    with pytest.raises(ConfigError, match=rf"^run 'mix' in {run_dir(cfg)} was started with another mixture "
                                          r"\(data.sources\[1\].weight: 0.3 there, 0.4 here\): a changed weight or "
                                          r"source draws other examples, so it is a different run; start it with "
                                          r"run.name=NEW_NAME"):
        check_same_config(changed, run_dir(cfg))
