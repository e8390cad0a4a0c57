"""docs/guides/data.md's Hugging Face Hub examples, run as written, in the order the page gives
them: its commands, its `data.sources` YAML (as the data section of the quickstart's config) and
the error line it quotes.

The real hub was not reached: the datasets the page names (trl-lib/Capybara,
HuggingFaceH4/ultrachat_200k, openai/gsm8k) are served by a hub on 127.0.0.1 (tests/fakehub.py)
as same-named stand-ins with the real ones' columns, file layouts and README configs, and rows of
the bundled samples. raypack points at it as HF_ENDPOINT would point it; `hf download` runs as a
command with HF_ENDPOINT set. So this checks that the examples are spelled right and run against
datasets shaped as the real ones are, not that the real hub serves them today.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from huggingface_hub import constants
from paths import REPO

from raypack.cli import main
from raypack.data.hub import match
from raypack.data.hub_deadline import DEADLINE_S

from fakehub import FakeHub, point_at, sha, stand_in_repos
from tests.unit.test_docs import ALL, code_blocks

PAGE = REPO / "docs" / "guides" / "data.md"


def _section() -> tuple[int, int]:
    """The first and last line of the page's hub section."""
    lines = PAGE.read_text().splitlines()
    first = lines.index("## Hugging Face Hub datasets") + 1
    last = next(n for n in range(first, len(lines)) if lines[n].startswith("## "))
    return first, last


FIRST, LAST = _section()
COMMANDS = [c.text for c in ALL if c.page == "docs/guides/data.md" and FIRST < c.line < LAST]
BLOCKS = [(lang, "\n".join(body)) for lang, start, body in code_blocks(PAGE) if FIRST < start < LAST]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(REPO)
    hub = FakeHub(stand_in_repos()).start()
    yield point_at(hub, monkeypatch, tmp_path)
    hub.stop()


def _rows(hub: FakeHub, repo: str, pattern: str) -> int:
    files = hub.repos[repo].revisions["main"]
    return sum(pq.read_metadata(pa.BufferReader(files[f])).num_rows for f in match(sorted(files), pattern))


def _run(command: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """A `raypack` command of the page in this process, its VAR=value prefixes as huggingface_hub
    reads them at import (HF_HUB_OFFLINE, the one the page uses)."""
    argv = shlex.split(command)
    with monkeypatch.context() as m:
        while "=" in argv[0]:
            name, _, value = argv.pop(0).partition("=")
            assert name == "HF_HUB_OFFLINE", f"{command}: no rule for {name}"
            m.setattr(constants, name, value == "1")
        assert argv[0] == "raypack", command
        status = main(argv[1:])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_hub_sections_examples_run_as_written(hub, monkeypatch, tmp_path, capsys):
    assert [lang for lang, _ in BLOCKS] == ["bash", "yaml", "bash", "text"], BLOCKS
    # the bound the page promises is the code's (tests/unit/data/test_hub.py times it)
    assert f"gives all of its hub requests {DEADLINE_S:g} seconds together" in " ".join(PAGE.read_text().split())
    assert len(COMMANDS) == 4, COMMANDS
    show_name, show_uri, download, offline = COMMANDS
    capybara = f"hf://datasets/trl-lib/Capybara@{sha('trl-lib/Capybara', 'main')}/data/train-00000-of-00001.parquet"

    # `--show 1` by name and by URI: the first example of the train split, the same from both
    shown = []
    for command in (show_name, show_uri):
        status, out, err = _run(command, monkeypatch, capsys)
        assert (status, err) == (0, ""), (command, err)
        assert out.startswith(f"--- {capybara} row 0 (0-based): "), (command, out[:300])
        shown.append(out)
    assert shown[0] == shown[1]

    # offline before the download: the error line the page quotes, word for word
    quoted = BLOCKS[3][1].strip()
    assert _run(offline, monkeypatch, capsys) == (2, "", quoted + "\n")

    # `hf download`, a command of its own (huggingface_hub's CLI) pointed at the hub by HF_ENDPOINT
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=constants.HF_HUB_CACHE, HF_HOME=str(tmp_path / "hf"))
    argv = shlex.split(download)
    hf = Path(sys.executable).parent / argv[0]
    result = subprocess.run([str(hf), *argv[1:]], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]

    # then offline: the cache's copy, nothing asked of the hub
    asked = len(hub.requests)
    status, out, err = _run(offline, monkeypatch, capsys)
    n = _rows(hub, "trl-lib/Capybara", "data/train-*")
    assert (status, err, out.splitlines()[0]) == (0, "", f"examples   {n} in (chat {n}), {n} out")
    assert len(hub.requests) == asked

    # the YAML: a mixture of a split and a config, read by `raypack data` as the quickstart's data
    config = yaml.safe_load((REPO / "jobs" / "configs" / "quickstart.yaml").read_text())
    config["data"] = yaml.safe_load(BLOCKS[1][1])["data"]
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(config))
    status, out, err = _run(f"raypack data --config {tmp_path / 'hub.yaml'}", monkeypatch, capsys)
    chats = _rows(hub, "HuggingFaceH4/ultrachat_200k", "data/train_sft-*")
    problems = _rows(hub, "openai/gsm8k", "main/train-*")
    assert (status, err) == (0, "")
    assert out.splitlines()[0] == f"examples   {chats + problems} in (chat {chats}, completion {problems}), " \
                                  f"{chats + problems} out", out


def _bad_rows() -> dict[int, dict]:
    """A row that each quoted line is about, by its line number."""
    ask, call = {"role": "user", "content": "Weather in Paris?"}, {"type": "function", "function": {"name": "get_weather"}}
    return {
        7: {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                              {"from": "bot", "value": "?"}]},
        9: {"messages": [ask, {"role": "assistant", "content": None,
                               "tool_calls": [{"type": "function", "function": {"arguments": {"city": "Paris"}}}]}]},
        12: {"messages": [ask, {"role": "assistant", "content": None, "tool_calls": [
            {**call, "function": {**call["function"], "arguments": "{city: 'Paris'}"}}]}]},
        15: {"messages": [ask, {"role": "assistant", "content": "Sunny."}], "tools": call},
        18: {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                          {"role": "assistant", "content": "Sunny."}]},
    }


def test_the_bad_row_lines_are_what_raypack_prints(tmp_path, monkeypatch, capsys):
    """The page's bad-row lines: each one `raypack data` prints for a file whose line holds such a
    row after good rows of its format, run as the page's conversation commands are, in a folder
    that stands for the page's `/work`."""
    import json

    page = PAGE.read_text().split("Each bad row is one line", 1)[1]
    quoted = page.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    good = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    rows = _bad_rows()
    assert [int(line.split(" line ", 1)[1].split(":")[0]) for line in quoted] == list(rows)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    template = REPO / "tests" / "assets" / "chat_templates" / "trl" / "qwen3.jinja"
    for line, (number, bad) in zip(quoted, rows.items()):
        fill = good if "conversations" in bad else {"messages": [{"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Hello."}]}
        (tmp_path / "data" / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [fill] * (number - 1) + [bad]))
        status = main(["data", "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml"),
                       "data.paths=[data/tools.jsonl]", f"tokenize.chat_template={template}", "pack.budget=2048"])
        assert (status, capsys.readouterr().err) == (2, line.replace("/work/", f"{tmp_path}/") + "\n")
