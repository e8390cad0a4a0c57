"""Chat data as people keep it (raypack/data/chat.py): ShareGPT, content parts, tool calls, tool
results, a `tools` column, reasoning, and the per-message `train` flag; what each row trains on
under real chat templates (TRL's copies in tests/assets/chat_templates/trl/), checked against
TRL's own SFT preprocessing where TRL masks the assistant (templates with {% generation %}), and
otherwise against the trained text written out here by hand from the template's rendering."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from paths import TEST_ASSETS
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from raypack.config import ASSETS
from raypack.data import sources
from raypack.data.encode import Encoder, TokenizeError
from raypack.data.formats import IGNORE_INDEX as IGNORE
from raypack.data.formats import validate
from raypack.data.listing import list_sources, read_units

TOK = str(ASSETS / "tokenizer")
TRL_TEMPLATES = TEST_ASSETS / "chat_templates" / "trl"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "SCHEMA-TEXT",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def agent(content="Let me look.", reasoning="REASON-A", final_reasoning="REASON-B", key="reasoning_content"):
    """A tool-using conversation: every text that must not train is spelled in capitals with -TEXT."""
    call = {"role": "assistant", "content": content, "tool_calls": [CALL]}
    final = {"role": "assistant", "content": "FINAL-ANSWER"}
    if reasoning:
        call[key] = reasoning
    if final_reasoning:
        final[key] = final_reasoning
    return [{"role": "system", "content": "SYSTEM-TEXT"}, {"role": "user", "content": "USER-TEXT"}, call,
            {"role": "tool", "content": "RESULT-TEXT"}, final]


def read(path, declared="auto"):
    units = read_units(list_sources((str(path),)))
    return pa.concat_tables([sources.read_unit({k: [u[k]] for k in u}, declared) for u in units]).to_pylist()


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def template(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text()


def encode(record, chat_template, label_mask="auto"):
    fields = validate(record, "chat")
    row = {n: [fields.get(n)] for n in sources.SCHEMA.names}
    row["example_id"], row["format"] = [0], ["chat"]
    table = pa.Table.from_pydict(row, schema=sources.SCHEMA)
    (out,) = Encoder(TOK, chat_template, label_mask, "truncate", 8192).encode_table(table).to_pylist()
    return out


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOK)


def trained_text(tok, out) -> str:
    return tok.decode([t for t in out["labels"] if t != IGNORE])


# --- reading ---------------------------------------------------------------------------------------


def test_sharegpt_is_detected_and_read_as_messages(tmp_path):
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    record = {"system": "be brief", "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "weather?"}, {"from": "function_call", "value": call},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny.", "train": False}]}
    (row,) = read(jsonl(tmp_path / "s.jsonl", [record]))
    assert row["error"] is None and row["format"] == "chat"
    assert json.loads(row["messages"]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": json.loads(call)}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny.", "train": False}]
    assert json.loads(row["tools"]) == TOOLS


def test_openai_messages_keep_every_field_the_template_reads(tmp_path):
    parts = [{"type": "text", "text": "USER-"}, {"type": "text", "text": "TEXT"}]
    msgs = agent()
    msgs[1] = {"role": "user", "content": parts}
    msgs[3] = {"role": "tool", "content": "RESULT-TEXT", "tool_call_id": "c1", "name": "get_weather"}
    (row,) = read(jsonl(tmp_path / "m.jsonl", [{"messages": msgs, "tools": TOOLS, "id": 7}]))
    assert row["error"] is None
    want = agent()
    want[3] = msgs[3]
    assert json.loads(row["messages"]) == want  # the parts joined, everything else as given
    assert json.loads(row["tools"]) == TOOLS
    # `tools: []` is no tools, as TRL's apply_chat_template reads it; a JSON string is its list
    (empty,) = read(jsonl(tmp_path / "e.jsonl", [{"messages": msgs, "tools": []}]))
    (text,) = read(jsonl(tmp_path / "t.jsonl", [{"messages": msgs, "tools": json.dumps(TOOLS)}]))
    assert empty["tools"] is None and json.loads(text["tools"]) == TOOLS


BAD = [
    ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from: unknown role 'robot'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.name: a tool call needs a function name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: Paris"}}]}]}, "messages[0].tool_calls[0].function.arguments is not JSON"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"name": "f"}}, "`tools` must be a list of tool schemas"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}]},
     "messages[0].content[0]: unknown content part type 'audio'"),
    ({"messages": [{"role": "user", "content": "hi", "weight": 0}]}, "messages[0].weight: a message field raypack does not pass"),
    ({"messages": [{"role": "user", "content": "hi", "train": True}]}, "messages[0].train: only assistant turns train"),
    ({"messages": [{"role": "user", "content": "hi", "reasoning_content": "r"}]},
     "messages[0].reasoning_content: only an assistant message may hold"),
    ({"conversations": [{"from": "function_call", "value": "get_weather(Paris)"}]},
     "conversations[0].value: a function_call's value is not JSON"),
]


@pytest.mark.parametrize("record,problem", BAD, ids=[p.split(":")[0][:40] for _, p in BAD])
def test_bad_chat_rows_are_one_line_naming_file_line_and_field(tmp_path, record, problem):
    path = jsonl(tmp_path / "bad.jsonl", [record])
    (row,) = read(path, "sharegpt" if "conversations" in record else "chat")
    assert row["error"].startswith(f"{path} line 1: {problem}"), row["error"]
    assert "\n" not in row["error"]


# --- what trains -----------------------------------------------------------------------------------


def _trl(records: list[dict], chat_template: str) -> list[dict]:
    """TRL's own SFT preprocessing of `records` (SFTTrainer._prepare_dataset, assistant_only_loss)."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    tok = AutoTokenizer.from_pretrained(TOK)
    args = SFTConfig(output_dir="/tmp/unused", assistant_only_loss=True, max_length=None, report_to=[], bf16=False,
                     use_cpu=True)
    trainer = SimpleNamespace(_tokenizer=tok, chat_template=chat_template, completion_only_loss=None)
    # one row a dataset: Arrow gives every message the union of the rows' keys, as nulls
    return [SFTTrainer._prepare_dataset(trainer, Dataset.from_list([r]), tok, args, False, None, "train")[0]
            for r in records]


