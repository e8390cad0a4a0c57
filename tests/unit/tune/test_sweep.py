"""The sweep's table, CSV and plot, from fake rows: no Ray."""

from __future__ import annotations

import csv
import io

from raypack.config import load
from raypack.tune.sweep import (
    COLUMNS, CSV, PLOT, TABLE, format_csv, format_table, grid, plot, result_row, trial_config, write_report,
)

ROWS = [
    result_row({"strategy": "pad", "budget": 256, "lr": 3e-3},
               {"tokens_per_s": 812.5, "peak_memory_gb": 0.41, "loss": 5.91, "eval_loss": 5.95,
                "packing_efficiency": 0.58, "step": 6}, None),
    result_row({"strategy": "bfd", "budget": 256, "lr": 3e-3},
               {"tokens_per_s": 1530.0, "peak_memory_gb": 0.38, "loss": 5.62, "eval_loss": 5.70,
                "packing_efficiency": 0.99, "step": 6}, None),
    result_row({"strategy": "balanced", "budget": 512, "lr": 1e-3}, {},
               RuntimeError("ray::ImplicitFunc.train() (pid=1)\n  File ...\nRuntimeError: worker died")),
]


def test_rows_carry_status_and_error():
    assert [r["status"] for r in ROWS] == ["OK", "OK", "ERROR"]
    assert ROWS[2]["error"] == "RuntimeError: worker died"
    assert ROWS[2]["tokens_per_s"] is None
    assert result_row({"strategy": "pad", "budget": 8, "lr": 1.0}, {}, ValueError("boom"))["error"] == "ValueError: boom"


def test_markdown_table_has_every_trial():
    table = format_table(ROWS)
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    body = [l for l in lines[2:] if l.startswith("| ")]
    assert len(body) == 3
    assert body[0].startswith("| pad | 256 | 0.003 | 812.5 |")
    assert "| balanced | 512 | 0.001 | - |" in body[2] and body[2].endswith("| ERROR |")
    assert "balanced-b512-lr0.001: RuntimeError: worker died" in table


def test_csv_has_every_trial():
    rows = list(csv.DictReader(io.StringIO(format_csv(ROWS))))
    assert [r["strategy"] for r in rows] == ["pad", "bfd", "balanced"]
    assert rows[1]["tokens_per_s"] == "1530.0" and rows[1]["status"] == "OK"
    assert rows[2]["status"] == "ERROR" and rows[2]["loss"] == "" and "worker died" in rows[2]["error"]


def test_plot_is_a_png(tmp_path):
    path = plot(ROWS, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # all trials failed: still a (empty) plot, never an exception
    assert plot(ROWS[2:], tmp_path / "empty.png").stat().st_size > 0


def test_write_report(tmp_path):
    files = write_report(ROWS, str(tmp_path / "exp"))
    assert set(files) == {TABLE, CSV, PLOT}
    assert (tmp_path / "exp" / PLOT).read_bytes()[:4] == b"\x89PNG"
    assert "ERROR" in (tmp_path / "exp" / TABLE).read_text()
    assert len((tmp_path / "exp" / CSV).read_text().splitlines()) == 4


def test_grid_and_trial_config():
    cfg = load(None, ["tune.strategies=[pad, bfd]", "tune.budgets=[256, 512]", "train.lr=0.01"])
    trials = grid(cfg)
    assert len(trials) == 4 and {t["lr"] for t in trials} == {0.01}
    t = trial_config(cfg, trials[3], "/tmp/exp/runs", "abc")
    assert (t.pack.strategy, t.pack.budget, t.train.lr) == ("bfd", 512, 0.01)
    assert t.run.name == "bfd-b512-lr0.01-abc" and t.run.storage_path == "/tmp/exp/runs"
    # the other sections are the base config's
    assert t.model == cfg.model and t.data == cfg.data
