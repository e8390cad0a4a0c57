"""Hugging Face Hub datasets by name (raypack/data/hub.py) against a fake hub on 127.0.0.1
(tests/fakehub.py): which files a name, config, split and revision stand for, every failure as one
line, the rows read as local files' are, and the hub cache read offline."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from raypack.config import DataConfig, SourceConfig
from raypack.data import hub_deadline
from raypack.data.hub import hub_files, is_hub_path
from raypack.data.listing import Sources
from raypack.data.sources import rows_here
from raypack.errors import SourceError

from fakehub import FakeHub, lines, point_at, sample_repos, sha


@pytest.fixture(scope="module")
def fake_hub():
    hub = FakeHub(sample_repos()).start()
    yield hub
    hub.stop()


@pytest.fixture
def hub(fake_hub, monkeypatch, tmp_path):
    """The fake hub as huggingface_hub's endpoint, a fresh cache, no token, online."""
    return point_at(fake_hub, monkeypatch, tmp_path)


def _names(files) -> list[str]:
    return [f.split("@", 1)[1].split("/", 1)[1] for f, _ in files]


def _cached(files) -> list[str]:
    """The paths in the repo of files in the hub cache (`.../snapshots/<sha>/<path>`)."""
    return [f.split("/snapshots/", 1)[1].split("/", 1)[1] for f, _ in files]


def test_hub_names_and_local_paths_are_told_apart(tmp_path):
    (tmp_path / "org").mkdir()
    assert is_hub_path("fake/chat") and is_hub_path("hf://datasets/fake/chat")
    assert not is_hub_path(str(tmp_path / "org"))  # exists here
    assert not is_hub_path("data/chat.jsonl")  # a missing data file, not a dataset
    assert not is_hub_path("./fake/chat") and not is_hub_path("a/b/c")


def test_hub_uris_name_a_repo_revision_and_path():
    from raypack.data.hub import HubRef, parse

    assert parse("fake/chat", "v1", "w") == HubRef("fake/chat", "v1", "")
    assert parse("hf://datasets/fake/chat@v1/data/a.jsonl", None, "w") == HubRef("fake/chat", "v1", "data/a.jsonl")
    assert parse("hf://datasets/fake/chat@refs/pr/3/data", None, "w") == HubRef("fake/chat", "refs/pr/3", "data")
    assert parse("hf://datasets/fake/chat", "v1", "w") == HubRef("fake/chat", "v1", "")
    with pytest.raises(SourceError, match=r"^w: hf://datasets/fake/chat@v2: revision 'v1' set too; name the revision once$"):
        parse("hf://datasets/fake/chat@v2", "v1", "w")


def test_a_name_stands_for_the_train_split_by_datasets_file_name_rules(hub):
    files = hub_files("fake/chat", "data.paths")
    assert files == [(f"hf://datasets/fake/chat@{sha('fake/chat', 'main')}/train.jsonl", "jsonl")]
    assert _names(hub_files("fake/chat", "data.paths", split="test")) == ["test.jsonl"]
    assert _names(hub_files("fake/chat", "data.paths", revision="v1")) == ["train.jsonl"]
    assert hub_files("hf://datasets/fake/chat@v1", "data.paths")[0][0].startswith(f"hf://datasets/fake/chat@{sha('fake/chat', 'v1')}/")
    assert _names(hub_files("hf://datasets/fake/chat/test.jsonl", "data.paths")) == ["test.jsonl"]
    assert _names(hub_files("hf://datasets/fake/mix/short", "w")) == [  # a folder: all of its files, as a local one
        "short/test.parquet", "short/train-0.parquet", "short/train-1.parquet"]
    conversion = sha("fake/csv", "refs/convert/parquet")
    for uri in ("hf://datasets/fake/csv@refs/convert/parquet/default/train",  # as HfFileSystem takes it
                "hf://datasets/fake/csv@refs%2Fconvert%2Fparquet/default/train"):  # as hf_hub_url writes it
        assert hub_files(uri, "w") == [(f"hf://datasets/fake/csv@{conversion}/default/train/0000.parquet", "parquet")]


