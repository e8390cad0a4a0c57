"""Stage 1a: what `data.paths` stand for, listed once per command, and how they are cut into read units.

    sources = Sources.of_data(cfg.data)    # the files, in example_id file order, and their identity
    units = read_units(sources.files, sources.reading)   # what one Ray task reads: a file, a row group, a byte range

A mixture (`data.sources`) lists each source's paths in turn, its files after the previous
source's: `Sources.owners` says which source each file is of (raypack/data/mixture.py finds an
example's source from its file), `Sources.reading` how its rows read (the source's own format and
column names, which its read units carry), and messages about a source name it by index and paths.

A configured path is a file, a folder of files, or a `save_to_disk` folder (a Dataset, or a
DatasetDict's `train` split), local or any URI pyarrow reads, or a Hugging Face Hub dataset
(`org/name`, `hf://datasets/...`: raypack/data/hub.py lists the files of its config and split). Listing them is a remote LIST per
path on object storage, so a command lists once and passes the `Sources` record along: preflight
checks each file's format from it, the read and the tokenizer stage number rows by it, and data
preparation keys its caches by its fingerprint (raypack/data/fingerprint.py says what identifies
a file). A missing path, an empty folder or an unreachable URI fails here, before any Ray work,
naming `data.paths` (or the source).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raypack.config import DataConfig
from raypack.config.sections import SourceConfig, source_where
from raypack.data.fingerprint import sources_fingerprint
from raypack.data.hub import choice, hub_files, is_hub_path
from raypack.errors import SourceError
from raypack.storage import is_uri, resolve

CHUNK_BYTES = 4 << 20
"""A JSONL file larger than this is read as several units of about this size, so that one large
file still reads on every core and its first rows reach tokenize before its last are parsed."""
MAX_FILES, MAX_ROWS = 1 << 21, 1 << 32
"""example_id has 21 bits for the file and 32 for the row (raypack/data/sources.py)."""


@dataclass(frozen=True)
class Sources:
    """The source files of `data.paths` (or of every `data.sources` item, in their order): what a
    command lists once and passes to every stage."""

    files: tuple[tuple[str, str], ...]
    """(path, kind) of every file, in example_id file order; kind is jsonl, parquet or arrow."""
    fingerprint: dict[str, dict[str, Any]]
    """{path: identity} (raypack/data/fingerprint.py): what a cache of data made from them records."""
    owners: tuple[int, ...] = ()
    """The `data.sources` index of every file, in the order of `files`; empty for `data.paths`."""
    reading: tuple[tuple[str, str], ...] = ()
    """How every file's rows read, where its source says so: (its format, its `columns` as JSON,
    or ""); empty for `data.paths`, whose files read by `data.format`."""
    labels: tuple[str, ...] = ()
    """How messages name each of `data.sources`: its index and paths (`config.source_where`)."""

    @classmethod
    def of(cls, paths: tuple[str, ...]) -> Sources:
        files = tuple(list_sources(paths))
        return cls(files, sources_fingerprint(files))

    @classmethod
    def of_data(cls, data: DataConfig) -> Sources:
        """The listing of `data.paths`, or of each of `data.sources`' paths, a source's files
        after the previous source's."""
        if not data.sources:
            return cls.of(data.paths)
        files, owners, reading = [], [], []
        for i, source in enumerate(data.sources):
            listed = list_sources(source.paths, source_where(i, source.paths), source)
            files += listed
            owners += [i] * len(listed)
            columns = json.dumps(source.columns, sort_keys=True) if source.columns else ""
            reading += [(source.format or data.format, columns)] * len(listed)
        labels = tuple(source_where(i, s.paths) for i, s in enumerate(data.sources))
        return cls(tuple(files), sources_fingerprint(files), tuple(owners), tuple(reading), labels)

    def where(self, file_index: int) -> str:
        """How a message names the source of a file: `data.paths`, or `data.sources[i] (paths: ...)`."""
        return self.labels[self.owners[file_index]] if self.owners else "data.paths"


def _kind(path: str) -> str | None:
    for suffix, kind in ((".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".arrow", "arrow")):
        if path.endswith(suffix):
            return kind
    return None


def _expand(path: str, where: str = "data.paths", source: SourceConfig | None = None) -> list[tuple[str, str]]:
    """(path, kind) of every file a configured path stands for; `where` names the setting in messages.
    `source`: the `data.sources` item, whose config, split and revision choose a hub dataset's files."""
    hub = choice(source)
    if is_hub_path(path):
        return hub_files(path, where, **hub)
    if hub:
        raise SourceError(f"{where}: {', '.join(hub)} choose a Hugging Face Hub dataset's files; {path} is a local path")
    try:
        return _expand_reachable(path, where)
    except OSError as e:
        # pyarrow's own message is about bucket regions, credentials or curl codes; say which
        # configured path it was, and keep pyarrow's first line for the reason.
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(f"{where}: {path}: can't read it ({reason})") from e


def _expand_reachable(path: str, where: str = "data.paths") -> list[tuple[str, str]]:
    fs, p = resolve(path)
    info = fs.get_file_info(p)
    prefix = path[: len(path) - len(p)] if is_uri(path) else ""
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"{where}: {path}: no such file or folder")
    if info.type == pafs.FileType.File:
        if _kind(p) is None:
            raise SourceError(f"{where}: {path}: unknown file type; expected .jsonl, .json, .parquet or a save_to_disk folder")
        return [(path, _kind(p))]
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(p))}
    if "dataset_dict.json" in names:  # a DatasetDict: read its train split
        if "train" not in names:
            raise SourceError(f"{path}: a saved DatasetDict without a `train` split; point {where} at a split folder")
        return _expand_reachable(f"{path.rstrip('/')}/train", where)
    if "state.json" in names:  # Dataset.save_to_disk: Arrow stream files listed in state.json
        with fs.open_input_stream(f"{p}/state.json") as f:
            state = json.loads(f.read())
        return [(f"{prefix}{p}/{d['filename']}", "arrow") for d in state["_data_files"]]
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(p)) if i.is_file and _kind(i.path))
    if not files:
        raise SourceError(f"{where}: {path}: folder holds no .jsonl, .json or .parquet files")
    return [(prefix + f, _kind(f)) for f in files]


