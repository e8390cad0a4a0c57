"""Tokenization rules without Ray: label masks token by token, EOS once, over-length policies."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

from raypack.config import ASSETS
from raypack.data import sources
from raypack.data.formats import validate
from raypack.data.encode import DROPPED, OK, SPLIT, TRUNCATED, Encoder, TokenizeError
from raypack.data.formats import IGNORE_INDEX as IGNORE
from raypack.data.formats import TRAINS_ON_IDS, row_labels

TOK = str(ASSETS / "tokenizer")
CONV = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "what is the sum of two and three?"},
    {"role": "assistant", "content": "the sum is five."},
    {"role": "user", "content": "and double that?"},
    {"role": "assistant", "content": "ten minutes, twice the rate."},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOK)


def batch(records, fmt):
    rows = {n: [] for n in sources.SCHEMA.names}
    for i, rec in enumerate(records):
        fields = validate(rec, fmt)
        for n in sources.SCHEMA.names:
            rows[n].append(fields.get(n))
        rows["example_id"][-1], rows["format"][-1] = sources.example_id(0, i), fmt
    return pa.Table.from_pydict(rows, schema=sources.SCHEMA)


def encode(records, fmt, label_mask="auto", overlength="truncate", max_length=4096, template=None):
    enc = Encoder(TOK, template, label_mask, overlength, max_length)
    out = enc.encode_table(batch(records, fmt)).to_pylist()
    return out


def expected_chat(tok, conv, trained):
    """Build the chat piece by piece from the template's known layout: (ids, labels)."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, labels = [tok.bos_token_id], [IGNORE]
    last_assistant = max(j for j, m in enumerate(conv) if m["role"] == "assistant")
    for j, m in enumerate(conv):
        if m["role"] == "assistant":
            pieces = [(enc("<|assistant|>\n"), False), (enc(m["content"] + "<|end|>"), trained(j, last_assistant)), (enc("\n"), False)]
        else:
            pieces = [(enc(f"<|{m['role']}|>\n"), False), (enc(m["content"]), False), (enc("<|end|>\n"), False)]
        for piece, on in pieces:
            ids += piece
            labels += piece if on else [IGNORE] * len(piece)
    eos_on = conv[-1]["role"] == "assistant"
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id if eos_on else IGNORE]


@pytest.mark.parametrize("mode", ["auto", "assistant", "completion", "all"])
def test_chat_label_masks_token_by_token(tok, mode):
    (row,) = encode([{"messages": CONV}], "chat", label_mask=mode)
    if mode == "all":
        ids, _ = expected_chat(tok, CONV, lambda j, last: True)
        labels = ids
    elif mode == "completion":
        ids, labels = expected_chat(tok, CONV, lambda j, last: j == last)
    else:
        ids, labels = expected_chat(tok, CONV, lambda j, last: True)
    assert row["input_ids"] == ids
    assert row_labels(row) == labels
    assert (row["labels"] is TRAINS_ON_IDS) == (mode == "all")  # stored once
    # the first token predicts nothing (collate masks it), so a label there counts for nothing
    assert row["length"] == len(ids) and row["_label_tokens"] == sum(l != IGNORE for l in labels[1:])


def test_chat_mask_agrees_with_transformers_assistant_mask(tok):
    (row,) = encode([{"messages": CONV}], "chat")
    hf = tok.apply_chat_template(CONV, return_dict=True, return_assistant_tokens_mask=True)
    assert row["input_ids"][:-1] == hf["input_ids"]
    assert [int(l != IGNORE) for l in row["labels"][:-1]] == hf["assistant_masks"]


def test_template_without_generation_markers_gives_same_mask(tok):
    """Without markers a turn is its content and end-of-turn markup (<|end|>), exactly what the
    bundled template's {% generation %} block covers: not the "\n" that leads to the next turn."""
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    convs = [{"messages": CONV}, {"messages": CONV[1:3]}, {"messages": CONV[:2]}]
    for fallback, marked in zip(encode(convs, "chat", template=plain), encode(convs, "chat")):
        assert fallback["input_ids"] == marked["input_ids"]
        assert fallback["labels"] == marked["labels"]


def test_chat_ending_with_user_turn_has_no_loss_on_eos(tok):
    (row,) = encode([{"messages": CONV[:4]}], "chat")
    assert row["input_ids"][-1] == tok.eos_token_id and row["labels"][-1] == IGNORE