R1_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
R1_AGENT = [{"role": "user", "content": "USER-TEXT"}, {"role": "assistant", "content": None, "tool_calls": [R1_CALL]},
            {"role": "tool", "content": "RESULT-TEXT"}, {"role": "assistant", "content": "FINAL-ANSWER"}]
TRL_CASES = {  # TRL's training templates: {% generation %} marks each assistant turn, TRL masks by it
    "qwen3_training": [{"messages": agent(), "tools": json.dumps(TOOLS)},
                       {"messages": agent(content=""), "tools": json.dumps(TOOLS)}],
    "gptoss_training": [{"messages": agent(content="", key="thinking"), "tools": json.dumps(TOOLS)}],
}


@pytest.mark.parametrize("name", sorted(TRL_CASES))
def test_tool_rows_train_as_trl_trains_them(name):
    records = TRL_CASES[name]
    for record, ref in zip(records, _trl(records, template(name))):
        ours = encode({"messages": record["messages"], "tools": record["tools"] and json.loads(record["tools"])},
                      template(name))
        n = len(ref["input_ids"])  # raypack appends EOS, trained, where TRL doesn't
        assert ours["input_ids"][:n] == ref["input_ids"] and ours["labels"][:n] == ref["labels"]
        assert ours["input_ids"][n:] == ours["labels"][n:] == [AutoTokenizer.from_pretrained(TOK).eos_token_id]
        assert "RESULT-TEXT" in AutoTokenizer.from_pretrained(TOK).decode(ref["input_ids"])  # the test sees tools


CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# template -> (record, the trained text of each assistant turn, in order): what the template
# renders for the turn after its generation prompt, up to its end-of-turn markup
PLAIN = {
    # Qwen3: reasoning and tool calls of turns after the last user message, <|im_end|> closes
    "qwen3": ({"messages": agent(), "tools": TOOLS}, [
        f"<think>\nREASON-A\n</think>\n\nLet me look.\n<tool_call>\n{CALL_TEXT}\n</tool_call><|im_end|>",
        "<think>\nREASON-B\n</think>\n\nFINAL-ANSWER<|im_end|>"]),
    "qwen3 (no content)": ({"messages": agent(content=""), "tools": TOOLS}, [
        f"<think>\nREASON-A\n</think>\n\n<tool_call>\n{CALL_TEXT}\n</tool_call><|im_end|>",
        "<think>\nREASON-B\n</think>\n\nFINAL-ANSWER<|im_end|>"]),
    # ... where a call without reasoning, as the chat's last turn, would open an empty <think>
    # block that it doesn't have in the chat: located from the tool message after it
    "qwen3 (no content, no reasoning)": ({"messages": agent(content="", reasoning="", final_reasoning=""), "tools": TOOLS}, [
        f"<tool_call>\n{CALL_TEXT}\n</tool_call><|im_end|>", "<think>\n\n</think>\n\nFINAL-ANSWER<|im_end|>"]),
    # Qwen3.5: the generation prompt opens "<think>\n", so the trained reasoning starts after it
    "qwen3_5_think": ({"messages": agent(), "tools": TOOLS}, [
        "REASON-A\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>", "REASON-B\n</think>\n\nFINAL-ANSWER<|im_end|>"]),
    # Llama 3.1: a tool call is the turn's whole text, `parameters` for arguments; tools go in the user turn
    "llama3_1": ({"messages": agent(content="", reasoning="", final_reasoning=""), "tools": TOOLS}, [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "FINAL-ANSWER<|eot_id|>"]),
}


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_tool_calls_and_reasoning_train_where_the_template_renders_them(tok, case):
    name = case.split(" ")[0]
    record, texts = PLAIN[case]
    out = encode(record, template(name))
    rendered = render_jinja_template([agent_copy(record["messages"])], tools=record["tools"], chat_template=template(name),
                                     **tok.special_tokens_map)[0][0]
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    spans, at = [], 0
    for text in texts:
        start = rendered.index(text, at)
        spans.append((start, start + len(text)))
        at = start + len(text)
    want = [t if any(s <= o[0] < e for s, e in spans) else IGNORE for t, o in zip(enc["input_ids"], enc["offset_mapping"])]
    assert out["input_ids"] == list(enc["input_ids"]) + [tok.eos_token_id]
    assert out["labels"] == want + [tok.eos_token_id]
    trained = trained_text(tok, out)
    for untrained in ("SYSTEM-TEXT", "USER-TEXT", "RESULT-TEXT", "SCHEMA-TEXT"):
        assert untrained in rendered and untrained not in trained


