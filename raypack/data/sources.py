"""Stage 1: read JSONL, Parquet and `save_to_disk` datasets into one Ray Dataset of raw examples.

    ds, report = read_sources_with_report(cfg.data)  # good rows; report.bad_rows, report.formats, ...
    files = list_sources(cfg.data.paths)             # the listing alone, no reads, no Ray
    check_rows_here(cfg.data, vocab_size)            # every row validated in this process, no Ray

Each input file is one or more read units (a JSONL file or a newline-aligned byte range of a large
one, a Parquet row group, an Arrow file of a `save_to_disk` folder) that a Ray task parses and
validates, so every row keeps its file and its line or row number. That gives every example a stable identity and every bad row an error that
says where it is:

    example_id = file_index << 42 | row << 10 | piece

`file_index` is the file's position in the expanded, sorted list of `data.paths` (< 2**21),
`row` the 0-based line (JSONL) or row (Parquet, Arrow) in that file (< 2**32), and `piece` is 0
here; tokenize's `split` policy numbers the pieces of a long example 0, 1, 2, ... (< 2**10). Ids
are the same on every run over the same files; they are unique but not dense.

Output rows share one schema (`SCHEMA`): `example_id`, `format` and the fields of that format
(raypack/data/formats.py says what each format holds), the others null. Bad rows (malformed JSON, a missing field, an empty conversation, an unknown role,
non-string content) stop the read under `on_bad_rows: error`, naming the first one in file order;
under `skip` they are counted and reported. An empty or unreadable file is always an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from raypack.config import DataConfig, InputError
from raypack.data.formats import FormatError, detect, validate
from raypack.storage import is_uri, resolve  # local paths and s3://, gs:// URIs through one pyarrow filesystem

FILE_SHIFT, ROW_SHIFT = 42, 10
CHUNK_BYTES = 4 << 20
"""A JSONL file larger than this is read as several units of about this size, so that one large
file still reads on every core and its first rows reach tokenize before its last are parsed."""
MAX_FILES, MAX_ROWS = 1 << 21, 1 << 32
SCHEMA = pa.schema(
    [
        ("example_id", pa.int64()),
        ("format", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("instruction", pa.string()),
        ("input", pa.string()),
        ("output", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("error", pa.string()),
        ("fatal", pa.bool_()),
    ]
)


class SourceError(InputError):
    """A source file or row is unreadable or invalid; the message names the file and the row."""


@dataclass
class SourceReport:
    files: int = 0
    rows: int = 0
    """Good rows passed on to tokenize."""
    bad_rows: int = 0
    """Rows skipped under `on_bad_rows: skip` (always 0 under `error`, which raises instead)."""
    bad_examples: list[str] = field(default_factory=list)
    """The first few bad rows' messages, in file order."""
    formats: dict[str, int] = field(default_factory=dict)
    """Good rows per format."""


def example_id(file_index: int, row: int, piece: int = 0) -> int:
    return (file_index << FILE_SHIFT) | (row << ROW_SHIFT) | piece


def locate(eid: int) -> tuple[int, int, int]:
    """(file_index, row, piece) of an example id."""
    return eid >> FILE_SHIFT, (eid >> ROW_SHIFT) & (MAX_ROWS - 1), eid & ((1 << ROW_SHIFT) - 1)


def row_location(eid: int, files: list[tuple[str, str]]) -> str:
    """`file:line` (JSONL) or `file row N` of an example id, as bad-row messages name rows;
    `files` is `list_sources(cfg.paths)`."""
    file_index, row, _ = locate(int(eid))
    path, kind = files[file_index]
    return f"{path}:{row + 1}" if kind == "jsonl" else f"{path} row {row}"


# --- listing: paths -> read units -----------------------------------------------------------------


