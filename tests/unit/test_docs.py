"""The docs can't rot: the site builds with --strict, the README stays a landing page, and every
shell command in a code block of the README and the docs is run here (the cheap ones: `raypack
config`, `--help`) or checked (it parses; the config it names exists and loads with its
overrides; the make target, script or repository path it names exists).

Code blocks are fenced with a language: `bash` blocks hold commands, `text` blocks output and
pictures. A command whose program this module doesn't know fails the check, so a new kind of
command in the docs gets a rule here rather than going unchecked.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import REPO

from raypack.cli import build_parser, main
from raypack.config import load
from raypack.data.strategies import check_strategies

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md")), REPO / "cluster" / "README.md"]
SHELL = {"bash", "sh", "shell", "console"}
EXTERNAL = {"aws", "gcloud", "kubectl", "helm", "eksctl", "docker", "hf", "wandb", "pip", "export", "for", "done",
            "do", "ssh", "git"}  # fmt: skip
"""Programs of clouds and other tools, not runnable here: only the repository paths they name are checked."""
REPO_PATH = re.compile(r"^(?:\./)?(cluster|jobs|raypack|docker|tools|benchmarks|tests|docs)/[\w./*-]*[\w*]$")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def code_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line, lines) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s*```(\S*)", line)
        if m and lang is None:
            lang, start, body = m.group(1), number + 1, []
        elif m:
            blocks.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def commands() -> list[Command]:
    out = []
    for page in PAGES:
        name = str(page.relative_to(REPO))
        for lang, start, lines in code_blocks(page):
            if lang not in SHELL:
                continue
            joined, first = "", None
            for offset, line in enumerate(lines):
                first = start + offset if first is None else first
                joined += line.rstrip()
                if joined.endswith("\\"):
                    joined = joined[:-1] + " "
                    continue
                if joined.strip() and not joined.strip().startswith("#"):
                    out.append(Command(name, first, joined.strip()))
                joined, first = "", None
    return out


ALL = commands()


def words(command: Command) -> list[str]:
    try:
        argv = shlex.split(command.text, comments=True)
    except ValueError:  # a quote that a later line closes (a JSON body): an external tool's argument
        argv = command.text.split()
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    return argv


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, re.MULTILINE))


def check_raypack(argv: list[str], where: Command) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        raise AssertionError(f"{where}: the command line doesn't parse") from None
    config = getattr(args, "config", None)
    overrides = getattr(args, "overrides", None) or [i for i in getattr(args, "items", []) if "=" in i]
    if config or overrides:
        if config:
            assert (REPO / config).is_file(), f"{where}: {config} doesn't exist"
        check_strategies(load(REPO / config if config else None, overrides))  # overrides: valid fields and values
    if args.command == "plan" and args.lengths and not args.lengths.endswith(".npy"):
        raise AssertionError(f"{where}: --lengths takes a .npy file")


def check_python(argv: list[str], where: Command) -> None:
    script = argv[1]
    assert (REPO / script).is_file(), f"{where}: {script} doesn't exist"
    if script.startswith("jobs/") and "--config" in argv:
        config = argv[argv.index("--config") + 1]
        assert (REPO / config).is_file(), f"{where}: {config} doesn't exist"
        overrides = [a for a in argv[argv.index("--config") + 2:] if "=" in a]
        check_strategies(load(REPO / config, overrides))


def check_paths(argv: list[str], where: Command) -> None:
    for word in argv:
        word = word.rstrip(",;:)")
        if REPO_PATH.match(word) and "<" not in word:
            assert list(REPO.glob(word.removeprefix("./"))), f"{where}: {word} doesn't exist in the repository"


def check(command: Command) -> str:
    """Checks one command; says how ('run', 'checked', 'paths')."""
    argv = words(command)
    if not argv:
        return "empty"
    program = argv[0]
    if program in ("raypack", ".venv/bin/raypack"):
        check_raypack(argv[1:], command)
        return "checked"
    if program in ("python", "python3"):
        check_python(argv, command)
        return "checked"
    if program == "make":
        unknown = [t for t in argv[1:] if "=" not in t and t not in makefile_targets()]
        assert not unknown, f"{command}: no make target {unknown}"
        return "checked"
    if program == "cluster/local.sh":  # before the general rule for the repository's scripts
        assert argv[1] in ("start", "status", "stop"), f"{command}: local.sh has no {argv[1]!r}"
        return "checked"
    if REPO_PATH.match(program):  # a script of the repository (cluster/gke-cluster.sh)
        assert (REPO / program).is_file(), f"{command}: {program} doesn't exist"
        check_paths(argv, command)
        return "checked"
    if program == "ray":
        if "--" in argv and argv[argv.index("--") + 1:][:1] in (["python"], ["python3"]):
            check_python(argv[argv.index("--") + 1:], command)
            return "checked"
        check_paths(argv, command)
        return "paths"
    if program in EXTERNAL or program.startswith(("$", "--")) or "=$(" in command.text:
        check_paths(argv, command)
        return "paths"
    raise AssertionError(f"{command}: a command test_docs.py has no rule for ({program!r})")


@pytest.mark.parametrize("command", ALL, ids=str)
def test_every_command_in_the_docs_is_checked(command):
    check(command)


def test_the_commands_are_found():
    """The scan itself works: the README's two commands and the reference's `raypack config` are seen."""
    texts = {c.text for c in ALL}
    assert {"make run", "make test"} <= texts
    assert "raypack config pack.budget                                  # type, default, allowed values, docstring" \
        in texts or any(c.text.startswith("raypack config pack.budget") for c in ALL)


CHEAP = [c for c in ALL if re.match(r"^(\.venv/bin/)?raypack (config\b|[a-z]+ --help$|--help$)", words(c) and
                                    shlex.join(words(c)) or "")]


@pytest.mark.parametrize("command", CHEAP, ids=str)
def test_cheap_commands_run(command, capsys):
    argv = words(command)[1:]
    try:
        status = main(argv)
    except SystemExit as e:  # --help
        status = e.code
    assert status == 0, f"{command}: exit status {status}: {capsys.readouterr().err}"
    assert capsys.readouterr().out.strip()


def test_every_code_block_names_its_language():
    """`bash` blocks are checked above; an unnamed fence would hide commands from the check."""
    unnamed = [f"{page.relative_to(REPO)}:{start - 1}" for page in PAGES for lang, start, _ in code_blocks(page)
               if not lang]
    assert not unnamed, f"code blocks without a language (bash for commands, text for output): {unnamed}"


def test_start_here_links_every_guide():
    """The docs index's "Start here" names every page of the guides (the nav has them all too)."""
    start = (DOCS / "index.md").read_text().split("## Start here", 1)[1]
    linked = set(re.findall(r"\]\((guides/[\w-]+\.md)\)", start))
    guides = {f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}
    assert guides <= linked, f"missing from Start here: {sorted(guides - linked)}"


