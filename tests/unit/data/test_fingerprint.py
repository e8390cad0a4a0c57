"""What identifies the sources: content for small files, size and mtime for large ones, ETag for
objects; and the one-line differences that the refusal to reuse packed data names."""

from __future__ import annotations

import os
import types

from raypack.data import fingerprint
from raypack.data.fingerprint import changed_sources
from raypack.data.listing import Sources


def test_small_files_by_content(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n')
    before = Sources.of((str(path),)).fingerprint
    os.utime(path, ns=(1, 1))  # touched, not changed
    assert changed_sources(before, Sources.of((str(path),)).fingerprint) == []
    path.write_text('{"prompt": "a", "completion": "c"}\n')  # same size, new content
    assert changed_sources(before, Sources.of((str(path),)).fingerprint) == [f"{path}: content changed"]


def test_large_files_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "HASH_BYTES", 4)
    path = tmp_path / "a.jsonl"
    path.write_text("0123456789\n")
    os.utime(path, ns=(10**18, 10**18))
    before = Sources.of((str(path),)).fingerprint
    assert before == {str(path): {"size": 11, "mtime_ns": 10**18}}
    os.utime(path, ns=(2 * 10**18, 2 * 10**18))
    assert changed_sources(before, Sources.of((str(path),)).fingerprint) == [f"{path}: mtime_ns {10**18} -> {2 * 10**18}"]


def test_added_removed_and_reordered_files(tmp_path):
    (tmp_path / "d").mkdir()
    a, b = tmp_path / "d" / "a.jsonl", tmp_path / "d" / "b.jsonl"
    a.write_text("{}\n")
    before = Sources.of((str(tmp_path / "d"),)).fingerprint
    b.write_text("{}\n")
    assert changed_sources(before, Sources.of((str(tmp_path / "d"),)).fingerprint) == [f"{b}: new file"]
    assert changed_sources(Sources.of((str(b), str(a))).fingerprint, before) == [f"{b}: removed"]
    # the same files, listed in another order, renumber every example
    assert changed_sources(Sources.of((str(a), str(b))).fingerprint, Sources.of((str(b), str(a))).fingerprint)


def test_objects_by_etag_where_fsspec_reports_one(monkeypatch):
    """pyarrow's FileInfo has no ETag; fsspec's S3/GCS filesystems do, when installed."""
    import fsspec

    info = types.SimpleNamespace(size=10, mtime_ns=5)
    fake = types.SimpleNamespace(info=lambda p: {"ETag": '"abc"', "size": 10})
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda uri: (fake, uri))
    assert fingerprint._object_identity("s3://b/a.jsonl", info) == {"etag": '"abc"', "size": 10}

    def no_filesystem(uri):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_filesystem)
    assert fingerprint._object_identity("s3://b/a.jsonl", info) == {"size": 10, "mtime_ns": 5}