def test_eos_appended_once_even_when_template_ends_with_it(tok):
    with_eos = tok.chat_template + "{{ eos_token }}"
    for template in (None, with_eos):
        (row,) = encode([{"messages": CONV}], "chat", template=template)
        assert row["input_ids"][-1] == tok.eos_token_id and row["input_ids"][-2] != tok.eos_token_id
        assert row["input_ids"].count(tok.eos_token_id) == 1
    (row,) = encode([{"prompt": "a b", "completion": " c d"}], "completion")
    assert row["input_ids"].count(tok.eos_token_id) == 1 and row["input_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize("mode", ["auto", "completion", "assistant", "all"])
def test_instruction_and_completion_masks(tok, mode):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    rec = {"instruction": "add the numbers", "input": "two and three", "output": "five."}
    prompt = "### Instruction:\nadd the numbers\n\n### Input:\ntwo and three\n\n### Response:\n"
    rows = encode([rec], "instruction", label_mask=mode)
    rows += encode([{"prompt": "the river", "completion": " runs north."}], "completion", label_mask=mode)
    for row, (p, c) in zip(rows, [(prompt, "five."), ("the river", " runs north.")]):
        ids = [tok.bos_token_id] + enc(p) + enc(c) + [tok.eos_token_id]
        n_prompt = 1 + len(enc(p))
        labels = ids if mode == "all" else [IGNORE] * n_prompt + ids[n_prompt:]
        assert row["input_ids"] == ids and row_labels(row) == labels


def test_instruction_without_input_skips_input_section(tok):
    (row,) = encode([{"instruction": "say hi", "output": "hi"}], "instruction")
    assert "### Input" not in tok.decode(row["input_ids"])


def test_tokenized_passes_through():
    rows = encode([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}], "tokenized")
    assert [r["input_ids"] for r in rows] == [[5, 6, 7], [5, 6, 7]]
    assert [r["labels"] for r in rows] == [TRAINS_ON_IDS, [IGNORE, 6, 7]]  # no copy of the ids


@pytest.mark.parametrize("overlength", ["truncate", "drop", "split"])
@pytest.mark.parametrize("label_mask", ["auto", "all"])
def test_tokenized_rows_column_wise_match_the_per_row_path(monkeypatch, overlength, label_mask):
    """Pre-tokenized batches take a column-wise path; it keeps and counts exactly what the
    per-row path does (rows with and without labels, all-masked ones, rows over max_length)."""
    from raypack.data.encode import counts, kept_rows

    rng = np.random.default_rng(0)
    recs = []
    for _ in range(200):
        ids = rng.integers(0, 500, rng.integers(1, 60)).tolist()
        kind = rng.integers(3)  # no labels / some masked / all masked
        if kind == 0:
            recs.append({"input_ids": ids})
        else:
            labels = [IGNORE if kind == 2 or rng.random() < 0.4 else t for t in ids]
            recs.append({"input_ids": ids, "labels": labels})
    table = batch(recs, "tokenized")
    enc = Encoder(TOK, None, label_mask, overlength, 32)
    fast = enc.encode_table(table)
    monkeypatch.setattr(Encoder, "_tokenized_table", lambda self, b: None)
    slow = enc.encode_table(table)
    assert kept_rows(fast).equals(kept_rows(slow))
    got, want = counts(fast), counts(slow)
    for key in ("lengths", "ids", "label_counts"):
        assert got.pop(key).tolist() == want.pop(key).tolist()
    assert got == want
    assert fast.num_rows == slow.num_rows or overlength == "split"


