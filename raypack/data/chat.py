"""Chat rows as the chat template receives them: OpenAI messages (content parts, tool calls, tool
results, reasoning), ShareGPT conversations, and a `tools` column.

    chat      {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...],
               "tools": [{"type": "function", "function": {...}}, ...] (optional)}
    sharegpt  {"conversations": [{"from": "human" | "gpt" | "system" | "function_call" | "observation"
               (or user, assistant, tool), "value": str}, ...], "system": str (optional), "tools": ...}

Every field goes to the template as a TRL user's SFTTrainer run passes it: the messages as they
are, `tools=` from the row's `tools` column (a list, or that list as a JSON string, which TRL
parses the same way). What raypack changes, and why:

- content parts (`[{"type": "text", "text": ...}]`) of a text row are joined into one string:
  text-only templates (Qwen3's, Llama 3.1's) render a list as nothing or as its repr, and the
  templates that take parts (Qwen3.5's) render the texts one after another, with nothing between;
- an assistant's null content beside `tool_calls` stays null: DeepSeek-R1's template renders the
  calls only then (and drops them beside "");
- `tools: []` becomes no tools, as TRL's `apply_chat_template` does (Llama 3.1's template
  renders its tool preamble for an empty list);
- ShareGPT becomes messages: `from`/`value` are `role`/`content` (TRL's `maybe_convert_to_chatml`),
  `human`/`gpt`/`observation` are user/assistant/tool, a `function_call` turn (its value the JSON
  `{"name": ..., "arguments": ...}`, LLaMA-Factory's layout) is an assistant turn with that one
  tool call, and a `system` column is a first system message (LLaMA-Factory's);
- `train: false` on an assistant message (raypack's per-message flag, as Axolotl's `training`)
  keeps that turn out of the loss; it is taken off the message before the template sees it.

Anything else in a message is a FormatError naming it: a field raypack would not pass on must
not vanish quietly (before this module, `tool_calls` and `tools` did). Unknown columns beside
`messages` are the row's metadata (ids, sources), which no trainer passes to a template.

The normalized messages travel as JSON (sources.SCHEMA's `messages`, `tools`): a tool call's
`arguments` may be an object or a JSON string, and templates render the two differently, so the
row keeps whichever it had.
"""

from __future__ import annotations

import json
import re
from typing import Any


class FormatError(ValueError):
    """A chat row that can't go to the template as it is; raypack/data/formats.py raises it as
    its own FormatError (this module stays below that one, no import cycle)."""


ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
TRAIN = "train"
"""The per-message flag: `train: false` keeps an assistant turn out of the loss."""
ASSISTANT_FIELDS = ("tool_calls", "reasoning_content", "thinking")
"""Fields only an assistant message may hold: its tool calls and its reasoning (`reasoning_content`
as Qwen3's and DeepSeek's templates read it, `thinking` as GPT-OSS's does)."""
PASSED = ("role", "content", *ASSISTANT_FIELDS, "name", "tool_call_id")
"""The message fields passed to the template."""
REFUSED_COLUMNS = ("chat_template_kwargs",)
"""Row columns TRL passes to the template that raypack does not (yet): refused, not dropped."""


