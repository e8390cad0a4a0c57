"""The four example formats: which one a source holds, and whether a record is a valid example.

    chat         {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
    instruction  {"instruction": str, "input": str (optional), "output": str}
    completion   {"prompt": str, "completion": str}
    tokenized    {"input_ids": [int >= 0, ...], "labels": [int, ...] (optional, same length)}

A source holds one format: with `data.format: auto` the first record picks it, and a later record
of another format is an error that says so. Token ids (and labels other than -100) must be below
the model's vocabulary size when the caller knows it.

raypack/data/sources.py reads the records and adds where each one came from to the messages.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")


class FormatError(ValueError):
    """A record (or a source's fields) fits no format; the reader adds the file and the line."""


def detect(keys, declared: str, where: str) -> str:
    """The format of a source whose records have the fields `keys` (or `declared`, if not auto)."""
    if declared != "auto":
        return declared
    if "messages" in keys:
        return "chat"
    if "input_ids" in keys:
        return "tokenized"
    if "instruction" in keys and "output" in keys:
        return "instruction"
    if "prompt" in keys and "completion" in keys:
        return "completion"
    raise FormatError(
        f"{where}: can't tell the format from the fields {sorted(keys)}; expected `messages` (chat), "
        "`instruction`/`input`/`output`, `prompt`/`completion` or `input_ids` (+ `labels`), or set data.format"
    )


def _string(rec: dict[str, Any], key: str, fmt: str, optional: bool = False) -> str:
    value = rec.get(key)
    if value is None:
        if optional:
            return ""
        raise FormatError(f"missing field `{key}` ({fmt} format)")
    if not isinstance(value, str):
        raise FormatError(f"field `{key}` must be a string, got {type(value).__name__}")
    return value


def validate(rec: Any, fmt: str, vocab_size: int | None = None, detected: bool = False) -> dict[str, Any]:
    """The record normalized to `fmt`'s fields of sources.SCHEMA, or a FormatError naming the
    problem. `detected`: `fmt` was detected from the source's first record, so a record that
    lacks its fields but fits another format is reported as a mixed-format source."""
    try:
        return _validate(rec, fmt, vocab_size)
    except FormatError:
        if detected and isinstance(rec, dict):
            try:
                other = detect(rec.keys(), "auto", "")
            except FormatError:
                other = fmt
            if other != fmt:
                raise FormatError(
                    f"a {other} example in a {fmt} source (its first record is {fmt}); one format per "
                    "file: split the file, or set data.format"
                ) from None
        raise


def _validate(rec: Any, fmt: str, vocab_size: int | None) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise FormatError(f"expected a JSON object, got {type(rec).__name__}")
    if fmt == "chat":
        messages = rec.get("messages")
        if messages is None:
            raise FormatError("missing field `messages` (chat format)")
        if not isinstance(messages, (list, tuple)):
            raise FormatError(f"`messages` must be a list, got {type(messages).__name__}")
        if len(messages) == 0:
            raise FormatError("empty conversation (`messages` is [])")
        out = []
        for j, m in enumerate(messages):
            if not isinstance(m, dict):
                raise FormatError(f"messages[{j}] must be an object with role and content, got {type(m).__name__}")
            role = m.get("role")
            if role not in ROLES:
                raise FormatError(f"messages[{j}]: unknown role {role!r}; expected one of {', '.join(ROLES)}")
            content = m.get("content")
            if not isinstance(content, str):
                raise FormatError(f"messages[{j}]: content must be a string, got {type(content).__name__}")
            out.append({"role": role, "content": content})
        return {"messages": out}
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
        raise FormatError("missing field `input_ids` (tokenized format)")
    if not isinstance(ids, (list, tuple)) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise FormatError("`input_ids` must be a non-empty list of non-negative ints")
    if labels is not None:
        if not isinstance(labels, (list, tuple)) or not all(type(t) is int for t in labels):
            raise FormatError("`labels` must be a list of ints")
        if len(labels) != len(ids):
            raise FormatError(f"`labels` has {len(labels)} entries but `input_ids` has {len(ids)}")
    if vocab_size is not None:
        # An id past the embedding is an IndexError in a worker (a device-side assert on a GPU)
        # that names no row; here it names the file and the line.
        for key, values in (("input_ids", ids), ("labels", labels or ())):
            bad = next((j for j, t in enumerate(values) if t >= vocab_size or (t < 0 and t != -100)), None)
            if bad is not None:
                raise FormatError(
                    f"{key}[{bad}] = {values[bad]} is outside the model's vocabulary (ids 0..{vocab_size - 1}"
                    + (", or -100 for no loss)" if key == "labels" else ")")
                )
    return {"input_ids": list(ids), "labels": None if labels is None else list(labels)}
