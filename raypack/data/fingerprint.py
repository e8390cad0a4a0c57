"""What identifies the source files, so that data prepared from them is never reused once they change.

    now = sources_fingerprint(files)      # {file: {"size", "mtime_ns" | "sha256" | "etag"}}
    changed = changed_sources(saved, now) # ["chat.jsonl: size 8123 -> 8190", ...]; [] if none

`files` is the listing of `data.paths` (raypack/data/listing.py's `Sources.of` computes both, once
per command). Per file, in that order (the example_id file order):

- a local file up to `HASH_BYTES`: a SHA-256 of its content, which alone decides, so copying or
  touching it without changing a byte keeps the prepared data;
- a larger local file: its size and modification time (nanoseconds);
- an object-store URI: its ETag or object version where fsspec has a filesystem for the scheme
  (s3fs, gcsfs, adlfs) that reports one, else the size and modification time that pyarrow's
  listing gives (S3's LastModified has one-second resolution: a same-size re-upload within the
  second goes unnoticed there).

Cost: no listing of its own (it is given the one a command made), one stat per file
(or one HEAD per object for the ETag), and reading only the small files. It does not grow with
rows: 10M rows in 100 JSONL files of 100 MB is 100 stats and no reads; 10M rows in 10M tiny files
would hash 10M files, where a sharded layout (fewer, larger files) is the fix anyway.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow.fs as pafs

from raypack.storage import is_uri, resolve

HASH_BYTES = 1 << 20
"""Local files up to this size are identified by a content hash, larger ones by size and mtime."""


def sources_fingerprint(files) -> dict[str, dict[str, Any]]:
    """{file: identity} for every (file, kind) of `files`; see the module docstring."""
    out = {}
    for path, _ in files:
        fs, p = resolve(path)
        info = fs.get_file_info(p)
        if is_uri(path):
            out[path] = _object_identity(path, info)
        elif info.size <= HASH_BYTES:
            out[path] = {"sha256": _sha256(fs, p)}
        else:
            out[path] = {"size": info.size, "mtime_ns": info.mtime_ns}
    return out


def changed_sources(saved: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[str]:
    """One line per difference between two fingerprints: added, removed and changed files."""
    lines = [f"{f}: new file" for f in now if f not in saved]
    lines += [f"{f}: removed" for f in saved if f not in now]
    for f in now:
        if f in saved and saved[f] != now[f]:
            was, new = saved[f], now[f]
            if "sha256" in was or "sha256" in new:
                lines.append(f"{f}: content changed")
                continue
            keys = [k for k in ("etag", "size", "mtime_ns") if was.get(k) != new.get(k)]
            lines.append(f"{f}: " + ", ".join(f"{k} {was.get(k)} -> {new.get(k)}" for k in keys))
    if not lines and list(saved) != list(now):
        lines.append("the files are the same but in another order, which renumbers every example")
    return lines


def _sha256(fs: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _object_identity(uri: str, info: pafs.FileInfo) -> dict[str, Any]:
    """ETag or version from fsspec where its filesystem for the scheme is installed; pyarrow's
    FileInfo carries neither, only size and mtime, which are the fallback."""
    try:
        import fsspec

        fs, p = fsspec.core.url_to_fs(uri)
        meta = fs.info(p)
    except (ImportError, ValueError, OSError):  # no fsspec filesystem for this scheme here
        meta = {}
    for key in ("VersionId", "ETag", "etag", "generation", "md5Hash"):
        if meta.get(key):
            return {"etag": str(meta[key]), "size": info.size}
    return {"size": info.size, "mtime_ns": info.mtime_ns}
