"""The docs' `raypack plan` and `raypack data` commands, run as printed, on the shared local Ray
instance: those whose config trains on the bundled assets (a tiny model, the sample data, the
bundled tokenizer). Commands on other data and models are checked without running in
tests/unit/test_docs.py; the quickstart itself runs in tests/ray/commands/test_train.py."""

from __future__ import annotations

import pytest
from paths import REPO

from raypack.cli import build_parser, main
from raypack.config import ASSETS, ASSETS_PREFIX, load
from tests.unit.test_docs import ALL, words


def _bundled(command) -> bool:
    argv = words(command)[1:]
    if not argv or argv[0] not in ("plan", "data"):
        return False
    args = build_parser().parse_args(argv)
    if not args.config or getattr(args, "lengths", None):
        return False
    cfg = load(REPO / args.config, args.overrides)
    return (cfg.model.name.startswith("tiny-") and cfg.tokenize.tokenizer.startswith((ASSETS_PREFIX, str(ASSETS)))
            and all(p.startswith((ASSETS_PREFIX, str(ASSETS)))
                    for p in (*cfg.data.paths, *(q for s in cfg.data.sources for q in s.paths))))


RUNNABLE = [c for c in ALL if _bundled(c)]


def test_some_commands_are_run():
    assert len(RUNNABLE) >= 3, RUNNABLE


@pytest.mark.parametrize("command", RUNNABLE, ids=str)
def test_docs_command_runs(command, ray_local, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(words(command)[1:]) == 0, capsys.readouterr().err[-2000:]
    assert capsys.readouterr().out.strip()


def test_the_mixture_guide_quotes_what_raypack_plan_prints(ray_local, monkeypatch, capsys):
    """docs/guides/data.md's mixture lines are the output of the command above them, as printed."""
    monkeypatch.chdir(REPO)
    page = (REPO / "docs" / "guides" / "data.md").read_text()
    command = "raypack plan --config jobs/configs/mixture.yaml"
    quoted = page.split(command, 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    assert main(command.split()[1:]) == 0
    out = capsys.readouterr().out.splitlines()
    assert quoted and all(line in out for line in quoted), (quoted, out)
