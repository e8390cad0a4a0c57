"""Stage 1b: read JSONL, Parquet and `save_to_disk` datasets into one Ray Dataset of raw examples.

    ds, report = read_sources_with_report(cfg.data, sources)  # good rows; report.bad_rows, .formats
    check_rows_here(cfg.data, sources, vocab_size)            # every row validated here, no Ray

`sources` is the command's one listing of `data.paths` (raypack/data/listing.py); a read unit of
a mixture's source reads by that source's `format`, and with its `columns` renamed to the format's
fields (`renamed`). Each input file is one or more read units (a JSONL file or a newline-aligned byte range of a large
one, a Parquet row group, an Arrow file of a `save_to_disk` folder) that a Ray task parses and
validates, so every row keeps its file and its line or row number. That gives every example a stable identity and every bad row an error that
says where it is:

    example_id = file_index << 42 | row << 10 | piece

`file_index` is the file's position in the expanded, sorted list of `data.paths` (< 2**21),
`row` the 0-based line (JSONL) or row (Parquet, Arrow) in that file (< 2**32), and `piece` is 0
here; tokenize's `split` policy numbers the pieces of a long example 0, 1, 2, ... (< 2**10). Ids
are the same on every run over the same files; they are unique but not dense. Messages name a
row as its reader would look for it (`row_name`): `chat.jsonl line 4` (from 1, as editors count)
and `data.parquet row 3 (0-based)` (as pyarrow and pandas index rows).

Output rows share one schema (`SCHEMA`): `example_id`, `format` and the fields of that format
(raypack/data/formats.py says what each format holds), the others null. A chat row with images
(image parts, or `images` with <image> placeholders) becomes a `vision` row: its messages in parts
(`vision_messages`, JSON) and its images' encoded bytes (`images`), read and decoded here, so a
missing or undecodable image is a bad row like any other (raypack/data/images.py); a preference
row whose prompt has images, a `vision_preference` row, the same way (raypack/data/vision_pairs.py).
Bad rows (malformed JSON, a missing field, an empty conversation, an unknown role, non-string content) stop the read under `on_bad_rows: error`, naming the first one in file order;
under `skip` they are counted and reported. An empty or unreadable file is always an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypack.config import DataConfig
from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.data.formats import ONE_FORMAT, FormatError, detect, renamed, renames, tokenized_columns, validate
from raypack.data.hub import cause as hub_cause, task_env
from raypack.data.images import ImageError, has_images, read_record
from raypack.data.listing import MAX_ROWS, Sources, read_units
from raypack.data.vision_pairs import KIND as PAIR_KIND, read_pair_record
from raypack.errors import SourceError
from raypack.storage import resolve  # local paths and s3://, gs:// URIs through one pyarrow filesystem

FILE_SHIFT, ROW_SHIFT = 42, 10
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
"""A preference pair's messages. A chat row's `messages` (and its `tools`) are JSON instead
(raypack/data/chat.py): tool-call arguments may be objects or strings, and key by key."""
SCHEMA = pa.schema(
    [
        ("example_id", pa.int64()),
        ("format", pa.string()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("instruction", pa.string()),
        ("input", pa.string()),
        ("output", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("prompt_messages", _MESSAGES),
        ("chosen_messages", _MESSAGES),
        ("rejected_messages", _MESSAGES),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("vision_messages", pa.string()),
        ("images", pa.list_(pa.binary())),
        ("error", pa.string()),
        ("fatal", pa.bool_()),
    ]
)


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


def row_name(path: str, kind: str, row: int) -> str:
    """How every message names a row: `file line N` for JSONL, counted from 1 as editors count
    lines, and `file row N (0-based)` for Parquet and Arrow, as pyarrow and pandas index rows."""
    return f"{path} line {row + 1}" if kind == "jsonl" else f"{path} row {row} (0-based)"


def row_location(eid: int, files: list[tuple[str, str]]) -> str:
    """The `row_name` of an example id; `files` is `Sources.files`."""
    file_index, row, _ = locate(int(eid))
    return row_name(*files[file_index], row)


# --- reading and validating one unit --------------------------------------------------------------


def _records(unit: dict, table: pa.Table | None = None):
    """(row, where, record-or-FormatError) for every row of a unit (of `table`, if already read),
    plus the column names for detection."""
    names = renames(unit)
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
                rows.append((i, row_name(path, "jsonl", i), renamed(json.loads(line), names)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                rows.append((i, row_name(path, "jsonl", i), FormatError(f"malformed JSON ({e})")))
        if stop < 0 and not rows:
            raise SourceError(f"{path}: empty file (no JSON lines)")
        if len(lines) > MAX_ROWS:
            raise SourceError(f"{path}: more than {MAX_ROWS} lines in one file; split the file")
        if unit["keys"]:  # a chunk: the fields of the file's first object (see _jsonl_units)
            return rows, list(renamed(dict.fromkeys(json.loads(unit["keys"])), names))
        first = next((r for _, _, r in rows if isinstance(r, dict)), {})
        return rows, first.keys()
    table = table if table is not None else _table(unit)
    start = unit["row_offset"]
    rows = [(start + i, row_name(path, unit["kind"], start + i), rec) for i, rec in enumerate(table.to_pylist())]
    return rows, table.column_names


def _table(unit: dict) -> pa.Table:
    """The rows of a Parquet or Arrow unit (its columns named as its source's `columns` say)."""
    fs, p = resolve(unit["path"])
    if unit["kind"] == "parquet":
        table = pq.ParquetFile(p, filesystem=fs).read_row_group(unit["row_group"])
    else:
        with fs.open_input_file(p) as f:
            table = pa.ipc.open_stream(f).read_all()
        if table.num_rows == 0:
            raise SourceError(f"{unit['path']}: empty file (no rows)")
    names = renames(unit)
    if names:
        # a column named in `columns` wins over one that already has the field's name (as `renamed`)
        keep = [c for c in table.column_names if c in names or c not in set(names.values())]
        table = table.select(keep).rename_columns([names.get(c, c) for c in keep])
    return table


def _tokenized_unit(unit: dict, table: pa.Table, vocab_size: int | None = None) -> pa.Table | None:
    """The rows of a tokenized Parquet or Arrow unit in SCHEMA, validated column-wise
    (formats.tokenized_columns); None if its types need the per-record path."""
    columns = tokenized_columns(table, vocab_size)
    if columns is None:
        return None
    ids, labels, errors = columns
    n, start = table.num_rows, unit["row_offset"]
    located = [None if e is None else f"{row_name(unit['path'], unit['kind'], start + i)}: {e}"
               for i, e in enumerate(errors)]
    data = {name: pa.nulls(n, SCHEMA.field(name).type) for name in SCHEMA.names}
    data.update(example_id=pa.array((int(unit["file_index"]) << FILE_SHIFT) | ((start + np.arange(n, dtype=np.int64)) << ROW_SHIFT)),
                format=pa.array(["tokenized"] * n, pa.string()), input_ids=ids, labels=labels,
                error=pa.array(located, pa.string()), fatal=pa.array(np.zeros(n, dtype=bool)))
    return pa.table(data, schema=SCHEMA)


def read_unit(batch: dict[str, np.ndarray], declared: str, vocab_size: int | None = None,
              max_image_pixels: int | None = MAX_IMAGE_PIXELS) -> pa.Table:
    """Ray Data map_batches function: the units in `batch` -> rows in SCHEMA (errors in `error`).
    `vocab_size`, when known, bounds the token ids of pre-tokenized rows; `max_image_pixels`
    (data.max_image_pixels) the images of image+text rows."""
    out = {name: [] for name in SCHEMA.names}
    tables = []  # in unit order: a column-wise unit flushes the per-record rows gathered before it
    for k in range(len(batch["path"])):
        unit = {key: batch[key][k] for key in batch}
        unit["row_offset"] = int(unit["row_offset"])
        declared_here = unit.get("format") or declared  # a source's own format, else data.format
        try:
            table = None if unit["kind"] == "jsonl" else _table(unit)
            if table is not None and detect(table.column_names, declared_here, unit["path"]) == "tokenized":
                if (fast := _tokenized_unit(unit, table, vocab_size)) is not None:
                    tables += [pa.Table.from_pydict(out, schema=SCHEMA), fast]
                    out = {name: [] for name in SCHEMA.names}
                    continue
            rows, keys = _records(unit, table)
            fmt = detect(keys, declared_here, unit["path"])
        except (SourceError, FormatError, OSError) as e:
            # A file-level problem travels as a row: an exception raised in a Ray task reaches the
            # driver wrapped, with its type and message buried in a traceback dump.
            message = _file_error(str(unit["path"]), e)
            for name in SCHEMA.names:
                out[name].append(None)
            out["example_id"][-1], out["error"][-1], out["fatal"][-1] = example_id(int(unit["file_index"]), 0), message, True
            continue
        detected = "" if declared_here != "auto" else "first row" if unit["kind"] == "jsonl" else "columns"
        for row, at, rec in rows:
            kind = fmt
            try:
                if isinstance(rec, FormatError):
                    raise rec
                if fmt in ("chat", "preference") and has_images(rec):  # read here, beside their text
                    read, kind = (read_record, "vision") if fmt == "chat" else (read_pair_record, PAIR_KIND)
                    fields, error = read(rec, _folder(unit["path"]), at, max_image_pixels), None
                else:
                    fields, error = validate(rec, fmt, vocab_size, detected), None
            except FormatError as e:
                fields, error = {}, f"{at}: {e}"
            except ImageError as e:  # names the row already
                fields, error = {}, str(e)
            kind = "chat" if kind == "sharegpt" else kind  # read as chat messages: encoded as chat
            fields.update(example_id=example_id(int(unit["file_index"]), row), format=kind, error=error, fatal=False)
            for name in SCHEMA.names:
                out[name].append(fields.get(name))
    return pa.concat_tables([*tables, pa.Table.from_pydict(out, schema=SCHEMA)])


def _file_error(path: str, e: Exception) -> str:
    """The message of a file-level problem. A hub dataset's file that a read task can't read (its
    node has no HF_TOKEN for a gated dataset, the hub went away) is named with the cause, as the
    listing names it; any other OSError is raised again, as before."""
    if not isinstance(e, OSError):
        return str(e)
    if path.startswith("hf://") and (why := hub_cause(e)):
        return f"{path}: can't read it: {why}"
    raise e


def _folder(path: str) -> str:
    """The folder of a data file (a path or URI): what an image path in it is relative to."""
    return path.rsplit("/", 1)[0] if "/" in path else "."


def _drop_bad(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.is_null(batch["error"])).drop_columns(["error", "fatal"])


def read_rows(cfg: DataConfig, sources: Sources, vocab_size: int | None = None) -> ray.data.Dataset:
    """Every row of `sources` in SCHEMA, bad ones carrying `error` (and `fatal` for a file-level
    problem), as a lazy dataset that streams into the next stage."""
    units = read_units(sources.files, sources.reading)
    return ray.data.from_items(units, override_num_blocks=len(units)).map_batches(
        read_unit, batch_size=1, num_cpus=0.5,
        fn_kwargs={"declared": cfg.format, "vocab_size": vocab_size, "max_image_pixels": cfg.max_image_pixels},
        **task_env(sources.files),
    )


def rows_here(cfg: DataConfig, sources: Sources, vocab_size: int | None = None) -> list[pa.Table]:
    """Every row of `sources` read in this process, without Ray: one table per read unit, in
    SCHEMA, bad rows flagged as `read_rows` flags them. Raises the SourceError that reading them
    with Ray would (the first bad row in file order), unless data.on_bad_rows=skip lets them by."""
    tables = [read_unit({k: [v] for k, v in unit.items()}, cfg.format, vocab_size, cfg.max_image_pixels)
              for unit in read_units(sources.files, sources.reading)]
    rows, errors, fatal = 0, [], []
    for table in tables:
        bad = pc.is_valid(table["error"])
        rows += table.num_rows - pc.sum(bad.cast(pa.int64())).as_py()
        b = table.filter(bad)
        for eid, msg, is_fatal in zip(b["example_id"].to_pylist(), b["error"].to_pylist(), b["fatal"].to_pylist()):
            (fatal if is_fatal else errors).append((eid, msg))
    _raise_bad_rows(errors, fatal, cfg.on_bad_rows, rows)
    return tables


def check_rows_here(cfg: DataConfig, sources: Sources, vocab_size: int | None = None) -> np.ndarray:
    """`rows_here`, for small local data, so that a bad row fails in a second instead of after
    Ray starts; returns the number of good rows of each file (in `sources.files` order)."""
    good = np.zeros(len(sources.files), dtype=np.int64)
    for t in rows_here(cfg, sources, vocab_size):
        if t.num_rows:
            good[locate(t["example_id"][0].as_py())[0]] += pc.sum(pc.is_null(t["error"]).cast(pa.int64())).as_py() or 0
    return good


def _raise_bad_rows(errors: list[tuple[int, str]], fatal: list[tuple[int, str]], on_bad_rows: str, good: int) -> None:
    """The first bad row in file order as a SourceError, unless on_bad_rows=skip; an empty or
    unreadable file whatever on_bad_rows says. `good`: the rows that skipping would keep."""
    if fatal:
        raise SourceError(min(fatal)[1])
    if errors and on_bad_rows == "error":
        first = min(errors)
        # Skipping drops every row of a mixed file's other formats (seen: 11 of 15), so the hint
        # says what it would keep rather than offering skip as the fix.
        rest = len(errors) - 1
        other = sum(ONE_FORMAT in msg for _, msg in errors) - (ONE_FORMAT in first[1])  # of the rest
        noun = "row" if rest == 1 else "rows"
        kinds = (f"{noun} of another format" if other == rest else
                 f"bad {noun}, {other} of another format" if other else f"bad {noun}")
        more = (f" ({rest} more {kinds}; data.on_bad_rows=skip would keep {good} of {good + len(errors)} rows)"
                if rest else "")
        raise SourceError(first[1] + more)


def read_sources_with_report(cfg: DataConfig, sources: Sources,
                             vocab_size: int | None = None) -> tuple[ray.data.Dataset, SourceReport]:
    """Read and validate every source; the dataset holds only good rows, materialized."""
    ds = read_rows(cfg, sources, vocab_size).materialize()
    report = SourceReport(files=len(sources.files))
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
    _raise_bad_rows(errors, fatal, cfg.on_bad_rows, report.rows)
    errors.sort()  # file order, whatever order the read tasks finished in
    report.bad_rows = len(errors)
    report.bad_examples = [msg for _, msg in errors[:5]]
    if errors:
        ds = ds.map_batches(_drop_bad, batch_format="pyarrow", batch_size=None).materialize()
    else:
        ds = ds.drop_columns(["error", "fatal"])
    return ds, report
