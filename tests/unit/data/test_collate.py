"""collate_packed: boundaries, labels, cu_seqlens, and the padded layout."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypack.data.collate import collate_packed, count_label_tokens, example_starts, move_batch


def row(*lengths, start=100, noreset=False):
    ids = list(range(start, start + sum(lengths)))
    pos = list(range(sum(lengths))) if noreset else [p for n in lengths for p in range(n)]
    return {"input_ids": ids, "labels": list(ids), "position_ids": pos, "example_ids": [0], "pack": 3}


def test_docstring_layout():
    batch = collate_packed([row(4, 3), row(5, start=200)])
    assert set(batch) == {"input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert batch["input_ids"].shape == (1, 12) and batch["input_ids"].dtype == torch.int64
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert batch["labels"][0].tolist() == [-100, 101, 102, 103, -100, 105, 106, -100, 201, 202, 203, 204]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 7, 12] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["max_length_q"] == batch["max_length_k"] == 5 and isinstance(batch["max_length_q"], int)
    assert count_label_tokens(batch) == 9


def test_every_row_start_is_a_boundary_even_without_a_restart():
    # wrapped_noreset rows run 0..T-1: one segment per row; a split piece resuming at 7 still starts one
    a, b = row(3, 2, noreset=True), row(3, noreset=True)
    b["position_ids"] = [7, 8, 9]
    batch = collate_packed([a, b])
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8]
    assert example_starts(np.array([0, 1, 5, 6, 0])).tolist() == [0, 2, 4]


def test_padded_mode():
    batch = collate_packed([row(4, 3), row(5, start=200)], padded=True, pad_token_id=7)
    assert set(batch) == {"input_ids", "attention_mask", "position_ids", "labels"}
    assert batch["input_ids"].shape == (3, 5)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["input_ids"][1].tolist() == [104, 105, 106, 7, 7]
    assert batch["labels"][1].tolist() == [-100, 105, 106, -100, -100]
    assert batch["position_ids"][1, :3].tolist() == [0, 1, 2]
    assert count_label_tokens(batch) == 9


def test_move_batch_keeps_ints_and_shared_cu_seqlens():
    moved = move_batch(collate_packed([row(2, 2)]), "cpu")
    assert moved["cu_seq_lens_k"] is moved["cu_seq_lens_q"] and moved["max_length_q"] == 2


@st.composite
def packed_rows(draw):
    rows, examples = [], []
    for _ in range(draw(st.integers(1, 4))):
        lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
        exs = [draw(st.lists(st.integers(3, 99), min_size=n, max_size=n)) for n in lengths]
        labels = [[t if draw(st.booleans()) else -100 for t in ex] for ex in exs]
        examples += list(zip(exs, labels))
        rows.append({"input_ids": sum(exs, []), "labels": sum(labels, []),
                     "position_ids": [p for n in lengths for p in range(n)]})  # fmt: skip
    return rows, examples


@settings(max_examples=60, deadline=None)
@given(packed_rows())
def test_packed_and_padded_agree_with_the_examples(case):
    rows, examples = case
    packed, padded = collate_packed(rows), collate_packed(rows, padded=True)
    lengths = [len(ex) for ex, _ in examples]
    cu = packed["cu_seq_lens_q"].tolist()
    assert cu == [0, *np.cumsum(lengths).tolist()] and packed["max_length_q"] == max(lengths)
    labels, pos = packed["labels"][0].tolist(), packed["position_ids"][0].tolist()
    for i, (ex, lab) in enumerate(examples):
        lo, hi = cu[i], cu[i + 1]
        assert pos[lo:hi] == list(range(len(ex)))  # positions restart at every boundary
        assert labels[lo] == -100 and labels[lo + 1 : hi] == lab[1:]  # no label crosses a boundary
        n = padded["attention_mask"][i].sum().item()
        assert n == len(ex) and padded["input_ids"][i, :n].tolist() == ex
        assert padded["labels"][i, :n].tolist() == [-100, *lab[1:]] and (padded["labels"][i, n:] == -100).all()
    expected = sum(sum(t != -100 for t in lab[1:]) for _, lab in examples)
    assert count_label_tokens(packed) == count_label_tokens(padded) == expected