def test_readme_is_a_landing_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_the_site_builds_strict(tmp_path):
    """A broken link, an anchor that doesn't exist or a page missing from the nav fails the build."""
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1",
                                                                           "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "pack.budget" in config and "Tokens per packed row" in config
    # long lines in code blocks wrap in the text column, not cut off past it (at 1280 px, both sidebars shown)
    assert 'href="../../stylesheets/extra.css"' in config
    css = " ".join((tmp_path / "site" / "stylesheets" / "extra.css").read_text().split())
    assert ".md-typeset pre > code { white-space: pre-wrap;" in css
    assert "raypack config" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    results = sorted((REPO / "benchmarks" / "results").glob("*.md"))
    benchmarks = (tmp_path / "site" / "reference" / "benchmarks" / "index.html").read_text()
    assert all(f"results/{p.stem}/" in benchmarks for p in results), "a results file missing from the index"


QUICKSTART = REPO / "jobs" / "configs" / "quickstart.yaml"
"""What `make run` trains (the Makefile's run target), before any guide's command."""


def run_commands() -> list[tuple[Command, str, dict, str]]:
    """(command, "train" or "sweep", its resolved config, the (storage path, run name) it writes) of
    every command in the docs that starts a run or a sweep from a config: `raypack train` and
    `sweep`, and `jobs/sft.py` and `jobs/sweep.py` under `ray job submit`."""
    out = []
    for command in ALL:
        argv = words(command)
        if argv[:1] == ["ray"] and "--" in argv:
            argv = argv[argv.index("--") + 1:]
        if argv[:1] in (["python"], ["python3"]) and argv[1:2] in (["jobs/sft.py"], ["jobs/sweep.py"]):
            argv = ["raypack", "train" if argv[1] == "jobs/sft.py" else "sweep", *argv[2:]]
        if argv[:1] not in (["raypack"], [".venv/bin/raypack"]) or argv[1:2] not in (["train"], ["sweep"]) \
                or "--help" in argv:
            continue
        args = build_parser().parse_args(argv[1:])
        if args.resume:  # continues the run in the folder it names
            continue
        cfg = load(REPO / args.config if args.config else None, args.overrides)
        out.append((command, args.command, cfg.to_dict(), f"{cfg.run.storage_path}/{cfg.run.name}"))
    return out


def test_every_run_in_the_docs_has_a_run_name_of_its_own():
    """Followed in any order after the quickstart, in a fresh clone, each command of the docs
    that starts a run trains it: a config other than the quickstart's under the quickstart's run
    name would be refused (a run trains the config it was started with), or say the run is
    complete. So two commands share a run folder only when they train the same config (the same
    run shown on two pages: the second says it is complete), and never a sweep (a second sweep in
    a folder is refused)."""
    quickstart = load(QUICKSTART)
    seen = {f"{quickstart.run.storage_path}/{quickstart.run.name}": ("the quickstart (make run)", quickstart.to_dict())}
    clashes = []
    for command, kind, cfg, folder in run_commands():
        if folder in seen and (seen[folder][1] != cfg or kind == "sweep"):
            clashes.append(f"{command}: writes {folder}, as {seen[folder][0]} does; give it a run.name=... of its own")
        seen.setdefault(folder, (str(command), cfg))
    assert not clashes, "\n".join(clashes)


def test_the_run_name_check_finds_the_guides_runs():
    runs = run_commands()
    kinds = {kind for _, kind, _, _ in runs}
    assert kinds == {"train", "sweep"} and len(runs) >= 20, runs
    pages = {command.page for command, *_ in runs}
    assert {"docs/guides/hybrid-models.md", "docs/guides/moe.md", "docs/guides/vision.md"} <= pages


def test_the_mixture_guide_shows_the_shipped_config():
    """The data section docs/guides/data.md shows is jobs/configs/mixture.yaml's, comments and all
    (the config the guide's `raypack plan` runs, tests/ray/test_docs.py)."""
    page = (DOCS / "guides" / "data.md").read_text().split("## Mixtures", 1)[1]
    shown = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = (REPO / "jobs" / "configs" / "mixture.yaml").read_text()
    assert shown.startswith("data:\n") and shown in config
