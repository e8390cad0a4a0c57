"""Progress lines of data preparation, without Ray: their format, and that they come at the interval."""

from __future__ import annotations

import threading

from raypack.data.progress import Progress, line


def test_line_says_done_of_total_rate_and_time_left():
    assert line("tokenize", "examples read", 1_230_000, 3_000_000, 52_300) == (
        "[raypack] tokenize: 1,230,000 of 3,000,000 examples read (41%), 52,300/s, about 34s left")
    assert line("tokenize", "examples read", 1_230_000, None, 52_300) == (
        "[raypack] tokenize: 1,230,000 examples read, 52,300/s")  # JSONL: no total before it is read
    assert line("pack", "rows written", 0, 12_000, None) == "[raypack] pack: 0 of 12,000 rows written (0%)"
    assert line("pack", "rows written", 9_000, 12_000, 100) == (
        "[raypack] pack: 9,000 of 12,000 rows written (75%), 100/s, about 30s left")


def test_progress_prints_at_the_interval_and_measures_each_phase(capsys):
    counts = iter([("examples routed", 100, 400), ("examples routed", 400, 400), ("rows written", 10, 40),
                   ("rows written", 30, 40)] + [("rows written", 40, 40)] * 1000)
    polled, four = [], threading.Event()

    def poll():
        polled.append(1)
        if len(polled) >= 5:
            four.set()  # the fourth line is printed by now
        return next(counts)

    with Progress("pack", poll, interval=0.05):
        assert four.wait(timeout=60)  # on a loaded machine the polls come late, never early
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 4, lines
    assert lines[0].startswith("[raypack] pack: 100 of 400 examples routed (25%), ") and "left" in lines[0]
    assert lines[2] == "[raypack] pack: 10 of 40 rows written (25%)"  # a new phase: no rate until it moves
    assert lines[3].startswith("[raypack] pack: 30 of 40 rows written (75%), ") and "left" in lines[3]


def test_a_short_stage_prints_nothing(capsys):
    with Progress("tokenize", lambda: ("examples read", 1, None), interval=10):
        pass
    assert capsys.readouterr().out == ""


def test_durations_read_as_a_person_says_them():
    from raypack.data.progress import duration

    assert [duration(s) for s in (5, 125, 7300)] == ["5s", "2m05s", "2h01m"]
