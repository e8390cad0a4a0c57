"""Stage 1 on a local Ray cluster: every source kind with stable ids, and bad rows named in file order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raypack.config import ASSETS, DataConfig
from raypack.data.listing import Sources
from raypack.data.sources import locate, read_sources_with_report
from raypack.errors import SourceError

pytestmark = pytest.mark.ray
SAMPLE = ASSETS / "sample"


def test_reads_all_source_kinds_with_stable_ids(ray_local, tmp_path, monkeypatch):
    """Local JSONL, Parquet and save_to_disk files, and a hub dataset's file (tests/fakehub.py),
    which Ray's read tasks read over HfFileSystem from the hub that listed it."""
    import datasets

    from fakehub import FakeHub, point_at, sample_repos

    hub = point_at(FakeHub(sample_repos()).start(), monkeypatch, tmp_path)
    datasets.Dataset.from_dict({"prompt": ["p0", "p1", "p2"], "completion": ["c0", "c1", "c2"]}).save_to_disk(tmp_path / "hf")
    paths = (str(SAMPLE / "chat.jsonl"), str(SAMPLE / "tokenized.parquet"), str(tmp_path / "hf"),
             "hf://datasets/fake/chat/test.jsonl")
    cfg = DataConfig(paths=paths)
    ds, report = read_sources_with_report(cfg, Sources.of(cfg.paths))
    assert report.files == 4 and report.bad_rows == 0
    assert report.formats == {"chat": 303, "tokenized": 300, "completion": 3} and report.rows == 606
    # the ids alone: on the second read Ray 2.55.1's to_pandas failed to cast input_ids (ragged,
    # absent from the chat rows) to its TensorArray; the ids are all this test reads
    ids = np.sort(ds.select_columns(["example_id"]).to_pandas()["example_id"].to_numpy())
    assert len(np.unique(ids)) == len(ids)
    assert sorted({locate(int(i))[0] for i in ids}) == [0, 1, 2, 3]
    assert any(r.startswith("GET /datasets/fake/chat/resolve/") for r in hub.requests)  # by a read task
    again = read_sources_with_report(cfg, Sources.of(cfg.paths))[0].select_columns(["example_id"])
    assert np.array_equal(ids, np.sort(again.to_pandas()["example_id"].to_numpy()))
    hub.stop()


def test_bad_rows_error(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path.write_text("\n".join([good, "{oops", good, json.dumps({"messages": []}), good]) + "\n")
    with pytest.raises(SourceError) as e:
        read_sources_with_report(DataConfig(paths=(str(path),)), Sources.of((str(path),)))
    assert str(e.value).startswith(f"{path} line 2: malformed JSON") and "1 more bad row;" in str(e.value)
    # a file-level error raised inside a read task reaches the caller as our message
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SourceError, match=r"empty\.jsonl: empty file"):
        read_sources_with_report(DataConfig(paths=(str(tmp_path / "empty.jsonl"),)), Sources.of((str(tmp_path / "empty.jsonl"),)))