def test_the_readmes_configs_choose_the_files(hub):
    assert _names(hub_files("fake/mix", "w")) == ["long/a.parquet"]  # the default config
    assert _names(hub_files("fake/mix", "w", config="short")) == ["short/train-0.parquet", "short/train-1.parquet"]
    assert _names(hub_files("fake/mix", "w", config="short", split="test")) == ["short/test.parquet"]
    assert _names(hub_files("fake/mix", "w", config="dir", split="test")) == ["short/test.parquet"]


def test_a_split_reads_the_files_of_the_builder_load_dataset_picks(hub):
    assert _names(hub_files("fake/formats", "w")) == ["train-2.jsonl", "train.jsonl"]
    assert _names(hub_files("fake/formats", "w", revision="tie")) == ["b.parquet"]


def test_files_raypack_cant_read_come_from_the_hubs_parquet_conversion(hub):
    files = hub_files("fake/csv", "w")
    assert files == [(f"hf://datasets/fake/csv@{sha('fake/csv', 'refs/convert/parquet')}/default/train/0000.parquet",
                      "parquet")]


@pytest.mark.parametrize("path, kwargs, message", [
    ("fake/nope", {}, "w: fake/nope: no such file or folder, nor dataset on {url} (or a private one, no HF_TOKEN "
     "set)"),
    ("hf://datasets/fake/nope", {}, "w: hf://datasets/fake/nope: no such dataset on {url} (or a private one, no "
     "HF_TOKEN set)"),
    ("fake/chat", {"revision": "v9"}, "w: fake/chat (revision v9): no such revision"),
    ("fake/chat", {"split": "dev"}, "w: fake/chat: no split 'dev'; it has train, test (set split)"),
    ("fake/chat", {"config": "x"}, "w: fake/chat: no config 'x': the dataset has one (default)"),
    ("fake/mix", {"config": "x"}, "w: fake/mix: no config 'x'; it has short, long, dir"),
    ("fake/csv", {"split": "test"}, "w: fake/csv (its Parquet conversion, refs/convert/parquet): the hub converted "
     "only the first rows of split 'test' to Parquet (a partial conversion); export the whole split as Parquet or "
     "JSON Lines"),
    ("fake/gated", {}, "w: fake/gated: a gated dataset and no HF_TOKEN set: accept its terms on its hub page and "
     "set HF_TOKEN"),
    ("hf://datasets/fake/chat/nope.jsonl", {}, "w: hf://datasets/fake/chat/nope.jsonl: no file or folder nope.jsonl "
     "in the dataset"),
    ("hf://datasets/fake/csv/data.csv", {}, "w: hf://datasets/fake/csv/data.csv: unknown file type; expected .jsonl, "
     ".json or .parquet"),
    ("hf://models/fake/chat", {}, "w: hf://models/fake/chat: only dataset URIs (hf://datasets/org/name) are data"),
])
def test_every_failure_is_one_line_naming_the_dataset(hub, path, kwargs, message):
    with pytest.raises(SourceError) as e:
        hub_files(path, "w", **kwargs)
    assert str(e.value) == message.format(url=hub.url)


def test_a_gated_dataset_reads_with_a_token(hub, monkeypatch):
    """Listed and read with one; read where there is none (a node without HF_TOKEN): one line."""
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert _names(hub_files("fake/gated", "w")) == ["train.jsonl"]
    data = DataConfig(paths=("fake/gated",))
    sources = Sources.of_data(data)
    assert sum(t.num_rows for t in rows_here(data, sources)) == 3
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(SourceError) as e:
        rows_here(data, sources)
    assert str(e.value) == (f"{sources.files[0][0]}: can't read it: a gated dataset and no HF_TOKEN set: accept its "
                            "terms on its hub page and set HF_TOKEN")


