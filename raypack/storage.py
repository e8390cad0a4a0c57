"""Paths that may be local folders or URIs (s3://, gs://, ...): one pyarrow filesystem for both.

Multi-node runs keep their packed data and run files under a shared `run.storage_path`, usually
object storage, so every file raypack reads or writes outside Ray's own checkpoints goes through
here, and so does every "is this a URI?" question.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs

from raypack.errors import StorageError


def is_uri(path: str) -> bool:
    return "://" in path


def is_repo_id(name: str) -> bool:
    """Whether `name` could name a Hugging Face hub repo (`org/name`); a path such as ./tok or
    /a/b/c can't, so a missing one is the filesystem's business, not the hub's."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def absolute(path: str) -> str:
    """A URI as it is (less a trailing slash), a local path made absolute: the form Ray Train
    requires for a storage path and every process can use, whatever its working directory."""
    return path.rstrip("/") if is_uri(path) else str(Path(path).expanduser().resolve())


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it); local paths become absolute. A URI whose filesystem can't be
    reached (pyarrow asks S3 for the bucket's region here) is a StorageError naming it."""
    if path.startswith("hf://"):  # a Hugging Face Hub dataset's file (raypack/data/hub.py): fsspec's, wrapped
        return _hub_filesystem(), path[len("hf://"):]
    if is_uri(path):
        try:
            return pafs.FileSystem.from_uri(path)
        except OSError as e:
            raise StorageError(f"{path}: can't reach it: {e}") from e
    return pafs.LocalFileSystem(), absolute(path)


def _hub_filesystem() -> pafs.FileSystem:
    """HfFileSystem as pyarrow reads it: the hub's endpoint and token as huggingface_hub finds them
    in this process (HF_ENDPOINT, HF_TOKEN), so a Ray task reads with its node's own settings."""
    from huggingface_hub import HfFileSystem, constants

    return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem(endpoint=constants.ENDPOINT)))


def exists(path: str) -> bool:
    fs, p = resolve(path)
    try:
        return fs.get_file_info(p).type != pafs.FileType.NotFound
    except OSError as e:
        if not is_uri(path):
            raise
        raise StorageError(f"{path}: can't reach it: {e}") from e


def read_text(path: str) -> str:
    fs, p = resolve(path)
    with fs.open_input_stream(p) as f:
        return f.read().decode()


def write_bytes(path: str, data: bytes) -> None:
    """Write a file, creating its folder."""
    fs, p = resolve(path)
    fs.create_dir(p.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(p) as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def remove_dir(path: str) -> None:
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.NotFound:
        fs.delete_dir(p)


def download(path: str, local: str) -> None:
    """Copy the folder (or file) `path`, a URI or a local path, to the local path `local`."""
    fs, p = resolve(path)
    dest = Path(local).resolve()
    if fs.get_file_info(p).type == pafs.FileType.Directory:
        # copy_files writes into the folders it finds, but makes none of them
        dest.mkdir(parents=True, exist_ok=True)
        for info in fs.get_file_info(pafs.FileSelector(p, recursive=True)):
            if info.type == pafs.FileType.Directory:
                (dest / info.path[len(p):].lstrip("/")).mkdir(parents=True, exist_ok=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(p, str(dest), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


def upload(local: str, path: str) -> None:
    """Copy the local folder `local` to `path`, a URI or a local path (the reverse of `download`)."""
    fs, p = resolve(path)
    src = Path(local).resolve()
    # copy_files writes into the folders it finds, but makes none of them (object stores need none)
    fs.create_dir(p, recursive=True)
    for folder in (d for d in src.rglob("*") if d.is_dir()):
        fs.create_dir(f"{p}/{folder.relative_to(src).as_posix()}", recursive=True)
    pafs.copy_files(str(src), p, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def list_dirs(path: str, prefix: str = "") -> list[str]:
    """Names of the folders directly under `path` that start with `prefix`, sorted; [] if none."""
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(p))
    return sorted(name for i in infos if i.type == pafs.FileType.Directory and (name := i.base_name).startswith(prefix))


def list_files(path: str, suffix: str = "") -> list[str]:
    """Files directly under `path` ending in `suffix`, sorted by name; [] if it doesn't exist."""
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(p))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))


def file_sizes(path: str, suffix: str = "") -> list[tuple[str, int]]:
    """(path, bytes) of the files directly under `path` ending in `suffix`, sorted by name; each
    path as `resolve` takes it (a URI keeps its scheme); [] if the folder doesn't exist."""
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    scheme = path.split("://", 1)[0] + "://" if is_uri(path) else ""
    infos = fs.get_file_info(pafs.FileSelector(p))
    return sorted((scheme + i.path, i.size) for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))
