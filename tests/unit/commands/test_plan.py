"""`raypack plan` on a lengths file: config + dotted overrides, the table, --json keys, --out, and
that what it prints is make_plan's plan with the accumulation folded in (what training makes)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from raypack.cli import main
from raypack.config import load
from raypack.data.strategies import make_plan
from raypack.data.synthetic import sample_lengths

KEYS = ["strategy", "packs", "steps", "optimizer_steps", "tokens_per_optimizer_step", "efficiency",
        "padding_fraction", "token_imbalance", "attention_imbalance", "token_imbalance_worst",
        "attention_imbalance_worst", "seconds"]


def test_plan_cli_json_and_out_are_the_training_plan(tmp_path, capsys):
    lengths = sample_lengths("flan", 3000, seed=0, max_length=1024)
    np.save(tmp_path / "lengths.npy", lengths)
    out = tmp_path / "plan.parquet"
    overrides = ["pack.budget=1024", "pack.seed=3", "train.num_workers=4", "train.grad_accum=3"]
    argv = ["plan", "--lengths", str(tmp_path / "lengths.npy"), *overrides,
            "--strategy", "wrapped", "balanced", "--json", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == ["wrapped", "balanced"]
    assert all(list(r) == KEYS for r in rows)
    assert all(r["steps"] * 4 == r["packs"] and r["optimizer_steps"] * 3 == r["steps"] for r in rows)
    assert all(r["tokens_per_optimizer_step"] * r["optimizer_steps"] == lengths.sum() for r in rows)
    table = pq.read_table(out)
    assert table.column_names == ["example_id", "pack", "rank", "step", "start", "end"]
    # The assignment printed is the one data preparation makes: make_plan with the accumulation.
    cfg = load(None, [*overrides, "pack.strategy=wrapped"])
    plan = make_plan(lengths, cfg.pack, 4, 3)
    for col, want in (("example_id", plan.example), ("rank", plan.rank), ("step", plan.step), ("start", plan.start)):
        assert np.array_equal(table[col].to_numpy(), want), col
    assert table["rank"].to_numpy().max() == 3  # folded onto 4 real ranks, not 12 virtual ones


def test_plan_cli_table_defaults_to_the_configured_strategy(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7]))
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "pack.budget=8", "pack.strategy=bfd"]) == 0
    text = capsys.readouterr().out
    assert "\nbfd " in text and "\nbalanced " not in text and "wall-time overhead" in text
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "pack.budget=8", "--strategy", "all"]) == 0
    text = capsys.readouterr().out
    for name in ("pad", "flatten", "wrapped_noreset", "greedy", "balanced"):
        assert f"\n{name} " in text


def test_plan_cli_refuses_bad_names_and_files_in_one_line(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 3]))
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--strategy", "bdf"]) == 2
    err = capsys.readouterr().err
    assert "--strategy: unknown packing strategy 'bdf'" in err and err.count("\n") == 1
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "pack.strategy=bdf"]) == 2
    assert "pack.strategy: unknown packing strategy 'bdf'" in capsys.readouterr().err
    (tmp_path / "bad.npy").write_text("not numpy")
    assert main(["plan", "--lengths", str(tmp_path / "bad.npy")]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_shipped_plan_job_entrypoint_parses_with_this_cli():
    """The KubeRay dry-run job's command line is one `raypack plan` still accepts."""
    import shlex

    import yaml

    from raypack.cli import build_parser
    from paths import REPO

    entry = yaml.safe_load((REPO / "cluster" / "ray-job.plan.yaml").read_text())["spec"]["entrypoint"]
    argv = shlex.split(entry)
    assert argv[:2] == ["python", "jobs/plan.py"]
    args = build_parser().parse_args(["plan", *argv[2:]])
    cfg = load(str(REPO / args.config), args.overrides)
    assert cfg.pack.budget == 16384 and cfg.train.num_workers == 8 and args.strategy == ["bfd", "balanced", "greedy"]


def test_overrides_after_strategy_get_a_hint(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 3]))
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--strategy", "bfd", "pack.budget=8"]) == 2
    assert "put overrides before --strategy" in capsys.readouterr().err
