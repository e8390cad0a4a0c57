"""`raypack data` on small data: tokenized in this process, as `raypack train` prepares it
(data.driver_max_mb), with no Ray started and nothing on the screen but the summary."""

from __future__ import annotations

import pytest
import ray

from raypack.cli import main

from paths import REPO


def test_the_quickstarts_data_is_summarized_without_ray(monkeypatch, capsys):
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's Ray may be up
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["data", "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "examples   300 in (chat 300), 300 out", out
    assert [line.split()[0] for line in lines] == ["examples", "tokens", "length", "over", "no", "bad", "lost"], out


def test_show_json_says_which_tokens_train_for_each_format(tmp_path, capsys):
    """`raypack data --show N --json` on ShareGPT with a function call and OpenAI messages with
    content parts, tools and reasoning: the trained text of each row, read back from its labels."""
    import json

    from transformers import AutoTokenizer

    from raypack.config import ASSETS

    from paths import TEST_ASSETS

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    sharegpt = {"tools": json.dumps(tools), "conversations": [
        {"from": "human", "value": "weather?"}, {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": "RESULT"}, {"from": "gpt", "value": "Sunny."}]}
    openai = {"tools": tools, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet", "train": False},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "Hi again."}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(sharegpt) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(openai) + "\n")
    template = TEST_ASSETS / "chat_templates" / "trl" / "qwen3_training.jinja"
    assert main(["data", f"data.paths=[{tmp_path}]", f"tokenize.chat_template={template}", "--show", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    trained = [tok.decode([t for t in r["labels"] if t != -100]) for r in rows]
    assert [(r["source"], r["line"]) for r in rows] == [(str(tmp_path / "a.jsonl"), 1), (str(tmp_path / "b.jsonl"), 1)]
    assert [len(r["input_ids"]) == len(r["labels"]) for r in rows] == [True, True]
    assert trained == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<think>\n\n</think>\n\nSunny.<|im_end|>\n<|eos|>",
        "<think>\n\n</think>\n\nHi again.<|im_end|>\n<|eos|>",  # the first answer is train: false
    ]
    assert "RESULT" in tok.decode(rows[0]["input_ids"]) and "hi there" in tok.decode(rows[1]["input_ids"])
    # as text: the trained runs between [[ and ]] when not on a terminal, green on one
    from raypack.data.show import marked_text

    assert main(["data", f"data.paths=[{tmp_path}]", f"tokenize.chat_template={template}", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"--- {tmp_path / 'a.jsonl'} line 1: {len(rows[0]['input_ids'])} tokens, ")
    assert "[[<think>\n\n</think>\n\nSunny.<|im_end|>\n<|eos|>]]" in out and "RESULT" in out.split("]]")[1].split("[[")[0]
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    assert marked_text(tok, ids, [False, True], colour=True) == "a\033[32mb\033[0m"


def test_an_empty_final_assistant_turn_is_counted_or_refused(tmp_path, capsys):
    """It trains its end-of-turn markup as the answer (as TRL does): said, and refusable."""
    import json

    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [turn, turn[:1] + [{"role": "assistant", "content": ""}], turn,
            turn + [{"role": "user", "content": "and?"}, {"role": "assistant", "content": " \n"}],
            turn[:1] + [{"role": "assistant", "content": "", "train": False}]]  # not trained: not counted
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    assert main(["data", f"data.paths=[{path}]", "tokenize.no_labels=drop"]) == 0
    out = capsys.readouterr().out
    assert f"empty      2 chats end with an empty assistant turn, whose end-of-turn markup trains as the answer " \
           f"(tokenize.empty_answers=error refuses them); first: {path} line 2, {path} line 4\n" in out, out
    assert main(["data", f"data.paths=[{path}]", "tokenize.empty_answers=error"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} line 2: the chat ends with an empty assistant turn" in err, err


def test_the_data_guide_shows_what_raypack_data_show_prints(tmp_path, monkeypatch, capsys):
    """docs/guides/data.md's conversation rows, each through the command the guide names: its
    quoted lines (the tools preamble left out there) are the output's, in order."""
    from paths import REPO

    page = (REPO / "docs" / "guides" / "data.md").read_text().split("## Conversations, tools and reasoning", 1)[1]
    page = page.split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in page.split("```json\n")[1:]]
    assert len(blocks) == 3
    monkeypatch.chdir(REPO)
    for k, block in enumerate(blocks):
        row, quoted = block.strip(), page.split(block, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
        path = tmp_path / f"{k}.jsonl"
        path.write_text(row + "\n")
        assert main(["data", "--config", "jobs/configs/quickstart.yaml", f"data.paths=[{path}]",
                     "tokenize.chat_template=tests/assets/chat_templates/trl/qwen3.jinja", "pack.budget=2048",
                     "--show", "1"]) == 0
        out = iter(capsys.readouterr().out.splitlines())
        for line in quoted.splitlines():
            if line != "# Tools ... <|im_end|>":  # the preamble, left out in the guide
                assert any(o == line for o in out), (k, line)
