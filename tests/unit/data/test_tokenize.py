"""What tokenize's counts allow: data with no label token is refused before training (the Ray
stage itself is tested in tests/ray/data/test_tokenize.py)."""

from __future__ import annotations

import pytest

from raypack.config import load
from raypack.data.encode import TokenizeError
from raypack.data.tokenize import TokenizeStats, require_supervised


def test_data_that_trains_on_nothing_is_refused():
    stats = TokenizeStats(examples_in=3, no_labels=2, dropped=1, max_length=512, no_label_examples=["a.jsonl:1"])
    with pytest.raises(TokenizeError, match=r"nothing to train on: of 3 examples, 2 had no token that carries loss "
                                            r"\(first: a.jsonl:1\).*; 1 were longer than 512 tokens"):
        require_supervised(stats, load())


def test_examples_without_labels_are_dropped_or_an_error():
    stats = TokenizeStats(examples_in=3, no_labels=1, label_tokens=40, no_label_examples=["a.jsonl:2"])
    require_supervised(stats, load())  # dropped, counted, and the rest trains
    with pytest.raises(TokenizeError, match=r"^a.jsonl:2: no token carries loss .*; 1 such examples"):
        require_supervised(stats, load(None, ["tokenize.no_labels=error"]))
    assert "no labels  1 dropped (no token carries loss); first: a.jsonl:2" in stats.summary()