def list_sources(paths: tuple[str, ...], where: str = "data.paths", source: SourceConfig | None = None) -> list[tuple[str, str]]:
    """(path, kind) of every source file, in example_id file order; kind is jsonl, parquet or arrow.
    One listing per configured path and no reads: a missing path, an empty folder or an
    unreachable URI fails here, before any Ray work, naming `where` (`data.paths`, or a source)."""
    return [f for p in paths for f in _expand(p, where, source)]


def read_units(files: tuple[tuple[str, str], ...], reading: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """The read units of `files` (a `Sources.files`): each a dict one Ray task reads. `reading`
    (a `Sources.reading`): each file's own format and column names, which its units carry."""
    if len(files) >= MAX_FILES:
        raise SourceError(f"data.paths: {len(files)} files; at most {MAX_FILES - 1} are supported")
    units = []
    for i, (path, kind) in enumerate(files):
        before = len(units)
        if kind == "parquet":  # one unit per row group, so one large file still reads in parallel
            fs, p = resolve(path)
            meta = pq.ParquetFile(p, filesystem=fs).metadata
            if meta.num_rows == 0:
                raise SourceError(f"{path}: empty file (no rows)")
            if meta.num_rows > MAX_ROWS:
                raise SourceError(f"{path}: more than {MAX_ROWS} rows in one file; split the file")
            offset = 0
            for g in range(meta.num_row_groups):
                units.append(_unit(i, path, kind, row_group=g, row_offset=offset))
                offset += meta.row_group(g).num_rows
        elif kind == "jsonl":
            units += _jsonl_units(i, path)
        else:
            units.append(_unit(i, path, kind))
        if reading:
            for unit in units[before:]:
                unit["format"], unit["columns"] = reading[i]
    return units


def source_bytes(sources: Sources) -> int | None:
    """The bytes of every source file together; None where a store reports no size."""
    sizes = []
    for path, _ in sources.files:
        fs, p = resolve(path)
        sizes.append(fs.get_file_info(p).size)
    return None if any(size is None for size in sizes) else sum(sizes)


@functools.cache
def known_rows(files: tuple[tuple[str, str], ...]) -> int | None:
    """Rows in `files` (a `Sources.files`) when their footers say so (every file Parquet), else
    None: a JSONL file's rows are known only once it is read. For progress lines, asked off the
    critical path (raypack/data/progress.py), once per listing."""
    if not files or any(kind != "parquet" for _, kind in files):
        return None
    total = 0
    for path, _ in files:
        fs, p = resolve(path)
        total += pq.ParquetFile(p, filesystem=fs).metadata.num_rows
    return total


def _unit(file_index: int, path: str, kind: str, row_group=-1, row_offset=0, start=0, stop=-1, keys="") -> dict:
    # Every unit has every field: Ray Data wants one schema across the units' blocks.
    # format and columns: a source's own (Sources.reading); "" reads by data.format, names as they are
    return dict(file_index=file_index, path=path, kind=kind, row_group=row_group, row_offset=row_offset, start=start,
                stop=stop, keys=keys, format="", columns="")


def _jsonl_units(i: int, path: str) -> list[dict]:
    """The whole file, or byte ranges of about CHUNK_BYTES cut after a newline. The driver reads the
    file once to count the newlines before each cut (each unit's first line number, for ids and
    error messages) and to find the first JSON object, whose fields pick every unit's format."""
    whole = _unit(i, path, "jsonl")
    fs, p = resolve(path)
    size = fs.get_file_info(p).size
    if size <= CHUNK_BYTES:
        return [whole]
    units, start, line, keys, nonblank = [], 0, 0, None, False
    with fs.open_input_file(p) as f:
        while start < size:
            n = CHUNK_BYTES
            while True:
                data = f.read_at(n, start)
                cut = len(data) if start + len(data) >= size else data.rfind(b"\n") + 1
                if cut:
                    break
                n *= 2  # one line longer than a chunk
            data = data[:cut]
            nonblank = nonblank or bool(data.strip())
            for raw in data.split(b"\n") if keys is None else ():
                try:
                    rec = json.loads(raw)
                except ValueError:  # malformed or blank; the read task reports it
                    continue
                if isinstance(rec, dict):
                    keys = sorted(rec)
                    break
            units.append({**whole, "row_offset": line, "start": start, "stop": start + cut})
            line, start = line + data.count(b"\n"), start + cut
    if not nonblank:
        return [whole]  # the read task reports the empty file
    if line >= MAX_ROWS:
        raise SourceError(f"{path}: more than {MAX_ROWS} lines in one file; split the file")
    return [{**u, "keys": json.dumps(keys or [])} for u in units]
