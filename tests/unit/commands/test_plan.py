"""`raypack plan` on a lengths file: config + dotted overrides, the table, --json keys, --out, and
that what it prints is make_plan's plan with the accumulation folded in (what training makes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import pyarrow.parquet as pq

from raypack.cli import main
from raypack.config import load
from raypack.data.strategies import make_plan
from raypack.data.synthetic import sample_lengths

KEYS = ["strategy", "packs", "steps", "optimizer_steps", "tokens_per_optimizer_step", "efficiency",
        "padding_fraction", "token_imbalance", "attention_imbalance", "token_imbalance_worst",
        "attention_imbalance_worst", "split_padding", "seconds"]


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


def test_plan_prints_the_memory_estimate_of_the_configured_run(tmp_path, capsys):
    """With --config, one line: raypack/train/memory/estimate.py's estimate for the mode, ZeRO stage,
    checkpointing and budget the config (and its overrides) set."""
    from raypack.model.build import model_config
    from raypack.train.memory.estimate import Arch, estimate

    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7]))
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny-llama, peft: {method: lora, r: 8}}\ntrain: {zero_stage: 2}\n")
    overrides = ["pack.budget=256", "model.gradient_checkpointing=true"]
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(config), *overrides]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per GPU (estimate): ")]
    cfg = load(str(config), overrides)
    arch = Arch.from_config(model_config("tiny-llama"))
    assert line == "memory per GPU (estimate): " + estimate(cfg, arch).line(cfg, arch)
    for part in ("lora r8", "ZeRO-2", "gradient checkpointing full", "256 tokens a row"):
        assert part in line
    # no --config: the defaults' tiny model is nobody's run, so no estimate
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "pack.budget=8"]) == 0
    assert "memory per GPU" not in capsys.readouterr().out


def test_plan_skips_the_estimate_of_a_model_it_cannot_resolve_offline(tmp_path, capsys, monkeypatch):
    """A hub name neither cached nor reachable: the plan still prints, and exits 0, at once."""
    from raypack.model import build

    def no_network(*args, **kwargs):
        raise AssertionError("plan --lengths reached for the network")

    monkeypatch.setattr(build, "model_config", no_network)
    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7]))
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: no-such-org/no-such-model-raypack}\n")
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(config), "pack.budget=8"]) == 0
    out = capsys.readouterr().out
    assert "wall-time overhead" in out and "memory per GPU" not in out


def test_plan_on_its_data_says_when_the_estimate_is_not_available(monkeypatch):
    """Planning the configured data (no --lengths) may ask the hub for the model's config; if
    that fails the line says why, and the plan goes on."""
    from raypack.commands.plan import memory_line
    from raypack.model import build

    def unreachable(name, *args, **kwargs):
        raise build.ModelNotFoundError(f"model.name {name!r}: can't load its config (no network)")

    monkeypatch.setattr(build, "model_config", unreachable)
    line = memory_line(load(None, ["model.name=no-such-org/no-such-model-raypack"]), offline=False)
    assert line == ("memory per GPU (estimate): n/a (model.name 'no-such-org/no-such-model-raypack': "
                    "can't load its config (no network))")


def test_plan_shows_sequence_parallel_groups_and_their_padding(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7, 9, 6]))
    argv = ["plan", "--lengths", str(tmp_path / "l.npy"), "pack.budget=10", "pack.strategy=bfd",
            "train.num_workers=4", "train.sequence_parallel=2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 ranks x 1 micro-steps" in text  # the data-parallel groups plan the rows
    assert "sequence parallel: 2 groups of 2 workers (4 in all)" in text and "at most 5 tokens a worker" in text
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    cfg = load(None, ["pack.budget=10", "pack.strategy=bfd", "train.num_workers=4", "train.sequence_parallel=2"])
    tokens = make_plan(np.array([5, 3, 2, 7, 9, 6]), cfg.pack, 2).pack_tokens()
    assert row["split_padding"] == pytest.approx((tokens % 2).sum() / (tokens + tokens % 2).sum()) and row["split_padding"] > 0


def test_plan_names_the_models_rows_in_the_supported_models_table(tmp_path, capsys):
    """The line after the estimate: the configured model's class, its rows in the table the family
    tests run (raypack/model/family_table.py), exact or refused; a class with no row says so."""
    import transformers

    np.save(tmp_path / "l.npy", np.array([5, 3, 2, 7]))
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny-nemotron_h}\n")
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(config), "pack.budget=64"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("supported models")]
    assert line.startswith(f"supported models (docs/reference/models.md): NemotronHConfig, 3 rows, exact in raypack's "
                           f"tests at transformers {transformers.__version__}: nemotron_h: Mamba-2 layers, MLP-only")
    assert "nemotron_h-nano3" in line and "nemotron_h-recurrent" in line
    transformers.MptConfig().save_pretrained(tmp_path / "mpt")
    config.write_text(f"model: {{name: {tmp_path / 'mpt'}}}\n")
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(config), "pack.budget=64"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("supported models")]
    assert line.startswith("supported models: no row for MptConfig in raypack's table")