def chat_fields(rec: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A chat or ShareGPT record as sources.SCHEMA's `messages` and `tools` (JSON strings)."""
    for key in REFUSED_COLUMNS:
        if rec.get(key) is not None:
            raise FormatError(f"`{key}`: per-row template arguments are not passed on by raypack; remove the column")
    if fmt == "sharegpt":
        messages = _sharegpt(rec)
    else:
        messages = rec.get("messages")
        if messages is None:
            raise FormatError("missing field `messages` (chat format)")
        messages = _messages(messages, "messages")
    if not messages:
        raise FormatError(f"empty conversation (`{'conversations' if fmt == 'sharegpt' else 'messages'}` is [])")
    tools = _tools(rec.get("tools"))
    return {"messages": json.dumps(messages, ensure_ascii=False),
            "tools": None if tools is None else json.dumps(tools, ensure_ascii=False)}


def _sharegpt(rec: dict[str, Any]) -> list[dict]:
    conv = rec.get("conversations")
    if conv is None:
        raise FormatError("missing field `conversations` (sharegpt format)")
    if not isinstance(conv, (list, tuple)):
        raise FormatError(f"`conversations` must be a list, got {type(conv).__name__}")
    messages = []
    system = rec.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise FormatError(f"field `system` must be a string, got {type(system).__name__}")
        if system:
            messages.append({"role": "system", "content": system})
    for j, m in enumerate(conv):
        where = f"conversations[{j}]"
        if not isinstance(m, dict):
            raise FormatError(f"{where} must be an object with from and value, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        speaker, value = m.pop("from", None), m.pop("value", None)
        if speaker not in SHAREGPT_ROLES:
            raise FormatError(f"{where}.from: unknown role {speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        if speaker == "function_call":
            if not isinstance(value, str):
                raise FormatError(f"{where}.value: a function_call's value must be a JSON string, got {type(value).__name__}")
            try:
                call = json.loads(value)
            except json.JSONDecodeError as e:
                raise FormatError(f"{where}.value: a function_call's value is not JSON ({e})") from None
            if not isinstance(call, dict):
                raise FormatError(f"{where}.value: a function_call's value must be a JSON object with name and arguments")
            m.update(role="assistant", content=None, tool_calls=[{"type": "function", "function": call}])
        else:
            m.update(role=SHAREGPT_ROLES[speaker], content=value)
        messages.append(m)
    return _messages(messages, "conversations", sharegpt=True)


def _messages(messages: Any, key: str, sharegpt: bool = False) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise FormatError(f"`{key}` must be a list, got {type(messages).__name__}")
    return [_message(m, f"{key}[{j}]", sharegpt) for j, m in enumerate(messages)]


def _message(m: Any, where: str, sharegpt: bool) -> dict:
    if not isinstance(m, dict):
        raise FormatError(f"{where} must be an object with role and content, got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}  # a Parquet struct's absent fields are nulls
    role = m.get("role")
    if role not in ROLES:
        raise FormatError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    for k in m:
        if k not in PASSED and k != TRAIN:
            fields = ", ".join(("from", "value") if sharegpt else PASSED[:2]) + ", " + ", ".join((*PASSED[2:], TRAIN))
            raise FormatError(f"{where}.{k}: a message field raypack does not pass to the chat template (it reads "
                              f"{fields}); remove it, or it would not train")
    for k in ASSISTANT_FIELDS:
        if k in m and role != "assistant":
            raise FormatError(f"{where}.{k}: only an assistant message may hold {k}, this one is {role}")
    out = {"role": role, "content": _content(m.get("content"), where, "tool_calls" in m)}  # null stays null
    if "tool_calls" in m:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    for k in ("reasoning_content", "thinking", "name", "tool_call_id"):
        if k in m:
            if not isinstance(m[k], str):
                raise FormatError(f"{where}.{k} must be a string, got {type(m[k]).__name__}")
            out[k] = m[k]
    if TRAIN in m:
        if not isinstance(m[TRAIN], bool):
            raise FormatError(f"{where}.{TRAIN} must be true or false, got {m[TRAIN]!r}")
        if m[TRAIN] and role != "assistant":
            raise FormatError(f"{where}.{TRAIN}: only assistant turns train; a {role} message can't")
        out[TRAIN] = m[TRAIN]
    return out


def _content(content: Any, where: str, has_calls: bool) -> str | None:
    if content is None and has_calls:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = kind if kind is not None else type(part).__name__
                raise FormatError(f"{where}.content[{k}]: unknown content part type {shown!r}; expected text "
                                  "(or image, in a chat that trains images)")
            if not isinstance(part.get("text"), str):
                raise FormatError(f"{where}.content[{k}].text must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise FormatError(f"{where}.content must be a string or a list of content parts, got {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, (list, tuple)) or not calls:
        raise FormatError(f"{where} must be a non-empty list of tool calls")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise FormatError(f"{at} must be an object, got {type(call).__name__}")
        call = {key: v for key, v in call.items() if v is not None}
        fn = call.get("function", call)  # OpenAI's {"type", "function": {...}}, or the function itself
        if not isinstance(fn, dict):
            raise FormatError(f"{at}.function must be an object with name and arguments")
        prefix = f"{at}.function" if "function" in call else at
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FormatError(f"{prefix}.name: a tool call needs a function name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError as e:
                raise FormatError(f"{prefix}.arguments is not JSON ({e})") from None
        elif not isinstance(args, dict):
            raise FormatError(f"{prefix}.arguments must be an object or a JSON string, got {type(args).__name__}")
        out.append(call)
    return out


def _tools(tools: Any) -> list | None:
    if isinstance(tools, str):  # as TRL's SFTTrainer reads a `tools` column of strings
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise FormatError(f"`tools` is a string but not JSON ({e})") from None
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise FormatError(f"`tools` must be a list of tool schemas (objects), got {type(tools).__name__}")
    return list(tools) or None


TEMPLATE_FIELDS = ("tools", "tool_calls", "reasoning_content", "thinking")
"""Fields a template must name to render them (a word search of its source: a template that never
names `tool_calls` can't render them; one that does renders them as the model was trained to)."""


def unrendered_field(template: str, convs: list[list[dict]], tools: list[str | None]) -> str | None:
    """The first field of the data that the chat template never reads, if any: `tools`, an
    assistant's `tool_calls` or reasoning would render as nothing, and the row train as a plain chat."""
    used = {k for conv in convs for m in conv for k in m}
    if any(t is not None for t in tools):
        used.add("tools")
    return next((f for f in sorted(used & set(TEMPLATE_FIELDS)) if not re.search(rf"\b{f}\b", template)), None)


def empty_answer(conv: list[dict], trains: list[bool]) -> bool:
    """Whether a chat ends with a trained assistant turn that says nothing: its end-of-turn markup
    would train as the answer (a reply cut off, or a prompt saved with its empty answer slot)."""
    last = conv[-1]
    return (last["role"] == "assistant" and (not trains or trains[-1]) and not (last["content"] or "").strip()
            and not any(last.get(k) for k in ASSISTANT_FIELDS))