def agent_copy(messages):
    return [dict(m) for m in messages]


def test_train_false_keeps_a_turn_out_of_the_loss(tok):
    msgs = agent(reasoning="", final_reasoning="")
    flagged = [dict(m, train=False) if m["content"] == "Let me look." else m for m in msgs]
    for name in ("qwen3", "qwen3_training"):
        out, kept = encode({"messages": msgs, "tools": TOOLS}, template(name)), encode({"messages": flagged, "tools": TOOLS}, template(name))
        assert out["input_ids"] == kept["input_ids"]
        assert "Let me look." in trained_text(tok, out) and "Let me look." not in trained_text(tok, kept)
        assert trained_text(tok, kept) in trained_text(tok, out) and "FINAL-ANSWER" in trained_text(tok, kept)
    # the last turn left out: nothing after it trains, not even the EOS raypack appends
    last = msgs[:-1] + [dict(msgs[-1], train=False)]
    out = encode({"messages": last, "tools": TOOLS}, template("qwen3"))
    assert out["labels"][-1] == IGNORE and "FINAL-ANSWER" not in trained_text(tok, out)


REASONED = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]}


@pytest.mark.parametrize("field,record,chat_template", [
    ("tool_calls", {"messages": agent(reasoning="", final_reasoning="")}, "chatml"),
    ("tools", {"messages": agent(content="x", reasoning="", final_reasoning="")[:2] + [{"role": "assistant", "content": "y"}],
               "tools": TOOLS}, "chatml"),
    ("reasoning_content", REASONED, "chatml"),
    # DeepSeek-R1's distills read reasoning inside the content (<think>...</think>), and no tools
    ("reasoning_content", REASONED, "trl/deepseek_r1_distill"),
])
def test_a_field_the_template_never_renders_is_refused(field, record, chat_template):
    text = (TEST_ASSETS / "chat_templates" / f"{chat_template}.jinja").read_text()
    with pytest.raises(TokenizeError, match=f"the data has `{field}`, but the chat template .* never renders it"):
        encode(record, text)


def test_a_template_that_drops_content_beside_tool_calls_is_refused():
    # Llama 3.1 renders only the call of a turn that has one: "Let me look." would vanish
    with pytest.raises(TokenizeError, match="can't locate the assistant turns"):
        encode({"messages": agent(reasoning="", final_reasoning=""), "tools": TOOLS}, template("llama3_1"))


def test_tool_calls_a_template_leaves_out_are_refused(tok):
    # DeepSeek-R1 renders a call only where the content is null (its arguments a JSON string):
    # the call trains from where the rendering parts from the generation prompt "<｜Assistant｜><think>\n",
    # which with this character-level tokenizer is after their shared "<"; beside "" the call would vanish
    out = encode({"messages": R1_AGENT}, template("deepseek_r1_distill"))
    call = ('｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}'
            '\n```<｜tool▁call▁end｜>')
    assert trained_text(tok, out) == tok.decode(tok(call + "FINAL-ANSWER<｜end▁of▁sentence｜>", add_special_tokens=False)
                                                ["input_ids"] + [tok.eos_token_id])
    dropped = [dict(m, content="") if m.get("tool_calls") else m for m in R1_AGENT]
    with pytest.raises(TokenizeError, match="does not render its tool call 'get_weather'"):
        encode({"messages": dropped}, template("deepseek_r1_distill"))