def test_overlength_policies(tok):
    recs = [{"prompt": "a " * n, "completion": "b " * n} for n in (3, 40, 100)]
    (full_short, full_mid, full_long) = encode(recs, "completion")
    L = 32
    assert full_short["length"] <= L < full_mid["length"] < full_long["length"]

    dropped = encode(recs, "completion", overlength="drop", max_length=L)
    assert [r["_flag"] for r in dropped] == [OK, DROPPED, DROPPED] and [r["length"] for r in dropped][1:] == [0, 0]

    trunc = encode(recs, "completion", overlength="truncate", max_length=L)
    assert [r["_flag"] for r in trunc] == [OK, TRUNCATED, TRUNCATED]
    assert trunc[1]["input_ids"] == full_mid["input_ids"][:L] and row_labels(trunc[2]) == row_labels(full_long)[:L]

    split = encode(recs, "completion", overlength="split", max_length=L)
    parents = {r["example_id"] >> 10 for r in split}
    assert len(parents) == 3 and all(r["length"] <= L for r in split)
    for full in (full_mid, full_long):
        pieces = [r for r in split if r["example_id"] >> 10 == full["example_id"] >> 10]
        assert [r["example_id"] & 1023 for r in pieces] == list(range(-(-full["length"] // L)))
        assert all(r["_flag"] == SPLIT for r in pieces)
        assert sum((r["input_ids"] for r in pieces), []) == full["input_ids"]
        assert sum((row_labels(r) for r in pieces), []) == row_labels(full)
    assert len({r["example_id"] for r in split}) == len(split)


def test_chat_without_template_is_a_clear_error(tmp_path, tok):
    bare = AutoTokenizer.from_pretrained(TOK)
    template = bare.chat_template
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    enc = Encoder(str(tmp_path / "bare"), None, "auto", "truncate", 4096)
    with pytest.raises(TokenizeError, match="has no chat template .* set tokenize.chat_template"):
        enc.encode_table(batch([{"messages": CONV}], "chat"))
    # completion data needs no template; and a configured template fixes chat
    assert enc(batch([{"prompt": "a", "completion": "b"}], "completion")).num_rows == 1
    with_template = Encoder(str(tmp_path / "bare"), template, "auto", "truncate", 4096)
    assert with_template.encode_table(batch([{"messages": CONV}], "chat")).to_pylist() == encode([{"messages": CONV}], "chat")


def test_mixed_formats_in_one_batch_keep_row_order():
    chat = batch([{"messages": CONV}], "chat")
    comp = batch([{"prompt": "x", "completion": "y"}], "completion")
    mixed = pa.concat_tables([comp, chat, comp])
    out = Encoder(TOK, None, "auto", "truncate", 4096).encode_table(mixed).to_pylist()
    assert out[0] == out[2] and out[1]["input_ids"] == encode([{"messages": CONV}], "chat")[0]["input_ids"]
    assert np.all([r["length"] == len(r["input_ids"]) for r in out])


def test_call_drops_internal_columns_and_reports_counts():
    seen = {}
    enc = Encoder(TOK, None, "auto", "drop", 32, report=lambda key, c: seen.update({key: c}))
    recs = [{"prompt": "a " * n, "completion": "b " * n} for n in (3, 40, 5)]
    out = enc(batch(recs, "completion"))
    assert out.schema.names == ["example_id", "input_ids", "labels", "length", "label_tokens", "images", "image_grid_thw"]
    assert out.num_rows == 2 and out["images"].null_count == 2  # text rows: no images
    ((key, c),) = seen.items()
    assert key == (0, 3) and c["dropped"] == 1 and c["lengths"].tolist() == out["length"].to_pylist()
    assert c["label_tokens"] == sum(x != IGNORE for l in out["labels"].to_pylist() for x in l[1:])


def test_examples_without_a_label_token_are_dropped_and_counted(tok):
    """A chat without an assistant turn, a prompt that truncate cut before its answer, and a
    split piece of prompt only train nothing: dropped, and counted apart."""
    from raypack.data.encode import counts, kept_rows

    recs = [
        {"messages": CONV},
        {"messages": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hello?"}]},
        {"messages": [{"role": "user", "content": "a " * 60}, {"role": "assistant", "content": "ok"}]},
    ]
    table = Encoder(TOK, None, "auto", "truncate", 40).encode_table(batch(recs, "chat"))
    assert table["_label_tokens"].to_pylist()[1:] == [0, 0]  # no assistant turn; answer cut off
    c = counts(table)
    assert c["no_labels"] == 2 and c["truncated"] == 2 and c["no_label_pieces"] == 0
    assert c["no_label_examples"] == [sources.example_id(0, 1), sources.example_id(0, 2)]
    kept = kept_rows(table)
    assert kept["example_id"].to_pylist() == [sources.example_id(0, 0)] and c["lengths"].tolist() == kept["length"].to_pylist()
    assert c["label_tokens"] == table["_label_tokens"].to_pylist()[0] > 0

    split = Encoder(TOK, None, "auto", "split", 40).encode_table(batch(recs[2:], "chat"))
    c = counts(split)
    assert split.num_rows >= 2 and c["no_labels"] == 0 and c["no_label_pieces"] == split.num_rows - 1
    assert kept_rows(split).num_rows == 1  # only the piece that holds the answer


def test_a_label_on_the_first_token_counts_for_nothing():
    """The loss predicts token t+1 from t: the first token's label is never seen (collate masks
    it too), so an example labelled only there has no label token."""
    from raypack.data.encode import counts

    table = Encoder(TOK, None, "auto", "truncate", 64).encode_table(
        batch([{"input_ids": [5, 6, 7], "labels": [5, IGNORE, IGNORE]}, {"input_ids": [5, 6], "labels": [5, 6]}], "tokenized"))
    assert table["_label_tokens"].to_pylist() == [0, 1] and counts(table)["no_labels"] == 1


@pytest.mark.parametrize("overlength", ["drop", "truncate", "split"])
def test_label_tokens_lost_are_counted_by_cause(overlength):
    """Tokenized rows with every token labelled, 10 and 50 long at max_length 20: each row has
    length - 1 label tokens. Dropped, the 50-row loses its 49; truncated, the 30 past the cut;
    split into 20 + 20 + 10, the first token of the two later pieces."""
    from raypack.data.encode import counts

    table = Encoder(TOK, None, "auto", overlength, 20).encode_table(
        batch([{"input_ids": list(range(1, 11))}, {"input_ids": list(range(1, 51))}], "tokenized"))
    c = counts(table)
    assert c["source_label_tokens"] == 9 + 49
    lost = {"drop": 49, "truncate": 30, "split": 2}[overlength]
    cause = {"drop": "over_length", "truncate": "truncated", "split": "split"}[overlength]
    assert c["label_tokens_lost"] == {"over_length": 0, "truncated": 0, "split": 0, cause: lost}
    assert c["label_tokens"] == 9 + 49 - lost


@pytest.mark.parametrize("overlength", ["truncate", "split", "drop"])
def test_vision_rows_count_their_image_tokens_and_stay_whole(overlength):
    """A vision row (the source stage's, raypack/data/images.py) encodes with the processor found
    beside the tokenizer: its length and the counts include its image tokens, its images travel
    with it; one over the length limit is dropped whole under every policy (a cut would separate
    images from the positions that count them)."""
    from raypack.data.encode import counts, kept_rows
    from raypack.data.listing import list_sources, read_units

    processor = ASSETS / "vlm_processor"
    units = read_units(list_sources((str(ASSETS / "vision_sample" / "vision.jsonl"),)))
    rows = sources.read_unit({k: [units[0][k]] for k in units[0]}, "auto").slice(0, 6).drop_columns(["error", "fatal"])
    pad = AutoTokenizer.from_pretrained(processor).convert_tokens_to_ids("<|image_pad|>")
    full = Encoder(str(processor), None, "auto", overlength, 4096).encode_table(rows)
    limit = sorted(full["length"].to_pylist())[3]  # the two longest are over it
    table = Encoder(str(processor), None, "auto", overlength, limit).encode_table(rows)
    c, kept = counts(table), kept_rows(table)
    assert kept.num_rows == 4 and c["dropped"] == 2 and c["truncated"] == c["split"] == 0
    whole = {r["example_id"]: r for r in full.to_pylist()}
    for r in kept.to_pylist():
        assert r["input_ids"] == whole[r["example_id"]]["input_ids"] and r["images"] == whole[r["example_id"]]["images"]
    assert c["image_tokens"] == sum(ids.count(pad) for ids in kept["input_ids"].to_pylist()) > 0
    assert c["images"] == 4 and c["vision_patches"] == 4 * c["image_tokens"]  # merge_size 2: 4 patches a token


def test_vision_rows_refuse_label_masks_they_have_no_path_for():
    from raypack.data.listing import list_sources, read_units

    units = read_units(list_sources((str(ASSETS / "vision_sample" / "vision.jsonl"),)))
    rows = sources.read_unit({k: [units[0][k]] for k in units[0]}, "auto").slice(0, 2).drop_columns(["error", "fatal"])
    with pytest.raises(TokenizeError, match=r"tokenize.label_mask=all: image rows train on the assistant's tokens"):
        Encoder(str(ASSETS / "vlm_processor"), None, "all", "drop", 512).encode_table(rows)
