"""What identifies the source files, so that data prepared from them is never reused once they change.

    now = sources_fingerprint(files)      # {file: {"sha256"} | {"size", "mtime_ns", "ctime_ns"} | {"etag", ...}}
    saved = recorded(now)                 # what prepared data records: large local files hashed too
    changed = changed_sources(saved, now) # ["chat.jsonl: size 8123 -> 8190", ...]; [] if none

`files` is the listing of `data.paths` (raypack/data/listing.py's `Sources.of` computes both, once
per command). Per file, in that order (the example_id file order):

- a local file up to `HASH_BYTES`: a SHA-256 of its content, which alone decides, so copying or
  touching it without changing a byte keeps the prepared data;
- a larger local file: its size and its modification and status-change times (st_ctime moves on
  every write and can't be set back, so an edit whose mtime was restored is still seen). Where
  those differ but the size doesn't, its content decides: `recorded` adds a SHA-256 to what
  prepared data records, and `changed_sources` hashes the file again only then, so a touched file
  keeps its prepared data and an unchanged one is never read;
- an object-store URI: its ETag or object version where fsspec has a filesystem for the scheme
  (s3fs, gcsfs, adlfs) that reports one, else the size and modification time that pyarrow's
  listing gives (S3's LastModified has one-second resolution: a same-size re-upload within the
  second goes unnoticed there).

Cost: no listing of its own (it is given the one a command made), one stat per file (or one HEAD
per object for the ETag), and reading only the small files. It does not grow with rows: 10M rows in
100 JSONL files of 100 MB is 100 stats and no reads, but for one read of each file when data is
prepared from it (`recorded`; preparing reads it all anyway) and of a file whose times moved; 10M
rows in 10M tiny files would hash 10M files, where a sharded layout (fewer, larger files) is the
fix anyway.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from raypack.storage import is_uri, resolve

HASH_BYTES = 1 << 20
"""Local files up to this size are identified by a content hash, larger ones by size and times."""
_TIMES = ("mtime_ns", "ctime_ns")
_STAT = ("size", *_TIMES)


def sources_fingerprint(files) -> dict[str, dict[str, Any]]:
    """{file: identity} for every (file, kind) of `files`; see the module docstring."""
    out = {}
    for path, _ in files:
        fs, p = resolve(path)
        if is_uri(path):
            out[path] = _object_identity(path, fs.get_file_info(p))
        elif (st := os.stat(p)).st_size <= HASH_BYTES:
            out[path] = {"sha256": _sha256(fs, p)}
        else:
            out[path] = _stat_identity(st)
    return out


def recorded(fingerprint: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`fingerprint` as data prepared from its files records it: each large local file with the
    SHA-256 of its content too, so that a later `changed_sources` can tell a touch from an edit.
    One read of each (in threads: hashlib releases the GIL), once per process and file version. A
    file whose stat no longer matches the listing has changed since, perhaps under the read that
    prepared the data: it gets no hash, and so reads as changed from then on."""
    large = [(f, *(ident.get(k) for k in _STAT)) for f, ident in fingerprint.items()
             if not is_uri(f) and "mtime_ns" in ident and "sha256" not in ident]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        hashes = {key[0]: digest for key, digest in zip(large, pool.map(lambda key: _sha256_if_unchanged(*key), large))}
    return {f: {**ident, "sha256": hashes[f]} if hashes.get(f) else ident for f, ident in fingerprint.items()}


def changed_sources(saved: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[str]:
    """One line per difference between two fingerprints: added, removed and changed files. A large
    local file whose times moved but not its size is hashed here, and unchanged if its content is."""
    lines = [f"{f}: new file" for f in now if f not in saved]
    lines += [f"{f}: removed" for f in saved if f not in now]
    lines += [f"{f}: {why}" for f in now if f in saved and (why := _difference(f, saved[f], now[f]))]
    if not lines and list(saved) != list(now):
        lines.append("the files are the same but in another order, which renumbers every example")
    return lines


def _difference(path: str, was: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why `path` is not the file `was` describes, or None if it is."""
    if was == new:
        return None
    if "size" not in was or "size" not in new:  # a small file, identified by its hash alone
        return "content changed"
    if was.get("etag") != new.get("etag"):
        return f"etag {was.get('etag')} -> {new.get('etag')}"
    if was["size"] != new["size"]:
        return f"size {was['size']} -> {new['size']} bytes"
    moved = [k for k in _TIMES if k in was and k in new and was[k] != new[k]]  # older manifests lack ctime_ns
    if not moved:
        return None
    if "sha256" in was:  # same size, other times: a touch, a copy or an edit; the content says which
        try:
            same = _sha256(*resolve(path)) == was["sha256"]
        except OSError as e:
            return f"can't read it ({e.strerror or e})"
        return None if same else f"content changed (modified {_date(new['mtime_ns'])})"
    if "mtime_ns" in moved:
        return f"modified {_date(was['mtime_ns'], new['mtime_ns'])} -> {_date(new['mtime_ns'], was['mtime_ns'])}"
    return f"rewritten at {_date(new['ctime_ns'])} with the same size and modification time"


def _date(ns: int, other: int | None = None) -> str:
    """A nanosecond timestamp as an ISO date in UTC: to the second, or as finely as it takes to
    tell it from `other` (two times within a second)."""
    when = datetime.fromtimestamp(ns // 10**9, tz=timezone.utc).isoformat().removesuffix("+00:00")
    digits = next((d for d in (0, 3, 6) if other is None or ns // 10 ** (9 - d) != other // 10 ** (9 - d)), 9)
    return f"{when}{'.' if digits else ''}{str(ns % 10**9).zfill(9)[:digits]}Z"


def _stat_identity(st: os.stat_result) -> dict[str, Any]:
    return dict(zip(_STAT, (st.st_size, st.st_mtime_ns, st.st_ctime_ns)))


@functools.lru_cache(maxsize=4096)  # a sweep prepares several configs from one listing
def _sha256_if_unchanged(path: str, *stat: int | None) -> str | None:
    """The file's hash, if its stat (`_STAT`) is still the listing's from before to after the read."""
    fs, p = resolve(path)
    listed = dict(zip(_STAT, stat))
    try:
        if _stat_identity(os.stat(p)) != listed:
            return None
        digest = _sha256(fs, p)
        return digest if _stat_identity(os.stat(p)) == listed else None
    except OSError:  # removed since the listing: the next check says so
        return None


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
