"""`raypack plan` on a lengths file: the table, --json keys and --out columns."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from raypack.cli import main
from raypack.data.synthetic import sample_lengths

KEYS = ["strategy", "packs", "steps", "efficiency", "padding_fraction", "token_imbalance", "attention_imbalance", "seconds"]


def test_plan_cli_json_and_out(tmp_path, capsys):
    lengths = sample_lengths("flan", 3000, seed=0, max_length=1024)
    np.save(tmp_path / "lengths.npy", lengths)
    out = tmp_path / "plan.parquet"
    argv = ["plan", "--lengths", str(tmp_path / "lengths.npy"), "--budget", "1024", "--ranks", "4",
            "--strategy", "wrapped", "bfd", "--seed", "3", "--json", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == ["wrapped", "bfd"]
    assert all(list(r) == KEYS for r in rows)
    assert all(r["steps"] * 4 == r["packs"] for r in rows)
    table = pq.read_table(out)
    assert table.column_names == ["example_id", "pack", "rank", "step", "start", "end"]
    assert table.num_rows >= len(lengths)  # wrapped: one row per piece


def test_plan_cli_table(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7]))
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--budget", "8", "--ranks", "2"]) == 0
    text = capsys.readouterr().out
    for name in ("pad", "flatten", "wrapped_noreset", "greedy", "balanced"):
        assert f"\n{name} " in text
