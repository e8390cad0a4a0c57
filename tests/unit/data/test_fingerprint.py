"""What identifies the sources: content for small files, size and times (then content) for large
ones, ETag for objects; and the one-line differences that the refusal to reuse packed data names."""

from __future__ import annotations

import hashlib
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


def test_large_files_by_size_and_times(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "HASH_BYTES", 4)
    path = tmp_path / "a.jsonl"
    path.write_text("0123456789\n")
    os.utime(path, ns=(10**18, 10**18))
    before = Sources.of((str(path),)).fingerprint
    assert before == {str(path): {"size": 11, "mtime_ns": 10**18, "ctime_ns": os.stat(path).st_ctime_ns}}
    os.utime(path, ns=(2 * 10**18, 2 * 10**18))
    # without a recorded hash (a manifest from before `recorded`), the times decide; shown as dates
    assert changed_sources(before, Sources.of((str(path),)).fingerprint) == [
        f"{path}: modified 2001-09-09T01:46:40Z -> 2033-05-18T03:33:20Z"]
    old = {str(path): {"size": 11, "mtime_ns": 10**18 + 5}}  # no ctime_ns: compared on what both have
    os.utime(path, ns=(10**18, 10**18))
    assert changed_sources(old, Sources.of((str(path),)).fingerprint) == [
        f"{path}: modified 2001-09-09T01:46:40.000000005Z -> 2001-09-09T01:46:40.000000000Z"]
    path.write_text("0123456789 and more\n")
    assert changed_sources(before, Sources.of((str(path),)).fingerprint) == [f"{path}: size 11 -> 20 bytes"]


def test_a_touched_large_file_is_recognised_by_its_content(tmp_path, monkeypatch):
    """What prepared data records carries a large file's hash; the file is read again only when
    its times moved, and then its content decides: a touch or a copy keeps the prepared data, a
    same-size edit doesn't, even with its mtime put back (its ctime can't be)."""
    monkeypatch.setattr(fingerprint, "HASH_BYTES", 4)
    path = tmp_path / "a.jsonl"
    path.write_text("0123456789\n")
    saved = fingerprint.recorded(Sources.of((str(path),)).fingerprint)
    assert saved[str(path)]["sha256"] == hashlib.sha256(b"0123456789\n").hexdigest()
    reads = []
    monkeypatch.setattr(fingerprint, "_sha256", lambda fs, p, read=fingerprint._sha256: reads.append(p) or read(fs, p))
    assert changed_sources(saved, Sources.of((str(path),)).fingerprint) == [] and reads == []  # untouched: no read

    os.utime(path, ns=(2 * 10**18, 2 * 10**18))  # touched
    assert changed_sources(saved, Sources.of((str(path),)).fingerprint) == [] and reads == [str(path)]

    mtime = os.stat(path).st_mtime_ns
    path.write_text("9123456789\n")  # same size, new content, and the mtime put back
    os.utime(path, ns=(mtime, mtime))
    assert changed_sources(saved, Sources.of((str(path),)).fingerprint) == [
        f"{path}: content changed (modified 2033-05-18T03:33:20Z)"]


def test_a_file_changed_while_it_was_prepared_records_no_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "HASH_BYTES", 4)
    path = tmp_path / "a.jsonl"
    path.write_text("0123456789\n")
    listed = Sources.of((str(path),)).fingerprint
    path.write_text("9123456789\n")  # after the listing, before the manifest: the hash would be of other data
    assert fingerprint.recorded(listed) == listed
    assert changed_sources(fingerprint.recorded(listed), Sources.of((str(path),)).fingerprint)


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
