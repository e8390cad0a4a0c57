"""The example formats: which one a source holds, and whether a record is a valid example.

    chat         {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...],
                 "tools": [...] (optional)}: OpenAI messages, with content parts, tool calls and
                 reasoning (raypack/data/chat.py says what each field may hold)
    sharegpt     {"conversations": [{"from": "human" | "gpt" | ..., "value": str}, ...]}: read as chat
    instruction  {"instruction": str, "input": str (optional), "output": str}
    completion   {"prompt": str, "completion": str}
    tokenized    {"input_ids": [int >= 0, ...], "labels": [int, ...] (optional, same length)}
    preference   {"prompt": str, "chosen": str, "rejected": str}, or the three as chat messages
                 (a conversation, then the chosen and the rejected assistant turns), as TRL's
                 preference datasets hold them; without `prompt`, the shared start of chosen and
                 rejected is the prompt (TRL's implicit prompt, `preference_record`). Only
                 `train.objective: dpo` trains on it (raypack/data/pairs.py).

A source holds one format: with `data.format: auto` the first record (a JSONL file) or the
columns (Parquet, Arrow) pick it, and a later record of another format is an error that says so.
Token ids (and labels other than -100) must be below the model's vocabulary size when the caller
knows it.

A source of `data.sources` may name the fields otherwise (`columns: {prompt: question}`):
`renamed` reads its records, and its Parquet columns, as the format's fields before detection.

raypack/data/sources.py reads the records and adds where each one came from to the messages.
`tokenized_columns` is `validate` for a whole Arrow table of tokenized rows at once: a Parquet
source of pre-tokenized examples is checked without turning every token into a Python int
(360 ns a token that way, ~150 CPU-seconds per million WildChat-length examples;
benchmarks/prepare_scale.py), with the same messages for the same rows.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypack.data.chat import FormatError as ChatError
from raypack.data.chat import chat_fields

ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100
"""The label of a token that carries no loss: in tokenized rows, packed rows and batches alike."""
TRAINS_ON_IDS = None
"""The `labels` of a tokenized or packed row whose labels are its own input_ids (pre-tokenized
rows without labels, `label_mask: all`): stored once, as the ids, never as a second copy."""


def row_labels(row: dict) -> Any:
    """A tokenized or packed row's labels, its input_ids where they stand for them (TRAINS_ON_IDS)."""
    labels = row["labels"]
    return row["input_ids"] if labels is TRAINS_ON_IDS else labels


class FormatError(ValueError):
    """A record (or a source's fields) fits no format; the reader adds the file and the line."""


def detect(keys, declared: str, where: str) -> str:
    """The format of a source whose records have the fields `keys` (or `declared`, if not auto)."""
    if declared != "auto":
        return declared
    if "chosen" in keys and "rejected" in keys:
        return "preference"
    if "messages" in keys:
        return "chat"
    if "conversations" in keys:
        return "sharegpt"
    if "input_ids" in keys:
        return "tokenized"
    if "instruction" in keys and "output" in keys:
        return "instruction"
    if "prompt" in keys and "completion" in keys:
        return "completion"
    raise FormatError(
        f"{where}: can't tell the format from the fields {sorted(keys)}; expected `messages` (chat), "
        "`conversations` (sharegpt), `instruction`/`input`/`output`, `prompt`/`completion`, `input_ids` (+ `labels`) or `chosen`/`rejected` "
        "(+ `prompt`), or set data.format"
    )


def renames(unit: dict) -> dict[str, str]:
    """{column: field} of a unit whose source names its fields otherwise (`data.sources[].columns`)."""
    columns = unit.get("columns") or ""
    return {column: name for name, column in json.loads(columns).items()} if columns else {}


def renamed(rec, names: dict[str, str]):
    """A record with its source's column names read as the format's fields: a named column wins
    over one that already has the field's name."""
    if not names or not isinstance(rec, dict):
        return rec
    taken = set(names.values())
    out = {k: v for k, v in rec.items() if k not in taken or k in names}
    return {names.get(k, k): v for k, v in out.items()}


def _string(rec: dict[str, Any], key: str, fmt: str, optional: bool = False) -> str:
    value = rec.get(key)
    if value is None:
        if optional:
            return ""
        raise FormatError(f"missing field `{key}` ({fmt} format)")
    if not isinstance(value, str):
        raise FormatError(f"field `{key}` must be a string, got {type(value).__name__}")
    return value


ONE_FORMAT = "one format per file"
"""In every message about a row of another format than its file's: the reader counts those rows by it."""


