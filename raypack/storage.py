"""Paths that may be local folders or URIs (s3://, gs://, ...): one pyarrow filesystem for both.

Multi-node runs keep their packed data and run files under a shared `run.storage_path`, usually
object storage, so every file raypack writes outside Ray's own checkpoints goes through here.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    return "://" in path


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it); local paths become absolute."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), str(Path(path).expanduser().resolve())


def exists(path: str) -> bool:
    fs, p = resolve(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def read_text(path: str) -> str:
    fs, p = resolve(path)
    with fs.open_input_stream(p) as f:
        return f.read().decode()


def write_text(path: str, text: str) -> None:
    fs, p = resolve(path)
    fs.create_dir(p.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(p) as f:
        f.write(text.encode())


def remove_dir(path: str) -> None:
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.NotFound:
        fs.delete_dir(p)


def list_files(path: str, suffix: str = "") -> list[str]:
    """Files directly under `path` ending in `suffix`, sorted by name; [] if it doesn't exist."""
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(p))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))
