"""MkDocs hooks (mkdocs.yml `hooks:`): the docs pages that the code already knows, generated at build time.

A page holds a marker where generated text goes:

    <!-- raypack:config -->          every config section and field (raypack/config/reference.py)
    <!-- raypack:cli -->             every command and option, from raypack.cli.build_parser()
    <!-- raypack:errors -->          the one-line errors raypack raises, by what the user was doing
    <!-- raypack:benchmarks -->      every results file in benchmarks/results/, newest first
    <!-- raypack:models -->          the supported-models table the family tests run (raypack/model/families.py)
    <!-- raypack:engines -->         each training mode on each engine and stage, as the config answers (engines/modes.py)
    <!-- raypack:include PATH -->    a file of the repository (cluster/README.md), headings one level down

and every `benchmarks/results/*.md` becomes a page `results/<name>.md`, so pages link the
evidence without copying it. Nothing here is written twice: a new field, option, error or
results file appears in the site at the next build.
"""

from __future__ import annotations

import ast
import html
import re
import subprocess
from datetime import date
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(r"<!-- raypack:(\w+)(?: (\S+))? -->")


def on_files(files, config):
    for path in sorted(RESULTS.glob("*.md")):
        files.append(File.generated(config, f"results/{path.name}", content=_results_page(path),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown, page, config, files):
    def expand(match: re.Match) -> str:
        kind, arg = match.group(1), match.group(2)
        if kind == "include":
            return _include(arg)
        return GENERATORS[kind]()

    return MARKER.sub(expand, markdown)


def escape(text: str) -> str:
    """Markdown text safe outside code spans: `<run>` would otherwise be read as an HTML tag."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else html.escape(p, quote=False) for p in parts)


# -- configuration --------------------------------------------------------------------------------

def config_reference() -> str:
    import yaml

    from raypack.config.reference import reference

    out = []
    for e in reference():
        depth = e.path.count(".")
        if e.section:
            out.append(f"{'#' * (2 + depth)} `{e.path}`\n\n{escape(e.doc)}\n")
            continue
        default = yaml.safe_dump(e.default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        facts = [f"**type** {escape(e.type)}", f"**default** `{default}`"]
        out.append(f"{'#' * (2 + depth)} `{e.path}`\n\n{' · '.join(facts)}\n\n{escape(e.doc)}\n")
    return "\n".join(out)


# -- command line ---------------------------------------------------------------------------------

def cli_reference() -> str:
    import argparse

    from raypack.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        p.prog = f"raypack {name}"
        out.append(f"## `raypack {name}`\n\n{escape(helps.get(name) or '')}\n")
        out.append(f"```text\n{p.format_usage().strip()}\n```\n")
        rows = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = ", ".join(a.option_strings) or a.metavar or a.dest
            choices = f" (one of {', '.join(map(str, a.choices))})" if a.choices else ""
            rows.append(f"| `{flag}` | {escape((a.help or '').replace('|', '/'))}{choices} |")
        out.append("| argument | what it does |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


# -- errors ---------------------------------------------------------------------------------------

ERROR_TYPES = {"InputError", "ConfigError", "SourceError", "StorageError", "UnsupportedModelError", "ChatError",
               "AdapterError", "ModelNotFoundError", "ExportError", "PreparationFailed", "TrackingError",
               "UnsupportedLossError", "DivergedError", "TokenizeError", "SourcesChangedError", "FormatError",
               "TurnError"}  # fmt: skip
"""The exceptions a user sees as one line (raypack.errors.InputError and its kinds; FormatError and
TurnError are re-raised as one). tests/unit/test_docs.py checks the list against the code."""

ACTIVITIES = [
    ("Writing a config or a command line", ("raypack/config/", "raypack/typed.py", "raypack/cli.py",
                                            "raypack/data/strategies.py")),
    ("Reading and preparing data", ("raypack/data/", "raypack/storage.py")),
    ("Loading a model", ("raypack/model/build.py", "raypack/model/traits.py", "raypack/model/attention.py",
                         "raypack/model/exact.py", "raypack/model/kernels.py", "raypack/model/checkpointing.py",
                         "raypack/model/adapters.py", "raypack/model/ulysses.py", "raypack/model/")),
    ("Starting and running training", ("raypack/train/", "raypack/runtime.py")),
    ("Resuming or rerunning a run", ("raypack/runs.py", "raypack/commands/train.py")),
    ("Exporting and chatting", ("raypack/commands/export.py", "raypack/commands/chat.py")),
    ("Sweeping", ("raypack/tune/", "raypack/commands/sweep.py")),
    ("Other commands", ("raypack/",)),
]
EXPORT_MODULES = ("raypack/train/export.py", "raypack/train/chat.py")


def collect_errors() -> list[tuple[str, int, str]]:
    """(module, line, message) for every `raise <one-line error>(message)` whose message is a
    string, an f-string or a sum of them; a placeholder shows the expression it formats."""
    found = []
    for path in sorted((REPO / "raypack").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name not in ERROR_TYPES or not node.exc.args:
                continue
            message = _template(node.exc.args[0])
            # A re-raise that adds only a prefix (`{source}: {e}`) says nothing of its own.
            if message and len(re.findall(r"[A-Za-z]{2,}", re.sub(r"\{[^}]*\}", "", message))) >= 3:
                found.append((str(path.relative_to(REPO)), node.lineno, " ".join(message.split())))
    return found


def _template(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + _short(v.value) + "}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        return None if left is None and right is None else (left or "{…}") + (right or "{…}")
    return None


def _short(expr: ast.AST) -> str:
    text = ast.unparse(expr)
    return text if len(text) <= 24 else "…"


def errors_reference() -> str:
    groups: dict[str, list[tuple[str, int, str]]] = {title: [] for title, _ in ACTIVITIES}
    for module, line, message in collect_errors():
        prefixes = [(p, t) for t, ps in ACTIVITIES for p in ps if module.startswith(p)]
        title = "Exporting and chatting" if module in EXPORT_MODULES else max(prefixes, key=lambda x: len(x[0]))[1]
        groups[title].append((module, line, message))
    out = []
    for title, items in groups.items():
        if not items:
            continue
        out.append(f"## {title}\n")
        for module, line, message in items:
            out.append(f"- `` {message.replace('``', '` `')} `` (`{module}:{line}`)")
        out.append("")
    return "\n".join(out)


# -- benchmarks -----------------------------------------------------------------------------------

NAME = re.compile(r"^(?P<theme>.+?)_(?P<device>cpu|gpu|[a-z]+\d+)(?:_[a-z]+)*_(?P<date>\d{8})(?P<rest>.*)\.md$")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def results_index() -> list[dict]:
    last_change = _git("log", "-1", "--format=%cs", "--", "raypack")
    rows = []
    for path in RESULTS.glob("*.md"):
        text = path.read_text()
        m = NAME.match(path.name)
        theme, device, day = (m["theme"], m["device"], m["date"]) if m else (path.stem, "?", "")
        commit = re.search(r"\bcommit:? `?([0-9a-f]{7,40})\b", text, re.IGNORECASE)
        commit = commit.group(1) if commit else None
        title = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")), path.stem)
        since = None
        if commit:
            count = _git("rev-list", "--count", f"{commit}..HEAD", "--", "raypack")
            since = f"{count} commits to raypack/ since" if count is not None else "commit not in this clone"
        elif day and last_change:
            measured = date(int(day[:4]), int(day[4:6]), int(day[6:]))
            since = ("raypack/ changed after this date" if date.fromisoformat(last_change) > measured
                     else "no later change to raypack/")
        rows.append(dict(name=path.name, title=title, theme=theme, device=device.upper() if device != "cpu" else "CPU",
                         day=f"{day[:4]}-{day[4:6]}-{day[6:]}" if day else "?", commit=commit, since=since or "unknown"))
    return sorted(rows, key=lambda r: (r["day"], r["name"]), reverse=True)


def benchmarks_index() -> str:
    out = ["| date | device | results | commit | code since |", "|---|---|---|---|---|"]
    for r in results_index():
        commit = f"`{r['commit']}`" if r["commit"] else "not recorded"
        out.append(f"| {r['day']} | {r['device']} | [{escape(r['title'])}](../results/{r['name']}) | {commit} | "
                   f"{r['since']} |")
    return "\n".join(out) + "\n"


def _results_page(path: Path) -> str:
    # Below the reference pages in search: "budget" should find pack.budget before a table that has the word.
    return "---\nsearch:\n  boost: 0.3\n---\n\n" + path.read_text()


# -- supported models -----------------------------------------------------------------------------

def models_reference() -> str:
    """Every row of the family tests' table, as this checkout's raypack judges it with the installed
    transformers: exact (the modes the tests check, the CUDA kernels) or the refusal it prints."""
    import transformers

    from raypack.model.families import checked

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the tiny configs' own warnings are no news to a docs build
    try:
        rows = checked()
    finally:
        transformers.logging.set_verbosity(verbosity)
    families = {r.spec.module_name(r.key) for r in rows}
    refused = [r for r in rows if r.refusal]
    out = [f"Generated by `make docs` from `raypack/model/family_table.py`, the table "
           f"`tests/unit/model/test_families.py` and every test parametrized by family run, with transformers "
           f"{transformers.__version__}: {len(rows)} rows of {len(families)} families, {len(rows) - len(refused)} "
           f"exact and {len(refused)} refused.\n",
           "## Exact\n", "| row | config | layout | checked | on CUDA, when installed | layout's source |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if not r.refusal:
            out.append(f"| `{r.key}` | `{r.spec.config}` | {escape(r.spec.layout) or '-'} | {', '.join(r.modes)} | "
                       f"{escape(r.cuda)} | {escape(r.spec.source) or 'the config class, at tiny sizes'} |")
    out += ["", "## Refused\n", "Each as raypack prints it before training; the padded strategies still train them.\n"]
    for r in refused:
        layout = f" {escape(r.spec.layout)}." if r.spec.layout else ""
        message = r.refusal.replace("`", "'")
        out.append(f"- **`{r.key}`** (`{r.spec.config}`).{layout} Checked: {', '.join(r.modes)}. `` {message} ``")
    return "\n".join(out) + "\n\n" + vision_reference()


def vision_reference() -> str:
    """Every vision-language row of tests/vision_families.py (the table tests/unit/model/test_vision.py
    runs), judged by raypack's check on the driver (`check_vlm_packable`, the model built on meta)."""
    import sys

    import torch
    from transformers import AutoModelForImageTextToText

    from raypack.errors import UnsupportedModelError
    from raypack.model.vision import TINY_VLMS, check_vlm_packable

    sys.path.insert(0, str(REPO / "tests"))
    from vision_families import CHECKPOINTED, VLM_FAMILIES

    tiny = {"qwen2_5_vl": "tiny-qwen2_5_vl", "llava_clip": "tiny-llava", "idefics3": "tiny-idefics3"}
    assert set(tiny.values()) == set(TINY_VLMS), "a tiny VLM without its row here"
    layouts = {"patches": "flat patches and their grids (dynamic resolution)", "pictures": "whole pictures",
               "sized": "pictures with their sizes", "stacked": "tiles of each picture"}
    out = ["## Vision-language models\n",
           f"Generated from `tests/vision_families.py`, the table `tests/unit/model/test_vision.py` runs: "
           f"{len(VLM_FAMILIES)} rows. **packed**: three examples (one image, text only, two images of other sizes) "
           "in one row, logits, loss and every gradient of the tower, projector and language model against each "
           "example alone through the model's own forward; **frozen**: the tower (and projector) frozen; **LoRA**: on "
           "the language model, and on every linear layer of both towers; **checkpointing**: full recompute. "
           "The `tiny-*` names train end to end through `raypack train` ([Vision-language models]"
           "(../guides/vision.md)).\n",
           "| row | config | images as | checked | `model.name` on the CPU |", "|---|---|---|---|---|"]
    refused = []
    for key, spec in VLM_FAMILIES.items():
        config = spec.build_config()
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        try:
            check_vlm_packable(model, key)
        except UnsupportedModelError as e:
            refused.append(f"- **`{key}`** (`{spec.config}`). `` {str(e).replace('`', chr(39))} ``")
            continue
        modes = ["packed", "frozen", "LoRA"] + (["checkpointing"] if key in CHECKPOINTED else [])
        out.append(f"| `{key}` | `{spec.config}` | {layouts[spec.layout]} | {', '.join(modes)} | "
                   f"{'`' + tiny[key] + '`' if key in tiny else '-'} |")
    if refused:
        out += ["", "Refused, as raypack prints it before training (the padded strategies still train them):\n", *refused]
    return "\n".join(out) + "\n"


# -- engines --------------------------------------------------------------------------------------

def engines_matrix() -> str:
    """Each mode of raypack/train/engines/modes.py on each engine and zero_stage: accepted, or the
    refusal the config prints (numbered below the table)."""
    from raypack.train.engines.modes import STAGES, matrix

    rows, refusals = [], {}
    for mode, cells in matrix():
        marks = []
        for cell in cells.values():
            if cell is None:
                marks.append("yes")
            else:
                number = refusals.setdefault(cell, len(refusals) + 1)
                marks.append(f"no ({number})")
        rows.append(f"| {escape(mode.name)} | " + " | ".join(marks) + f" | {escape(mode.checked)} |")
    stages = " | ".join(f"DeepSpeed {s}" for s in STAGES) + " | " + " | ".join(f"torch {s}" for s in STAGES)
    out = [f"| mode | {stages} | trained in |", "|---|" + "---|" * (2 * len(STAGES)) + "---|", *rows, ""]
    out += [f"{n}. `` {message.replace('`', chr(39))} ``" for message, n in refusals.items()]
    return "\n".join(out) + "\n"


# -- includes -------------------------------------------------------------------------------------

def _include(relative: str) -> str:
    text = (REPO / relative).read_text()
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(out) + "\n"


GENERATORS = {"config": config_reference, "cli": cli_reference, "errors": errors_reference,
              "benchmarks": benchmarks_index, "models": models_reference, "engines": engines_matrix}
