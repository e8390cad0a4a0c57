"""benchmarks/startup.py --revs: its table and ratios from the runs it measured (the runs themselves,
a quickstart each, are too slow for CI; `--smoke` of the script's other comparisons runs in
tests/ray/benchmarks/test_smoke.py), and the tree it exports for a commit."""

from __future__ import annotations

import subprocess

from paths import REPO

from benchmarks.startup import export_tree, revisions_section

CPU = "CPU seconds, all processes"
TOTAL = "to the first step"


def test_each_commit_is_compared_with_the_first_and_the_one_before_round_by_round():
    runs = {
        "a": [{"Ray start": 4.0, TOTAL: 40.0, CPU: 50.0}, {"Ray start": 6.0, TOTAL: 60.0, CPU: 70.0}],
        "b": [{"Ray start": 2.0, TOTAL: 30.0, CPU: 40.0}, {"Ray start": 2.0, TOTAL: 30.0, CPU: 35.0}],
        ".": [{"Ray start": 1.0, TOTAL: 15.0, CPU: 20.0}, {"Ray start": 3.0, TOTAL: 45.0, CPU: 35.0}],
    }
    lines = revisions_section(["a", "b", "."], runs, rounds=2)
    assert "| Ray start | 5.0 | 2.0 | 2.0 |" in lines  # medians
    assert "| to the first step | 50.0 | 30.0 | 30.0 |" in lines
    assert "- `b` over the first (`a`), to the first step: **0.60x** (rounds: 0.75, 0.50)" in lines
    assert "- `.` over the first (`a`), CPU seconds, all processes: **0.46x** (rounds: 0.40, 0.50)" in lines
    assert "- `.` over the one before (`b`), to the first step: **1.00x** (rounds: 0.50, 1.50)" in lines
    assert not any("`b` over the one before" in line for line in lines)  # the first is the one before


def test_a_commit_is_exported_as_it_was_committed(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    tree = export_tree(head, tmp_path)
    committed = subprocess.run(["git", "show", f"{head}:raypack/train/startup.py"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert tree != REPO and (tree / "raypack/train/startup.py").read_text() == committed
    assert export_tree(".", tmp_path) == REPO
