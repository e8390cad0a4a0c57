"""Where `raypack export` writes, without a run (raypack/train/export.py): refused before any work
where it can't, staged beside the output and renamed into place, with ordinary permissions. The
exports themselves, on real runs: tests/ray/commands/test_export.py."""

from __future__ import annotations

import os

import pytest

from raypack.train.export import ExportError, check_out, staged


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model").mkdir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"--out .*/a-file is a file; name a folder"):
        check_out(str(tmp_path / "a-file"))
    with pytest.raises(ExportError, match=r"--out .*/a-file/out: can't make it, .*/a-file is a file"):
        check_out(str(tmp_path / "a-file" / "out"))
    with pytest.raises(ExportError, match=r"/full exists already; remove it, or name another folder with --out"):
        check_out(str(tmp_path / "full"))
    check_out(str(tmp_path / "empty"))
    check_out(str(tmp_path / "new" / "deeper"))


def test_an_export_is_renamed_into_place_whole_or_not_at_all(tmp_path):
    out = tmp_path / "exports" / "best"
    umask = os.umask(0o022)
    try:
        with staged(str(out)) as folder:
            assert folder.parent == out.parent and not out.exists()
            (folder / "model").mkdir()
            (folder / "model" / "model.safetensors").write_bytes(b"w")
            (folder / "model" / "model.safetensors").chmod(0o600)  # as safetensors writes it
    finally:
        os.umask(umask)
    assert (out / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (out / "model").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in out.parent.iterdir()) == ["best"]

    with pytest.raises(RuntimeError), staged(str(tmp_path / "failed")) as folder:  # stopped half-way
        (folder / "model").mkdir()
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports"], "a half-written export was left"

    # Another export filled the folder meanwhile: this one is refused at the rename, nothing mixed.
    with pytest.raises(ExportError, match=r"best was written meanwhile \(by another export\?\); this one is discarded"):
        with staged(str(out)) as folder:
            (folder / "adapter").mkdir()
    assert sorted(p.name for p in out.iterdir()) == ["model"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["best"]


def test_a_run_folder_that_does_not_exist_is_called_missing(tmp_path, capsys):
    from raypack.cli import main

    assert main(["export", str(tmp_path / "typo")]) == 2
    assert capsys.readouterr().err == f"raypack: error: {tmp_path / 'typo'}: no such folder\n"
