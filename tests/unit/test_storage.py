"""One way to name, read and write a run's files, local or URI (here: local)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypack import storage


def test_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("runs") == str(tmp_path / "runs")
    assert storage.absolute("~/runs") == str(Path.home() / "runs")
    assert storage.absolute("s3://bucket/runs/") == "s3://bucket/runs"
    assert storage.is_uri("gs://b/x") and not storage.is_uri("/tmp/x")
    assert storage.resolve("runs")[1] == str(tmp_path / "runs")


def test_write_read_list_remove(tmp_path):
    root = f"{tmp_path}/run"
    storage.write_bytes(f"{root}/plots/p.png", b"\x89PNG")  # creates the folders
    storage.write_text(f"{root}/b.yaml", "b")
    storage.write_text(f"{root}/a.yaml", "a")
    assert (tmp_path / "run" / "plots" / "p.png").read_bytes() == b"\x89PNG"
    assert storage.read_text(f"{root}/a.yaml") == "a" and storage.exists(f"{root}/b.yaml")
    assert storage.list_files(root, ".yaml") == [f"{root}/a.yaml", f"{root}/b.yaml"]
    assert storage.list_files(f"{root}/missing") == []
    storage.remove_dir(root)
    assert not storage.exists(root)
    storage.remove_dir(root)  # removing what is gone is fine


def test_download_copies_a_folder_with_its_subfolders_or_one_file(tmp_path):
    storage.write_text(f"{tmp_path}/ckpt/ds/rank0.pt", "0")
    storage.write_text(f"{tmp_path}/ckpt/latest", "ds")
    storage.download(f"file://{tmp_path}/ckpt", f"{tmp_path}/copy")  # file:// stands for any URI
    assert (tmp_path / "copy" / "ds" / "rank0.pt").read_text() == "0" and (tmp_path / "copy" / "latest").read_text() == "ds"
    storage.download(f"file://{tmp_path}/ckpt/latest", f"{tmp_path}/one/latest")
    assert (tmp_path / "one" / "latest").read_text() == "ds"


def test_a_uri_that_cant_be_reached_is_one_line_naming_it(monkeypatch):
    """pyarrow asks S3 for a bucket's region when it resolves the URI: no network or no such bucket
    was an OSError traceback; it is an InputError naming the URI (the CLI prints it as one line)."""
    import types

    import pyarrow.fs as pafs

    from raypack.errors import StorageError

    def unreachable(uri):
        raise OSError("When resolving region for bucket 'b': AWS Error NETWORK_CONNECTION")

    monkeypatch.setattr(storage, "pafs", types.SimpleNamespace(FileSystem=types.SimpleNamespace(from_uri=unreachable),
                                                             FileType=pafs.FileType, LocalFileSystem=pafs.LocalFileSystem))
    with pytest.raises(StorageError, match=r"^s3://b/run: can't reach it: When resolving region"):
        storage.exists("s3://b/run")
