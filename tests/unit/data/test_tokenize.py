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
    require_supervised(stats, load(None, ["data.max_dropped_fraction=0.5"]))  # dropped, counted, and the rest trains
    with pytest.raises(TokenizeError, match=r"^a.jsonl:2: no token carries loss .*; 1 such examples"):
        require_supervised(stats, load(None, ["tokenize.no_labels=error"]))
    assert "no labels  1 dropped (no token carries loss); first: a.jsonl:2" in stats.summary()


def test_losing_more_than_the_allowed_share_is_an_error_naming_the_cause():
    """298 of 300 examples over tokenize.max_length under overlength=drop trained 1 step and exited
    0; now it is an error naming the setting. At the limit, the rest trains."""
    lost = TokenizeStats(examples_in=300, dropped=298, label_tokens=20, max_length=16)
    with pytest.raises(TokenizeError, match=r"298 of 300 source rows \(99%\) would not train, more than "
                                            r"data.max_dropped_fraction=0.2; the largest cause: 298 were longer than 16 "
                                            r"tokens \(tokenize.overlength=drop at tokenize.max_length"):
        require_supervised(lost, load())
    require_supervised(lost, load(None, ["data.max_dropped_fraction=1.0"]))
    half = TokenizeStats(examples_in=590, no_labels=300, bad_rows=10, label_tokens=900, max_length=512)
    with pytest.raises(TokenizeError, match=r"310 of 600 .*largest cause: 300 had no token that carries loss"):
        require_supervised(half, load())
    require_supervised(TokenizeStats(examples_in=10, dropped=2, label_tokens=9), load())  # 20%: at the limit


def test_label_tokens_lost_to_dropping_are_refused_and_to_truncation_said(capsys):
    """10% of the examples dropped for length, but they held 60% of the label tokens: refused,
    naming the length. Every example kept, but truncation cut 80% of what they would train on: a
    warning (truncation is a policy the config chose). The summary states both shares, by cause."""
    dropped = TokenizeStats(examples_in=100, dropped=10, label_tokens=400, source_label_tokens=1000, max_length=64,
                            label_tokens_lost={"over_length": 600, "truncated": 0, "split": 0})
    with pytest.raises(TokenizeError, match=r"600 of 1000 label tokens \(60%\) are in examples longer than 64 tokens "
                                            r"\(tokenize.max_length, else pack.budget\), which tokenize.overlength=drop"):
        require_supervised(dropped, load())
    cut = TokenizeStats(examples_in=100, truncated=100, label_tokens=200, source_label_tokens=1000, max_length=64,
                        label_tokens_lost={"over_length": 0, "truncated": 800, "split": 0})
    assert cut.losses() == "0.0% of the examples and 80.0% (80.0% truncated) of their label tokens"
    require_supervised(cut, load())
    assert capsys.readouterr().out == ("[raypack] warning: tokenize.overlength=truncate cut off 80% of the label tokens "
                                       "at 64 tokens (tokenize.max_length, else pack.budget); a longer limit keeps them\n")
    assert "lost       0.0% of the examples and 80.0% (80.0% truncated)" in cut.summary()