def validate(rec: Any, fmt: str, vocab_size: int | None = None, detected: str = "") -> dict[str, Any]:
    """The record normalized to `fmt`'s fields of sources.SCHEMA, or a FormatError naming the
    problem. `detected`: what picked `fmt` when it was detected, `first row` (JSONL) or `columns`
    (Parquet, Arrow); empty when data.format declared it. Then a record that lacks `fmt`'s fields
    but fits another format is reported as what it is: a row of another format than its file's."""
    try:
        return _validate(rec, fmt, vocab_size)
    except FormatError:
        if detected and isinstance(rec, dict):
            try:  # a null field is an absent one: a Parquet row of another format has nulls in fmt's columns
                other = detect([k for k, v in rec.items() if v is not None], "auto", "")
            except FormatError:
                other = fmt
            if other != fmt:
                said = (f"the file's first row is {_a(fmt)} row" if detected == "first row"
                        else f"the file's columns make it {fmt}")
                fix = "split the file, or set data.format"
                raise FormatError(f"{_a(other)} row, but {said}; {ONE_FORMAT}: {fix}") from None
        raise


def _messages(messages: Any, key: str) -> list[dict[str, str]]:
    """A list of chat messages, each {role, content} with a known role and string content."""
    if not isinstance(messages, (list, tuple)):
        raise FormatError(f"`{key}` must be a list, got {type(messages).__name__}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FormatError(f"{key}[{j}] must be an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise FormatError(f"{key}[{j}]: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            raise FormatError(f"{key}[{j}]: {IMAGES_NOT_TRAINED}")
        if not isinstance(content, str):
            raise FormatError(f"{key}[{j}]: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


IMAGES_NOT_TRAINED = (
    "image data where raypack doesn't read it: raypack trains images in chat `messages` and in the prompt of "
    "conversational preference pairs (image parts, or `images` with <image> placeholders: raypack/data/images.py, "
    "docs/guides/vision.md), so this row would train without its pictures"
)


PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def preference_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A preference row normalized: standard (`prompt`, `chosen`, `rejected`: strings) or
    conversational (`prompt_messages`, `chosen_messages`, `rejected_messages`). Without a prompt,
    the shared start of chosen and rejected becomes it, as TRL's `extract_prompt` cuts it (whole
    messages; for strings, before the space that starts the first difference)."""
    values = {k: rec.get(k) for k in PREFERENCE_KEYS}
    for key in ("chosen", "rejected"):
        if values[key] is None:
            raise FormatError(f"missing field `{key}` (preference format)")
    conversational = isinstance(values["chosen"], (list, tuple))
    for key, value in values.items():
        if value is None:
            continue
        if conversational != isinstance(value, (list, tuple)) or not (conversational or isinstance(value, str)):
            want = "a list of messages, as `chosen` is" if conversational else "a string, as `chosen` is"
            raise FormatError(f"field `{key}` must be {want}, got {type(value).__name__}")
    if conversational:
        values = {k: None if v is None else _messages(v, k) for k, v in values.items()}
    if values["prompt"] is None:
        values = extract_prompt(values["chosen"], values["rejected"])
    if values["chosen"] == values["rejected"]:
        raise FormatError("`chosen` and `rejected` are the same completion: the pair prefers nothing")
    if conversational:
        for key in ("chosen", "rejected"):
            if not values[key]:
                raise FormatError(f"`{key}` holds no message after the prompt")
        return {f"{k}_messages": values[k] for k in PREFERENCE_KEYS}
    return dict(values)


def extract_prompt(chosen, rejected) -> dict[str, Any]:
    """TRL's `extract_prompt` (trl/data_utils.py), so that a pair splits where TRL splits it."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _a(fmt: str) -> str:
    return f"{'an' if fmt[0] in 'aeiou' else 'a'} {fmt}"


def _validate(rec: Any, fmt: str, vocab_size: int | None) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise FormatError(f"expected a JSON object, got {type(rec).__name__}")
    if fmt in ("chat", "sharegpt"):
        if rec.get("images"):  # placeholders would train as the text "<image>", without the pictures
            raise FormatError(f"`images`: {IMAGES_NOT_TRAINED}")
        try:
            return chat_fields(rec, fmt)
        except ChatError as e:
            raise FormatError(str(e)) from None
    if fmt == "preference":
        return preference_record(rec)
    if fmt == "instruction":
        return {
            "instruction": _string(rec, "instruction", fmt),
            "input": _string(rec, "input", fmt, optional=True),
            "output": _string(rec, "output", fmt),
        }
    if fmt == "completion":
        return {"prompt": _string(rec, "prompt", fmt), "completion": _string(rec, "completion", fmt)}
    ids, labels = rec.get("input_ids"), rec.get("labels")
    if ids is None:
        raise FormatError(MISSING_IDS)
    if not isinstance(ids, (list, tuple)) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise FormatError(BAD_IDS)
    if labels is not None:
        if not isinstance(labels, (list, tuple)) or not all(type(t) is int for t in labels):
            raise FormatError(BAD_LABELS)
        if len(labels) != len(ids):
            raise FormatError(f"`labels` has {len(labels)} entries but `input_ids` has {len(ids)}")
    if vocab_size is not None and (error := _vocab_error(ids, labels, vocab_size)):
        raise FormatError(error)
    return {"input_ids": list(ids), "labels": None if labels is None else list(labels)}


def _vocab_error(ids, labels, vocab_size: int) -> str | None:
    """The message for the first id outside the vocabulary (labels may also be -100), if any."""
    # An id past the embedding is an IndexError in a worker (a device-side assert on a GPU)
    # that names no row; here it names the file and the line.
    for key, values in (("input_ids", ids), ("labels", labels or ())):
        bad = next((j for j, t in enumerate(values) if t >= vocab_size or (t < 0 and t != IGNORE_INDEX)), None)
        if bad is not None:
            return (f"{key}[{bad}] = {values[bad]} is outside the model's vocabulary (ids 0..{vocab_size - 1}"
                    + (", or -100 for no loss)" if key == "labels" else ")"))
    return None


MISSING_IDS = "missing field `input_ids` (tokenized format)"
BAD_IDS = "`input_ids` must be a non-empty list of non-negative ints"
BAD_LABELS = "`labels` must be a list of ints"
_INT32 = np.iinfo(np.int32)


def _int_lists(column) -> pa.Array | None:
    """The column as one list array of integers, or None if it is anything else."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_null(array.type):
        return pa.nulls(len(array), pa.list_(pa.int32()))
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        return None
    return array if pa.types.is_integer(array.type.value_type) else None


def _rows_with(lists: pa.Array, bad_values: pa.Array) -> np.ndarray:
    """Mask of the rows of `lists` holding at least one flagged value."""
    rows = np.zeros(len(lists), dtype=bool)
    flagged = pc.list_parent_indices(lists).to_numpy()[bad_values.to_numpy(zero_copy_only=False)]
    rows[flagged] = True
    return rows


def tokenized_columns(table: pa.Table, vocab_size: int | None = None) -> tuple[pa.Array, pa.Array, list[str | None]] | None:
    """`validate` for every row of a tokenized table: (input_ids, labels) as list<int32> and each
    row's error message (None if valid; the ids and labels of a bad row are null). None when the
    column types need the per-record path (not integer lists, values beyond int32), which then
    gives its exact per-row messages."""
    n = table.num_rows
    ids = _int_lists(table["input_ids"]) if "input_ids" in table.column_names else pa.nulls(n, pa.list_(pa.int32()))
    labels = _int_lists(table["labels"]) if "labels" in table.column_names else pa.nulls(n, pa.list_(pa.int32()))
    if ids is None or labels is None:
        return None
    values, label_values = pc.list_flatten(ids), pc.list_flatten(labels)
    for v in (values, label_values):
        low, high = pc.min_max(v).values()
        if (low.as_py() or 0) < _INT32.min or (high.as_py() or 0) > _INT32.max:
            return None
    missing = pc.is_null(ids).to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy()
    bad_ids = ~missing & ((lengths == 0) | _rows_with(ids, pc.fill_null(pc.less(values, 0), True)))
    has_labels = pc.is_valid(labels).to_numpy(zero_copy_only=False)
    label_lengths = pc.fill_null(pc.list_value_length(labels), 0).to_numpy()
    bad_labels = has_labels & _rows_with(labels, pc.is_null(label_values))
    mismatch = has_labels & ~bad_labels & (label_lengths != lengths)
    errors: list[str | None] = [None] * n
    for i in np.flatnonzero(missing | bad_ids | bad_labels | mismatch).tolist():  # the order validate checks in
        errors[i] = (MISSING_IDS if missing[i] else BAD_IDS if bad_ids[i] else BAD_LABELS if bad_labels[i]
                     else f"`labels` has {label_lengths[i]} entries but `input_ids` has {lengths[i]}")
    if vocab_size is not None:  # only the few flagged rows go through Python, for validate's message
        outside = lambda v: pc.fill_null(pc.or_(pc.greater_equal(v, vocab_size),  # noqa: E731
                                                pc.and_(pc.less(v, 0), pc.not_equal(v, IGNORE_INDEX))), False)
        flagged = _rows_with(ids, outside(values)) | _rows_with(labels, outside(label_values))
        for i in np.flatnonzero(flagged).tolist():
            if errors[i] is None:
                errors[i] = _vocab_error(ids[i].as_py(), labels[i].as_py(), vocab_size)
    good = pa.array([e is None for e in errors], pa.bool_())
    keep = lambda a: pc.if_else(good, a.cast(pa.list_(pa.int32())), pa.scalar(None, pa.list_(pa.int32())))  # noqa: E731
    return keep(ids), keep(labels), errors
