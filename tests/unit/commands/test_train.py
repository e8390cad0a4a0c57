"""`raypack train` on the command line, before Ray: what is refused without starting it."""

from __future__ import annotations

import pytest


def test_reprepare_is_refused_for_a_run_with_checkpoints(tmp_path, capsys, monkeypatch):
    import ray

    from raypack.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's Ray may be up
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint_manager_snapshot.json").write_text("{}")
    assert main(["train", "--reprepare", f"run.storage_path={tmp_path}", "run.name=r"]) == 2
    err = capsys.readouterr().err
    assert "--reprepare: run 'r'" in err and "has checkpoints" in err and "run.name=NEW_NAME" in err


def test_resume_of_a_folder_that_is_no_run_is_one_line(tmp_path, capsys):
    from raypack.cli import main

    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no raypack_config.yaml there; is it a raypack run folder?" in err


def test_the_summary_aligns_its_values_under_the_longest_name(tmp_path, capsys):
    from raypack.commands.train import print_summary
    from raypack.train.tracking import TrackingTargets
    from raypack.train.trainer import Outcome

    metrics = {"step": 40, "loss": 0.25, "eval_rewards/accuracies": 1.0, "eval_loss": None}
    print_summary(Outcome(str(tmp_path), False, metrics, None, TrackingTargets(f"{tmp_path}/tensorboard")))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["step", "loss", "eval_rewards/accuracies", "results", "tensorboard"]
    starts = {len(line) - len(line.split(maxsplit=1)[1]) for line in lines}
    assert starts == {2 + len("eval_rewards/accuracies") + 1}, lines  # one column of values


def test_a_mixtures_eval_losses_are_on_each_eval_line_in_the_summary_and_the_result_file(tmp_path, capsys):
    """Per-source eval losses (`eval_<name>_loss`) used to reach TensorBoard only."""
    from types import SimpleNamespace

    from raypack import runs
    from raypack.commands.train import print_summary
    from raypack.train.metrics import Reporter
    from raypack.train.tracking import TrackingTargets
    from raypack.train.trainer import Outcome, summarized

    metrics = {"step": 8, "epoch": 0, "loss": 1.5, "eval_loss": 1.25, "eval_chat_loss": 1.0, "eval_code_loss": 2.0,
               "tokens_per_s": 100.0, "data_wait_s": 0.0, "peak_memory_gb": 1.0, "unrelated": 3}
    Reporter._progress(SimpleNamespace(total_steps=8, epochs=1, eta=None), metrics)
    line = capsys.readouterr().out
    assert "loss 1.5000 eval_loss 1.2500 (chat 1.0000, code 2.0000) tok/s" in line, line
    summary = summarized(metrics)
    keys = list(summary)
    assert keys[keys.index("eval_loss"):][:3] == ["eval_loss", "eval_chat_loss", "eval_code_loss"]
    assert "unrelated" not in summary
    runs.write_result(str(tmp_path), 8, summary, None)
    assert runs.read_result(str(tmp_path))["metrics"]["eval_code_loss"] == 2.0
    print_summary(Outcome(str(tmp_path), False, summary, None, TrackingTargets(None)))
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert rows["eval_chat_loss"] == "1.0000" and rows["eval_code_loss"] == "2.0000"


def test_the_tensorboard_line_names_a_command_that_runs_from_the_users_shell(tmp_path, monkeypatch):
    """After `make run` the venv's bin/ is not on PATH: the line names `.venv/bin/tensorboard`,
    where the default setup installs it (a dependency, not an extra); `tensorboard` where it is on
    PATH; how to install it where it is nowhere."""
    import sys
    import tomllib

    from raypack.commands.train import tensorboard_command

    from paths import REPO

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("tensorboard>") for d in deps), "make run installs no tensorboard"
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.chdir(tmp_path)
    assert tensorboard_command("results/r/tensorboard") == "pip install tensorboard, then: tensorboard --logdir results/r/tensorboard"
    (venv / "tensorboard").write_text("#!/bin/sh\n")
    (venv / "tensorboard").chmod(0o755)
    assert tensorboard_command("results/r/tensorboard") == ".venv/bin/tensorboard --logdir results/r/tensorboard"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert tensorboard_command("/x") == f"{venv}/tensorboard --logdir /x"
    monkeypatch.setenv("PATH", str(venv))
    assert tensorboard_command("/x") == "tensorboard --logdir /x"