def _kind(path: str) -> str | None:
    for suffix, kind in ((".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".arrow", "arrow")):
        if path.endswith(suffix):
            return kind
    return None


def _expand(path: str) -> list[tuple[str, str]]:
    """(path, kind) of every file a configured path stands for."""
    try:
        return _expand_reachable(path)
    except OSError as e:
        # pyarrow's own message is about bucket regions, credentials or curl codes; say which
        # configured path it was, and keep pyarrow's first line for the reason.
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(f"data.paths: {path}: can't read it ({reason})") from e


def _expand_reachable(path: str) -> list[tuple[str, str]]:
    fs, p = resolve(path)
    info = fs.get_file_info(p)
    prefix = path[: len(path) - len(p)] if is_uri(path) else ""
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"data.paths: {path}: no such file or folder")
    if info.type == pafs.FileType.File:
        if _kind(p) is None:
            raise SourceError(f"data.paths: {path}: unknown file type; expected .jsonl, .json, .parquet or a save_to_disk folder")
        return [(path, _kind(p))]
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(p))}
    if "dataset_dict.json" in names:  # a DatasetDict: read its train split
        if "train" not in names:
            raise SourceError(f"{path}: a saved DatasetDict without a `train` split; point data.paths at a split folder")
        return _expand_reachable(f"{path.rstrip('/')}/train")
    if "state.json" in names:  # Dataset.save_to_disk: Arrow stream files listed in state.json
        with fs.open_input_stream(f"{p}/state.json") as f:
            state = json.loads(f.read())
        return [(f"{prefix}{p}/{d['filename']}", "arrow") for d in state["_data_files"]]
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(p)) if i.is_file and _kind(i.path))
    if not files:
        raise SourceError(f"data.paths: {path}: folder holds no .jsonl, .json or .parquet files")
    return [(prefix + f, _kind(f)) for f in files]


def list_sources(paths: tuple[str, ...]) -> list[tuple[str, str]]:
    """(path, kind) of every source file, in example_id file order; kind is jsonl, parquet or arrow.
    One listing per configured path and no reads: a missing path, an empty folder or an
    unreachable URI fails here, before any Ray work, naming `data.paths`."""
    return [f for p in paths for f in _expand(p)]


def _units(paths: tuple[str, ...]) -> tuple[list[dict], int]:
    files = list_sources(paths)
    if len(files) >= MAX_FILES:
        raise SourceError(f"data.paths: {len(files)} files; at most {MAX_FILES - 1} are supported")
    units = []
    for i, (path, kind) in enumerate(files):
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
    return units, len(files)


def _unit(file_index: int, path: str, kind: str, row_group=-1, row_offset=0, start=0, stop=-1, keys="") -> dict:
    # Every unit has every field: Ray Data wants one schema across the units' blocks.
    return dict(file_index=file_index, path=path, kind=kind, row_group=row_group, row_offset=row_offset, start=start, stop=stop, keys=keys)


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


# --- reading and validating one unit --------------------------------------------------------------


