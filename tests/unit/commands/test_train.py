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
