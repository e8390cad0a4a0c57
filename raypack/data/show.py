"""`raypack data --show N`: the first N examples as the model sees them, the trained tokens marked.

    raypack data --config run.yaml --show 3           # text; trained tokens green on a terminal,
                                                      # between [[ and ]] when not a terminal
    raypack data --config run.yaml --show 3 --json    # one JSON object a line (below)

Each example is read, validated and tokenized by the same code a run uses (sources.read_unit, the
Encoder, the over-length policy), one read unit at a time in file order until N rows are kept, so
a large source is not read whole. A JSON line holds what a test or a script needs to check exactly
which tokens train:

    {"source": "data/chat.jsonl", "line": 4, "example_id": ..., "input_ids": [...],
     "labels": [...]}                                  # -100 where a token carries no loss

`line` counts from 1 (JSONL, as editors do); a Parquet or Arrow row has `row` (0-based) instead,
and a piece of a split example its `piece`. The loss sees a label from the second token on
(labels are not shifted; the model shifts them), as tokenize's counts do.
"""

from __future__ import annotations

import json
import sys
from typing import IO

import pyarrow.compute as pc

from raypack.config import Config
from raypack.data.encode import Encoder, kept_rows
from raypack.data.formats import IGNORE_INDEX
from raypack.data.listing import Sources, read_units
from raypack.data.sources import locate, read_unit
from raypack.data.tokenize import check_encodable

GREEN, RESET = "\033[32m", "\033[0m"
OPEN, CLOSE = "[[", "]]"
"""What marks the trained text where colour can't (a file, a pipe)."""


def first_examples(cfg: Config, sources: Sources, n: int) -> list[dict]:
    """The first `n` rows a run would train on, in file order, with where each came from."""
    t = cfg.tokenize
    encoder = Encoder(t.tokenizer, t.chat_template, t.label_mask, t.overlength, cfg.max_length)
    out = []
    for unit in read_units(sources.files, sources.reading):
        if len(out) >= n:
            break
        table = read_unit({k: [v] for k, v in unit.items()}, cfg.data.format, None, cfg.data.max_image_pixels)
        good = table.filter(pc.is_null(table["error"]))  # preflight has refused bad rows unless skipped
        if not good.num_rows:
            continue
        formats = {v["values"]: v["counts"] for v in pc.value_counts(good["format"]).to_pylist()}
        check_encodable(cfg, encoder.tok, formats)
        rows = kept_rows(encoder.encode_table(good.drop_columns(["error", "fatal"]))).to_pylist()
        out += [_where(r, sources) for r in rows[: n - len(out)]]
    return out


def _where(row: dict, sources: Sources) -> dict:
    file_index, row_number, piece = locate(row["example_id"])
    path, kind = sources.files[file_index]
    labels = row["labels"] if row["labels"] is not None else row["input_ids"]  # TRAINS_ON_IDS
    where = {"line": row_number + 1} if kind == "jsonl" else {"row": row_number}
    return {"source": path, **where, **({"piece": piece} if piece else {}), "example_id": row["example_id"],
            "input_ids": row["input_ids"], "labels": labels}


def write(examples: list[dict], tok, as_json: bool, out: IO[str] | None = None, colour: bool | None = None) -> None:
    """Print `examples` (from `first_examples`) as JSON lines, or as text with the trained part marked."""
    out = sys.stdout if out is None else out  # at the call: whatever stdout is now (a redirect, a test's capture)
    if as_json:
        for e in examples:
            out.write(json.dumps(e) + "\n")
        return
    colour = out.isatty() if colour is None else colour
    for e in examples:
        trained = [label != IGNORE_INDEX and k > 0 for k, label in enumerate(e["labels"])]
        where = f"line {e['line']}" if "line" in e else f"row {e['row']} (0-based)"
        piece = f", piece {e['piece']}" if "piece" in e else ""
        out.write(f"--- {e['source']} {where}{piece}: {len(e['input_ids'])} tokens, {sum(trained)} trained\n")
        out.write(marked_text(tok, e["input_ids"], trained, colour) + "\n")


def marked_text(tok, ids: list[int], trained: list[bool], colour: bool) -> str:
    """The decoded tokens, each run of trained ones inside the marks (special tokens shown)."""
    start, end = (GREEN, RESET) if colour else (OPEN, CLOSE)
    parts, k = [], 0
    while k < len(ids):
        j = k
        while j < len(ids) and trained[j] == trained[k]:
            j += 1
        text = tok.decode(ids[k:j], skip_special_tokens=False)
        parts.append(f"{start}{text}{end}" if trained[k] else text)
        k = j
    return "".join(parts)