def _records(unit: dict):
    """(row, where, record-or-FormatError) for every row of a unit, plus the column names for detection."""
    fs, p = resolve(unit["path"])
    path = unit["path"]
    if unit["kind"] == "jsonl":
        start, stop, first_line = int(unit["start"]), int(unit["stop"]), unit["row_offset"]
        if stop < 0:
            with fs.open_input_stream(p) as f:
                lines = f.read().split(b"\n")
        else:
            with fs.open_input_file(p) as f:
                lines = f.read_at(stop - start, start).split(b"\n")
        rows = []
        for i, line in enumerate(lines, start=first_line):
            if not line.strip():  # blank lines (a trailing newline) are not examples
                continue
            try:
                rows.append((i, f"{path}:{i + 1}", json.loads(line)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                rows.append((i, f"{path}:{i + 1}", FormatError(f"malformed JSON ({e})")))
        if stop < 0 and not rows:
            raise SourceError(f"{path}: empty file (no JSON lines)")
        if len(lines) > MAX_ROWS:
            raise SourceError(f"{path}: more than {MAX_ROWS} lines in one file; split the file")
        if unit["keys"]:  # a chunk: the fields of the file's first object (see _jsonl_units)
            return rows, json.loads(unit["keys"])
        first = next((r for _, _, r in rows if isinstance(r, dict)), {})
        return rows, first.keys()
    if unit["kind"] == "parquet":
        table = pq.ParquetFile(p, filesystem=fs).read_row_group(unit["row_group"])
    else:
        with fs.open_input_file(p) as f:
            table = pa.ipc.open_stream(f).read_all()
        if table.num_rows == 0:
            raise SourceError(f"{path}: empty file (no rows)")
    start = unit["row_offset"]
    rows = [(start + i, f"{path} row {start + i}", rec) for i, rec in enumerate(table.to_pylist())]
    return rows, table.column_names


def read_unit(batch: dict[str, np.ndarray], declared: str, vocab_size: int | None = None) -> pa.Table:
    """Ray Data map_batches function: the units in `batch` -> rows in SCHEMA (errors in `error`).
    `vocab_size`, when known, bounds the token ids of pre-tokenized rows."""
    out = {name: [] for name in SCHEMA.names}
    for k in range(len(batch["path"])):
        unit = {key: batch[key][k] for key in batch}
        unit["row_offset"] = int(unit["row_offset"])
        try:
            rows, keys = _records(unit)
            fmt = detect(keys, declared, unit["path"])
        except (SourceError, FormatError) as e:
            # A file-level problem travels as a row: an exception raised in a Ray task reaches the
            # driver wrapped, with its type and message buried in a traceback dump.
            for name in SCHEMA.names:
                out[name].append(None)
            out["example_id"][-1], out["error"][-1], out["fatal"][-1] = example_id(int(unit["file_index"]), 0), str(e), True
            continue
        for row, where, rec in rows:
            try:
                if isinstance(rec, FormatError):
                    raise rec
                fields, error = validate(rec, fmt, vocab_size, detected=declared == "auto"), None
            except FormatError as e:
                fields, error = {}, f"{where}: {e}"
            fields.update(example_id=example_id(int(unit["file_index"]), row), format=fmt, error=error, fatal=False)
            for name in SCHEMA.names:
                out[name].append(fields.get(name))
    return pa.Table.from_pydict(out, schema=SCHEMA)


def _drop_bad(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.is_null(batch["error"])).drop_columns(["error", "fatal"])


def read_rows(cfg: DataConfig, vocab_size: int | None = None) -> tuple[ray.data.Dataset, int]:
    """Every row of `cfg.paths` in SCHEMA, bad ones carrying `error` (and `fatal` for a file-level
    problem), as a lazy dataset that streams into the next stage; and the number of files."""
    units, n_files = _units(cfg.paths)
    ds = ray.data.from_items(units, override_num_blocks=len(units)).map_batches(
        read_unit, batch_size=1, fn_kwargs={"declared": cfg.format, "vocab_size": vocab_size}, num_cpus=0.5
    )
    return ds, n_files


def check_rows_here(cfg: DataConfig, vocab_size: int | None = None) -> int:
    """Validate every row on this process, without Ray, raising the SourceError that reading
    them with Ray would (the first bad row in file order). For small local data, so that a bad
    row fails in a second instead of after Ray starts; returns the number of good rows."""
    units, _ = _units(cfg.paths)
    rows, errors, fatal = 0, [], []
    for unit in units:
        table = read_unit({k: [v] for k, v in unit.items()}, cfg.format, vocab_size)
        bad = pc.is_valid(table["error"])
        rows += table.num_rows - pc.sum(bad.cast(pa.int64())).as_py()
        b = table.filter(bad)
        for eid, msg, is_fatal in zip(b["example_id"].to_pylist(), b["error"].to_pylist(), b["fatal"].to_pylist()):
            (fatal if is_fatal else errors).append((eid, msg))
    _raise_bad_rows(errors, fatal, cfg.on_bad_rows)
    return rows


def _raise_bad_rows(errors: list[tuple[int, str]], fatal: list[tuple[int, str]], on_bad_rows: str) -> None:
    """The first bad row in file order as a SourceError, unless on_bad_rows=skip; an empty or
    unreadable file whatever on_bad_rows says."""
    if fatal:
        raise SourceError(min(fatal)[1])
    if errors and on_bad_rows == "error":
        first = min(errors)
        more = f" ({len(errors) - 1} more bad rows; data.on_bad_rows=skip skips them)" if len(errors) > 1 else ""
        raise SourceError(first[1] + more)


def read_sources_with_report(cfg: DataConfig, vocab_size: int | None = None) -> tuple[ray.data.Dataset, SourceReport]:
    """Read and validate every source; the dataset holds only good rows, materialized."""
    ds, n_files = read_rows(cfg, vocab_size)
    ds = ds.materialize()
    report = SourceReport(files=n_files)
    errors, fatal = [], []
    for batch in ds.select_columns(["format", "error", "fatal", "example_id"]).iter_batches(batch_format="pyarrow", batch_size=65536):
        bad = pc.is_valid(batch["error"])
        good = batch.filter(pc.invert(bad))
        for item in pc.value_counts(good["format"]).to_pylist():
            report.formats[item["values"]] = report.formats.get(item["values"], 0) + item["counts"]
        report.rows += good.num_rows
        if pc.any(bad).as_py():
            b = batch.filter(bad)
            for eid, msg, is_fatal in zip(b["example_id"].to_pylist(), b["error"].to_pylist(), b["fatal"].to_pylist()):
                (fatal if is_fatal else errors).append((eid, msg))
    _raise_bad_rows(errors, fatal, cfg.on_bad_rows)
    errors.sort()  # file order, whatever order the read tasks finished in
    report.bad_rows = len(errors)
    report.bad_examples = [msg for _, msg in errors[:5]]
    if errors:
        ds = ds.map_batches(_drop_bad, batch_format="pyarrow", batch_size=None).materialize()
    else:
        ds = ds.drop_columns(["error", "fatal"])
    return ds, report
