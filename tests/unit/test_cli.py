"""The command line: a config error is one line and exit code 2; --help imports no command."""

from __future__ import annotations

import subprocess
import sys

from raypack.cli import main


def test_config_error_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: fast\n")
    assert main(["data", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raypack: config error: {bad}: train.lr: expected a number") and err.count("\n") == 1
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no raypack_config.yaml there" in capsys.readouterr().err


def test_help_imports_no_command_module():
    code = (
        "import sys\nfrom raypack.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "loaded = [m for m in sys.modules if m.startswith('raypack.commands.') or m in ('ray', 'torch')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_help_says_what_raypack_is(capsys):
    """Its own description, not the module docstring's first line ("Parses arguments and hands off.")."""
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Supervised fine-tuning of causal language models on packed sequences" in out
    assert "raypack train --config jobs/configs/quickstart.yaml" in out
    assert "DeepSpeed ZeRO or torch's DDP and FSDP2 (train.engine)" in out  # both engines
    assert "hands off" not in out and "command line:" not in out


def test_input_errors_are_found_inside_wrapping_errors():
    """Ray re-raises a task's error as a class derived from both RayTaskError and the cause, whose
    message is a traceback dump, or with the cause in `.cause`; the innermost InputError is the one line."""
    from raypack.cli import input_error
    from raypack.data.sources import SourceError

    cause = SourceError("a.jsonl:3: malformed JSON")

    class RayLike(SourceError):  # what RayTaskError.as_instanceof_cause() builds
        def __init__(self):
            super().__init__("Traceback (most recent call last): ... 40 lines")
            self.cause = cause

    assert input_error(RayLike()) is cause
    try:
        try:
            raise cause
        except SourceError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert input_error(outer) is cause
    assert input_error(RuntimeError("a crash")) is None