@pytest.mark.parametrize("listening", [False, True], ids=["refused", "silent"])
def test_an_unreachable_hub_fails_in_seconds(hub, monkeypatch, listening):
    """A port nothing listens on, and one that accepts and never answers (the deadline bounds it)."""
    import socket

    monkeypatch.setattr(hub_deadline, "DEADLINE_S", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if listening:
            s.listen()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", url)
        t = time.monotonic()
        why = r"no answer within 1 s" if listening else r".*"
        with pytest.raises(SourceError, match=rf"^w: fake/chat: can't reach the hub at {url} \({why}; HF_HUB_OFFLINE=1"):
            hub_files("fake/chat", "w")
        assert time.monotonic() - t < 3


def test_one_deadline_bounds_every_request_of_a_listing(monkeypatch):
    """Requests that each answer within a timeout of their own still end at one deadline together,
    and a request that never returns (no timeout reaches it) is left behind at it."""
    monkeypatch.setattr(hub_deadline, "DEADLINE_S", 1)
    release = threading.Event()
    t = time.monotonic()
    with hub_deadline.within_deadline():
        assert hub_deadline.answer(lambda timeout: time.sleep(0.6) or timeout, "w", "http://hub") <= 1
        with pytest.raises(SourceError, match=r"^w: can't reach the hub at http://hub \(no answer within 1 s;"):
            hub_deadline.answer(lambda timeout: release.wait(), "w", "http://hub")
    assert 0.9 < time.monotonic() - t < 2
    release.set()
    with pytest.raises(KeyError):  # its own errors are raised as they are
        hub_deadline.answer(lambda timeout: {}["x"], "w", "http://hub")


def test_a_silent_hub_is_one_line_within_30_s_of_the_command_starting(tmp_path):
    """`raypack data`, `raypack train` on `data.paths=[org/name]` and `raypack train --resume` of a
    run on it, with a hub that accepts the connection and never answers: each command, timed from
    its process's start (run side by side, so the test takes one deadline, not three), ends with
    one line and exit 2 within 30 s, having asked once (no retries) and started no Ray (no run
    folder is made; the resumed one keeps only its saved config)."""
    import subprocess
    import sys

    from paths import REPO

    from raypack.config import load
    from raypack.runs import run_dir, save_config

    hub = FakeHub({}, silent=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RAY_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO))
    config = ["--config", "jobs/configs/quickstart.yaml", "data.paths=[org/name]"]
    stopped = load(REPO / config[1], [*config[2:], f"run.storage_path={tmp_path / 'stopped'}"])
    save_config(stopped)  # what a run stopped before its first checkpoint leaves
    commands = {"data": ["data", *config], "train": ["train", *config, f"run.storage_path={tmp_path / 'results'}"],
                "resume": ["train", "--resume", run_dir(stopped)]}
    try:
        started, procs = {}, {}
        for command, argv in commands.items():
            started[command] = time.monotonic()
            procs[command] = subprocess.Popen([sys.executable, "-m", "raypack.cli", *argv], cwd=REPO, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            took = time.monotonic() - started[command]
            assert (proc.returncode, out, err.splitlines()) == (2, "", [
                f"raypack: error: data.paths: org/name: can't reach the hub at {hub.url} (no answer within "
                f"{hub_deadline.DEADLINE_S:g} s; HF_HUB_OFFLINE=1 reads the hub cache)"]), command
            assert hub_deadline.DEADLINE_S <= took < 30, (command, took)
        # one request for the dataset a command (no retry); huggingface_hub asks its agent registry too
        assert [r for r in hub.requests if "datasets" in r] == ["GET /api/datasets/org/name"] * 3
        assert not (tmp_path / "results").exists()
        assert sorted(p.name for p in Path(run_dir(stopped)).iterdir()) == ["raypack_config.yaml"]
    finally:
        hub.stop()


def test_a_sources_config_split_and_revision_read_the_rows_local_files_would(hub, tmp_path):
    """The hub's files, listed and read as local copies of them are: the same rows, formats and order."""
    source = SourceConfig(paths=("fake/mix",), config="short")
    hub_rows = rows_here(DataConfig(sources=(source,)), Sources.of_data(DataConfig(sources=(source,))))
    for name in ("train-0.parquet", "train-1.parquet"):
        (tmp_path / name).write_bytes(hub.repos["fake/mix"].revisions["main"][f"short/{name}"])
    local_rows = rows_here(DataConfig(paths=(str(tmp_path),)), Sources.of((str(tmp_path),)))
    drop = ["example_id", "error"]
    assert [t.drop_columns(drop).to_pylist() for t in hub_rows] == [t.drop_columns(drop).to_pylist() for t in local_rows]
    assert sum(t.num_rows for t in hub_rows) == 6


def test_config_split_and_revision_on_a_local_path_are_refused(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(lines("chat.jsonl", 0, 1))
    data = DataConfig(sources=(SourceConfig(paths=(str(tmp_path / "a.jsonl"),), split="test"),))
    with pytest.raises(SourceError, match=r"^data.sources\[0\] \(paths: .*\): split choose a Hugging Face Hub "
                                          r"dataset's files; .* is a local path$"):
        Sources.of_data(data)


def test_offline_reads_what_the_hub_cache_holds(hub, monkeypatch):
    from huggingface_hub import snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError, match="^w: fake/chat: no such file or folder, nor in the hub cache, and HF_HUB_OFFLINE=1"):
        hub_files("fake/chat", "w")
    with pytest.raises(SourceError, match="^w: hf://datasets/fake/chat: not in the hub cache, and HF_HUB_OFFLINE=1"):
        hub_files("hf://datasets/fake/chat", "w")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    snapshot_download("fake/chat", repo_type="dataset")  # what `hf download --repo-type dataset` does
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    files = hub_files("fake/chat", "w", split="test")
    assert [f.rsplit("/", 2)[-2:] for f, _ in files] == [[sha("fake/chat", "main"), "test.jsonl"]]
    assert open(files[0][0], "rb").read() == hub.repos["fake/chat"].revisions["main"]["test.jsonl"]
    rows = rows_here(DataConfig(paths=("fake/chat",)), Sources.of(("fake/chat",)))
    assert sum(t.num_rows for t in rows) == 12
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    snapshot_download("fake/mix", repo_type="dataset")
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # its README's configs, read from the cache
    assert _cached(hub_files("fake/mix", "w", config="short")) == ["short/train-0.parquet", "short/train-1.parquet"]
    assert len(hub.requests) == asked  # nothing asked of the network


def test_raypack_data_shows_a_hub_datasets_examples_as_a_local_copys(hub, tmp_path, monkeypatch, capsys):
    """`raypack data --show 2 --json` on `fake/chat`: the tokens and labels of its local copy, with no
    Ray started; a dataset the hub hasn't: exit 2 and one line."""
    import ray

    from raypack.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "train.jsonl").write_bytes(hub.repos["fake/chat"].revisions["main"]["train.jsonl"])
    shown = []
    asked = len(hub.requests)
    for path in ("fake/chat", tmp_path / "train.jsonl"):
        assert main(["data", f"data.paths=[{path}]", "--show", "2", "--json"]) == 0
        shown.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    # listed once, before the command's imports (raypack/cli.py), and that listing reused by it
    assert hub.requests[asked:].count("GET /api/datasets/fake/chat") == 1
    assert [e.pop("source") for e in shown[0]] == [f"hf://datasets/fake/chat@{sha('fake/chat', 'main')}/train.jsonl"] * 2
    assert [e.pop("source") for e in shown[1]] == [str(tmp_path / "train.jsonl")] * 2
    assert shown[0] == shown[1] and len(shown[0][0]["input_ids"]) > 0
    assert main(["data", "data.paths=[fake/nope]"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raypack: error: data.paths: fake/nope: no such file or folder, nor dataset on {hub.url} (or a private one, no HF_TOKEN set)"]
