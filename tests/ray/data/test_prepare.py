"""Driver-side preparation on a local Ray cluster: packed data is reused only while its sources are
unchanged, and data that trains on nothing is refused before anything is packed."""

from __future__ import annotations

import json
import os

import pytest

from raypack.config import ASSETS, InputError, load
from raypack.data.encode import TokenizeError
from raypack.data.prepare import SourcesChangedError, prepare, reusable

LINES = (ASSETS / "sample" / "chat.jsonl").read_text().splitlines()[:40]


def cfg_for(path, *overrides):
    return load(None, [f"data.paths=[{path}]", "pack.budget=512", "pack.strategy=bfd", *overrides])


def test_a_source_edited_under_an_existing_run_is_refused(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    cfg, root = cfg_for(path), str(tmp_path / "packed")
    first = prepare(cfg, 2, root)
    os.utime(path, ns=(1, 1))  # touched: same bytes, reused
    assert prepare(cfg, 2, root) == first

    path.write_text("\n".join(LINES[:-1] + [LINES[0]]) + "\n")  # the last line edited in place
    with pytest.raises(SourcesChangedError, match=rf"data.paths changed since .*: {path}: content changed.*run.name="):
        reusable(cfg, 2, root)
    with pytest.raises(SourcesChangedError):
        prepare(cfg, 2, root)  # never a silent reuse of the old packs
    again = prepare(cfg, 2, root, reprepare=True)
    assert again.stats["examples_in"] == first.stats["examples_in"] and again == prepare(cfg, 2, root)
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert list(manifest["sources"]) == [str(path)]


def test_data_without_a_label_token_is_refused_before_packing(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    no_answer = {"messages": [{"role": "user", "content": "hello?"}]}
    path.write_text((json.dumps(no_answer) + "\n") * 6)
    with pytest.raises(TokenizeError, match=rf"nothing to train on: of 6 examples, 6 had no token that carries loss \(first: {path}:1\)"):
        prepare(cfg_for(path), 2, str(tmp_path / "packed"))
    assert not (tmp_path / "packed").exists()


def test_a_rank_without_a_label_token_is_refused(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(LINES[0] + "\n")  # one example for two ranks
    with pytest.raises(InputError, match="rank 1 of 2 gets no label token"):
        prepare(cfg_for(path, "data.eval_fraction=0"), 2, str(tmp_path / "packed"))
