"""Stage 2 on a local Ray cluster: the output contract, over-length policies, bad rows skipped or
named while streaming from the reader (stage 1's own tests are in test_sources.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest

from raypack.config import ASSETS, Config, DataConfig, TokenizeConfig, load
from raypack.data.encode import TokenizeError
from raypack.data.listing import Sources, list_sources, read_units
from raypack.errors import SourceError
from raypack.data.formats import row_labels
from raypack.data.tokenize import lengths_and_ids, ordered, tokenize_dataset

pytestmark = pytest.mark.ray
SAMPLE = ASSETS / "sample"


def test_bad_rows_skip(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path.write_text("\n".join([good, "{oops", good, json.dumps({"messages": []}), good]) + "\n")
    cfg = load(None, [f"data.paths=['{path}']", "data.on_bad_rows=skip"])
    ds, stats = tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    assert stats.bad_rows == 2 and stats.examples_in == 3 and ds.count() == 3
    assert stats.bad_examples == [f"{path} line 2: malformed JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))", f"{path} line 4: empty conversation (`messages` is [])"]
    assert "bad rows   2 skipped" in stats.summary()


def test_tokenize_contract_and_overlength_counts(ray_local):
    base = Config(
        data=DataConfig(paths=(str(SAMPLE / "chat.jsonl"), str(SAMPLE / "completion.jsonl"))),
        tokenize=TokenizeConfig(max_length=200, overlength="split", batch_size=64, num_actors=2),
    )
    ds, stats = tokenize_dataset(base, Sources.of(base.data.paths))
    table = pa.concat_tables(ds.to_arrow_refs() and [ray_local.get(r) for r in ds.to_arrow_refs()])
    assert table.schema.names == ["example_id", "input_ids", "labels", "length", "label_tokens", "images", "image_grid_thw"]
    assert str(table.schema.field("example_id").type) == "int64" and str(table.schema.field("length").type) == "int32"
    assert str(table.schema.field("input_ids").type) == str(table.schema.field("labels").type) == "list<item: int32>"
    rows = table.to_pydict()
    # a piece of only completion tokens trains on all its ids: its labels are stored as null
    assert None in rows["labels"]
    rows["labels"] = [row_labels(dict(input_ids=i, labels=l)) for i, l in zip(rows["input_ids"], rows["labels"])]
    assert len(set(rows["example_id"])) == len(rows["example_id"]) == stats.examples_out
    assert all(n == len(i) == len(l) and 1 <= n <= 200 for n, i, l in zip(rows["length"], rows["input_ids"], rows["labels"]))
    assert all(all(x == -100 or x == t for x, t in zip(l, i)) for i, l in zip(rows["input_ids"], rows["labels"]))
    assert stats.split > 0 and stats.pieces > stats.split and stats.no_labels == 0
    # split pieces of prompt only carry no loss and are dropped, and counted
    assert stats.no_label_pieces > 0 and all(any(x != -100 for x in l[1:]) for l in rows["labels"])
    assert stats.examples_out == 600 - stats.split + stats.pieces - stats.no_label_pieces
    assert stats.tokens == sum(rows["length"]) and stats.label_tokens == sum(x != -100 for l in rows["labels"] for x in l[1:])
    assert sorted(stats.lengths.tolist()) == sorted(rows["length"])
    # The counts carry each row's id with its length: the planner's input without a pass over the rows.
    by_id = ordered(stats.lengths, stats.ids)
    assert all(np.array_equal(a, b) for a, b in zip(by_id, lengths_and_ids(ds)))
    assert by_id[1].tolist() == sorted(rows["example_id"])
    whole_tokens = stats.tokens

    drop = dataclasses.replace(base, tokenize=dataclasses.replace(base.tokenize, overlength="drop", num_actors=1))
    _, s = tokenize_dataset(drop, Sources.of(drop.data.paths))
    assert s.dropped == stats.split and s.examples_out == 600 - s.dropped and s.truncated == 0
    trunc = dataclasses.replace(base, tokenize=dataclasses.replace(base.tokenize, overlength="truncate", num_actors=1))
    _, s = tokenize_dataset(trunc, Sources.of(trunc.data.paths))
    assert s.truncated == stats.split and s.examples_out == 600 - s.no_labels and s.tokens < whole_tokens


def test_missing_chat_template_fails_on_driver(ray_local, tmp_path):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    cfg = load(None, [f"tokenize.tokenizer={tmp_path / 'bare'}"])
    with pytest.raises(TokenizeError, match="no chat template"):
        tokenize_dataset(cfg, Sources.of(cfg.data.paths))


def test_chunked_jsonl_streams_with_the_same_ids_and_errors(ray_local, tmp_path, monkeypatch):
    from raypack.data import listing

    recs = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text().splitlines() if line.strip()]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = Config(data=DataConfig(paths=(str(path),)), tokenize=TokenizeConfig(max_length=200, batch_size=16, num_actors=2))
    whole, whole_stats = tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    monkeypatch.setattr(listing, "CHUNK_BYTES", 16384)  # about 20 chunks
    assert len(read_units(list_sources((str(path),)))) > 10
    chunked, stats = tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    key = lambda t: sorted(zip(t["example_id"], t["length"]))  # noqa: E731
    assert key(chunked.to_pandas()) == key(whole.to_pandas()) and stats.examples_in == len(recs)
    assert stats.tokens == whole_stats.tokens and stats.truncated == whole_stats.truncated

    lines = [json.dumps(r) for r in recs]
    lines[250] = json.dumps({"messages": [{"role": "robot", "content": "x"}]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=r"chat\.jsonl line 251: messages\[0\]: unknown role 'robot'"):
        tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    skip = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, on_bad_rows="skip"))
    _, s = tokenize_dataset(skip, Sources.of(skip.data.paths))
    assert s.bad_rows == 1 and s.examples_in == len(recs) - 1 and s.bad_examples[0].startswith(f"{path} line 251: ")
