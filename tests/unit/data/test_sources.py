"""Source parsing and validation, one read unit at a time (no Ray): formats, ids, error messages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypack.data import listing, sources
from raypack.data.listing import list_sources, read_units
from raypack.data.sources import example_id, locate
from raypack.errors import SourceError


def read(path, declared="auto"):
    units = read_units(list_sources((str(path),)))
    tables = [sources.read_unit({k: [u[k]] for k in u}, declared) for u in units]
    rows = pa.concat_tables(tables).to_pylist()
    for r in rows:  # what read_sources_with_report does with a file-level problem
        if r["fatal"]:
            raise SourceError(r["error"])
    return rows


def jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_example_id_layout():
    eid = example_id(3, 7, 2)
    assert locate(eid) == (3, 7, 2)
    assert example_id(0, 1) == 1024 and example_id(1, 0) == 1 << 42


@pytest.mark.parametrize(
    "record,fmt",
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "chat"),
        ({"instruction": "add", "input": "1 2", "output": "3"}, "instruction"),
        ({"instruction": "add", "output": "3"}, "instruction"),
        ({"prompt": "a", "completion": "b"}, "completion"),
        ({"input_ids": [1, 2, 3]}, "tokenized"),
        ({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, "tokenized"),
    ],
)
def test_formats_detected_from_fields(tmp_path, record, fmt):
    rows = read(jsonl(tmp_path / "a.jsonl", [record, record]))
    assert [r["format"] for r in rows] == [fmt, fmt] and all(r["error"] is None for r in rows)
    assert [r["example_id"] for r in rows] == [example_id(0, 0), example_id(0, 1)]
    if fmt == "instruction":
        assert rows[0]["input"] == record.get("input", "")


def test_ids_follow_file_and_line_and_are_stable(tmp_path):
    (tmp_path / "d").mkdir()
    jsonl(tmp_path / "d" / "b.jsonl", [{"prompt": "x", "completion": "y"}])
    jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "x", "completion": "y"}, "", {"prompt": "z", "completion": "w"}])
    first, second = read(tmp_path / "d"), read(tmp_path / "d")
    assert first == second
    # a.jsonl sorts first; the blank line 2 is skipped but keeps line numbering
    assert [locate(r["example_id"])[:2] for r in first] == [(0, 0), (0, 2), (1, 0)]


BAD_LINES = [
    ("{not json", "malformed JSON"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be a string or a list of content parts, got int"),
    ({"messages": [{"role": "user", "content": None}]}, "content must be a string or a list of content parts, got NoneType"),
    ({"messages": "hello"}, "`messages` must be a list"),
    ({"prompt": "only"}, "missing field `messages`"),
    ("[1, 2]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize("bad,problem", BAD_LINES)
def test_bad_jsonl_row_names_file_line_and_problem(tmp_path, bad, problem):
    good = {"messages": [{"role": "user", "content": "hi"}]}
    path = jsonl(tmp_path / "chat.jsonl", [good, good, bad])
    rows = read(path)
    assert [r["error"] is None for r in rows] == [True, True, False]
    assert rows[2]["error"].startswith(f"{path} line 3: ") and problem in rows[2]["error"]


@pytest.mark.parametrize(
    "declared,record,problem",
    [
        ("instruction", {"instruction": "a"}, "missing field `output` (instruction format)"),
        ("completion", {"prompt": "a", "completion": ["b"]}, "field `completion` must be a string, got list"),
        ("tokenized", {"input_ids": []}, "`input_ids` must be a non-empty list"),
        ("tokenized", {"input_ids": [1, 2], "labels": [1]}, "`labels` has 1 entries but `input_ids` has 2"),
    ],
)
def test_declared_format_field_errors(tmp_path, declared, record, problem):
    rows = read(jsonl(tmp_path / "x.jsonl", [record]), declared)
    assert rows[0]["error"].startswith(f"{tmp_path / 'x.jsonl'} line 1: {problem}")


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
INSTRUCTION = {"instruction": "add", "output": "3"}


def test_a_row_of_another_format_is_named_as_such(tmp_path):
    rows = read(jsonl(tmp_path / "c09.jsonl", [INSTRUCTION, CHAT, {"prompt": "a", "completion": "b"}]))
    assert [r["error"] for r in rows] == [None] + [
        f"{tmp_path / 'c09.jsonl'} line {n}: a {fmt} row, but the file's first row is an instruction row; one format "
        "per file: split the file, or set data.format" for n, fmt in ((2, "chat"), (3, "completion"))]
    # Parquet: the columns pick the format, and a row of another format has nulls in its columns
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"prompt": ["a", None], "completion": ["b", None], "instruction": [None, "add"],
                             "output": [None, "3"]}), path)
    assert [r["error"] for r in read(path)] == [f"{path} row 0 (0-based): a completion row, but the file's columns "
                                                "make it instruction; one format per file: split the file, or set "
                                                "data.format", None]
    # a declared format names the missing field, as for any other row that lacks it
    assert read(jsonl(tmp_path / "x.jsonl", [CHAT]), "instruction")[0]["error"].endswith(
        "line 1: missing field `instruction` (instruction format)")


@pytest.mark.parametrize("lines,hint", [
    ([INSTRUCTION, CHAT, CHAT, INSTRUCTION], "1 more row of another format; data.on_bad_rows=skip would keep 2 of 4 rows"),
    ([INSTRUCTION, "{oops", CHAT, {"instruction": "x"}, CHAT], "3 more bad rows, 2 of another format; "
                                                                "data.on_bad_rows=skip would keep 1 of 5 rows"),
    ([CHAT, "{oops", {"messages": []}], "1 more bad row; data.on_bad_rows=skip would keep 1 of 3 rows"),
])
def test_the_first_bad_row_says_what_skipping_would_keep(tmp_path, lines, hint):
    from raypack.config import DataConfig
    from raypack.data.listing import Sources

    path = jsonl(tmp_path / "a.jsonl", lines)
    with pytest.raises(SourceError) as e:
        sources.check_rows_here(DataConfig(paths=(str(path),)), Sources.of((str(path),)))
    assert str(e.value).startswith(f"{path} line 2: ") and str(e.value).endswith(f" ({hint})")


def test_empty_file_and_unknown_format_are_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SourceError, match=r"empty\.jsonl: empty file"):
        read(tmp_path / "empty.jsonl")
    with pytest.raises(SourceError, match=r"can't tell the format from the fields \['text'\]"):
        read(jsonl(tmp_path / "t.jsonl", [{"text": "x"}]))
    with pytest.raises(SourceError, match="no such file"):
        read(tmp_path / "missing.jsonl")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(SourceError, match=r"e\.parquet: empty file"):
        read(tmp_path / "e.parquet")


def test_parquet_rows_across_row_groups(tmp_path):
    n = 25
    prompts = [f"p{i}" for i in range(n)]
    completions = [f"c{i}" if i != 17 else None for i in range(n)]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt": prompts, "completion": completions}), path, row_group_size=10)
    rows = read(path)
    assert [locate(r["example_id"])[1] for r in rows] == list(range(n))
    assert [r["prompt"] for r in rows if r["error"] is None] == [p for i, p in enumerate(prompts) if i != 17]
    assert rows[17]["error"] == f"{path} row 17 (0-based): missing field `completion` (completion format)"


def test_save_to_disk_folder(tmp_path):
    import datasets

    msgs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(6)]
    msgs[4] = [{"role": "user", "content": "q"}, {"role": "wizard", "content": "a"}]
    datasets.Dataset.from_dict({"messages": msgs}).save_to_disk(tmp_path / "hf", num_shards=2)
    rows = read(tmp_path / "hf")
    assert [r["format"] for r in rows] == ["chat"] * 6
    assert [json.loads(r["messages"])[0]["content"] for r in rows if r["error"] is None] == ["q0", "q1", "q2", "q3", "q5"]
    bad = rows[4]["error"]
    assert "data-00001-of-00002.arrow row 1 (0-based): " in bad and "unknown role 'wizard'" in bad
    # a DatasetDict folder reads its train split
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})}).save_to_disk(tmp_path / "dd")
    assert read(tmp_path / "dd")[0]["format"] == "completion"


def test_bundled_samples_are_valid():
    from raypack.config import ASSETS

    for name, fmt in [("chat.jsonl", "chat"), ("instruction.jsonl", "instruction"), ("completion.jsonl", "completion"), ("tokenized.parquet", "tokenized")]:
        rows = read(ASSETS / "sample" / name)
        assert len(rows) >= 200 and all(r["error"] is None and r["format"] == fmt for r in rows)


def test_large_jsonl_reads_in_chunks_with_exact_lines_and_ids(tmp_path, monkeypatch):
    recs = [{"prompt": f"p{i}" * (i % 7 + 1), "completion": f"c{i}"} for i in range(200)]
    lines = [recs[i] if i not in (150, 151) else "" for i in range(200)]  # blank lines keep their numbers
    lines[173] = "{broken"
    lines[10] = {"prompt": "x" * 300, "completion": "a line longer than a chunk"}
    path = jsonl(tmp_path / "big.jsonl", lines)
    whole = read(path)
    monkeypatch.setattr(listing, "CHUNK_BYTES", 64)  # about 3 lines a chunk
    units = read_units(list_sources((str(path),)))
    assert len(units) > 20 and [u["row_offset"] for u in units] == sorted(u["row_offset"] for u in units)
    # each unit on its own, in reverse order, gives the same rows as the file read whole
    tables = [sources.read_unit({k: [u[k]] for k in u}, "auto") for u in reversed(units)]
    chunked = sorted(pa.concat_tables(tables).to_pylist(), key=lambda r: r["example_id"])
    assert chunked == whole and len(whole) == 198
    assert [locate(r["example_id"])[1] for r in chunked] == [i for i in range(200) if i not in (150, 151)]
    assert [r["error"] for r in chunked if r["error"]] == [f"{path} line 174: malformed JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"]
    # a later chunk that starts with a bad line still takes the file's format
    assert {r["format"] for r in chunked} == {"completion"}


def test_tokenized_parquet_columnwise_matches_per_record_validation(tmp_path, monkeypatch):
    """The column-wise check of a tokenized Parquet unit gives the same rows, ids and messages,
    in the same order, as validating one record at a time."""
    ids = [[1, 2, 3], [], [4, -1], None, [5, None], [6, 7], [8, 9], [10], [11, 12], [13]]
    labels = [[-100, 2, 3], [1], [1, 2], [1], None, [1], [1, None], None, [1, 2], [-100]]
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())), "labels": pa.array(labels, pa.list_(pa.int64()))}),
                   path, row_group_size=4)
    fast = read(path, "tokenized")
    monkeypatch.setattr(sources, "_tokenized_unit", lambda *a: None)  # force the per-record path
    slow = read(path, "tokenized")
    assert fast == slow
    errors = [r["error"] and r["error"].split(": ", 1)[1] for r in fast]
    assert errors == [None, "`input_ids` must be a non-empty list of non-negative ints",
                      "`input_ids` must be a non-empty list of non-negative ints", "missing field `input_ids` (tokenized format)",
                      "`input_ids` must be a non-empty list of non-negative ints", "`labels` has 1 entries but `input_ids` has 2",
                      "`labels` must be a list of ints", None, None, None]
    assert fast[8]["input_ids"] == [11, 12] and fast[8]["labels"] == [1, 2] and fast[7]["labels"] is None
    assert [locate(r["example_id"])[1] for r in fast] == list(range(len(ids)))


def test_tokenized_columns_falls_back_for_other_types():
    from raypack.data.formats import tokenized_columns

    assert tokenized_columns(pa.table({"input_ids": pa.array([[1.0, 2.0]])})) is None
    assert tokenized_columns(pa.table({"input_ids": pa.array([[1, 2**40]])})) is None
    ids, labels, errors = tokenized_columns(pa.table({"input_ids": pa.array([[1, 2]], pa.large_list(pa.int16()))}))
    assert ids.type == pa.list_(pa.int32()) and ids.to_pylist() == [[1, 2]] and labels.to_pylist() == [None] and errors == [None]


def test_tokenized_columnwise_vocab_bound_matches_per_record(tmp_path, monkeypatch):
    ids = [[1, 2, 3], [1, 50], [4, 5], [6, 7], [8, 99, 70]]
    labels = [[-100, 2, 3], [1, 2], [-100, 64], [-5, 1], None]
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), path)
    units = read_units(list_sources((str(path),)))

    def rows():
        return sources.read_unit({k: [units[0][k]] for k in units[0]}, "tokenized", vocab_size=64).to_pylist()

    fast = rows()
    monkeypatch.setattr(sources, "_tokenized_unit", lambda *a: None)
    assert fast == rows()
    assert [r["error"] and r["error"].split(": ", 1)[1] for r in fast] == [
        None, None, "labels[1] = 64 is outside the model's vocabulary (ids 0..63, or -100 for no loss)",
        "labels[0] = -5 is outside the model's vocabulary (ids 0..63, or -100 for no loss)",
        "input_ids[1] = 99 is outside the model's vocabulary (ids 0..63)"]
