"""Label masks of chat templates without {% generation %} markers, token by token.

Each template in tests/assets/chat_templates/ imitates a real model's (see tests/assets/README.md).
The expected supervised text of every assistant turn is written out here by hand from what the
template renders, located in the rendering with str.find, and turned into a token mask by the
tokens' character offsets: none of it goes through raypack.data.turns.
"""

from __future__ import annotations

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

TOK = str(ASSETS / "tokenizer")
TEMPLATES = TEST_ASSETS / "chat_templates"
CONV = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "what is 2+3?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nfive.\n"},  # trailing "\n": trimmed by some
    {"role": "user", "content": "and doubled?"},
    {"role": "assistant", "content": "<think>\ntimes two\n</think>\n\nten."},
]
R1, R2 = "<think>\nadd them\n</think>\n\nfive.", "<think>\ntimes two\n</think>\n\nten."
# template -> (conversation, supervised text of each assistant turn, in order)
EXPECTED = {
    # ChatML (Qwen2.5): content + <|im_end|>; the "\n" after it leads to the next turn
    "chatml": (CONV, [R1 + "\n<|im_end|>", R2 + "<|im_end|>"]),
    # Qwen3: earlier turns lose their <think> block; the last keeps it
    "qwen3_reasoning": (CONV, ["five.\n<|im_end|>", R2 + "<|im_end|>"]),
    # DeepSeek-R1 distills: every turn loses its reasoning; the prompt opens "<think>\n" that F never shows
    "deepseek_r1": (CONV, ["\n\nfive.\n<｜end▁of▁sentence｜>", "\n\nten.<｜end▁of▁sentence｜>"]),
    # Phi-3: every rendering ends with EOS, after the last turn's "<|end|>\n"
    "phi3": (CONV, [R1 + "\n<|end|>", R2 + "<|end|>"]),
    # Llama 3: content trimmed, <|eot_id|> closes, the next header follows at once
    "llama3": (CONV, [R1 + "<|eot_id|>", R2 + "<|eot_id|>"]),
    # Mistral [INST]: the reply starts with the space after [/INST]; EOS closes every turn
    "mistral_inst": (CONV, [" " + R1 + "\n<|eos|>", " " + R2 + "<|eos|>"]),
    # Gemma: no system role, "model" turns, content trimmed, <end_of_turn> closes
    "gemma": (CONV[1:], [R1 + "<end_of_turn>", R2 + "<end_of_turn>"]),
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOK)


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def encode(conv, chat_template, label_mask="auto"):
    fields = validate({"messages": conv}, "chat")
    row = {n: [fields.get(n)] for n in sources.SCHEMA.names}
    row["example_id"], row["format"] = [0], ["chat"]
    table = pa.Table.from_pydict(row, schema=sources.SCHEMA)
    (out,) = Encoder(TOK, chat_template, label_mask, "truncate", 4096).encode_table(table).to_pylist()
    return out


def expected_labels(tok, rendered: str, texts: list[str], ends_with_assistant: bool = True):
    """Token ids of the rendering (+ EOS unless it ends with one) and the labels that supervise
    exactly the tokens starting inside each text, found in order, and the final EOS."""
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans, at = [], 0
    for text in texts:
        start = rendered.index(text, at)
        spans.append((start, start + len(text)))
        at = start + len(text)
    labels = [t if any(s <= o[0] < e for s, e in spans) else IGNORE for t, o in zip(ids, offsets)]
    if ids[-1] != tok.eos_token_id:
        ids.append(tok.eos_token_id)
        labels.append(IGNORE)
    labels[-1] = tok.eos_token_id if ends_with_assistant else labels[-1]
    return ids, labels


def supervised_runs(tok, ids, labels) -> list[str]:
    runs, run = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            run.append(t)
        elif run:
            runs.append(tok.decode(run)), run.clear()
    return runs + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("name", EXPECTED)
def test_unmarked_template_masks_token_by_token(tok, name):
    conv, texts = EXPECTED[name]
    rendered = render_jinja_template([conv], chat_template=template(name), **tok.special_tokens_map)[0][0]
    row = encode(conv, template(name))
    ids, labels = expected_labels(tok, rendered, texts)
    assert row["input_ids"] == ids
    assert row["labels"] == labels
    # and, read back, the supervised tokens are exactly those texts (and the final EOS)
    runs = supervised_runs(tok, row["input_ids"], row["labels"])
    eos = "" if texts[-1].endswith(tok.eos_token) else tok.eos_token  # Mistral's turns end with EOS
    assert "".join(runs) == "".join(texts) + eos
    assert runs[0] == texts[0]


@pytest.mark.parametrize("name", ["qwen3_reasoning", "phi3", "mistral_inst"])
def test_completion_mask_is_the_last_turn(tok, name):
    conv, texts = EXPECTED[name]
    rendered = render_jinja_template([conv], chat_template=template(name), **tok.special_tokens_map)[0][0]
    row = encode(conv, template(name), label_mask="completion")
    ids, labels = expected_labels(tok, rendered, texts[-1:])
    assert (row["input_ids"], row["labels"]) == (ids, labels)


def test_unmarked_agrees_with_generation_markers(tok):
    """ChatML with {% generation %} markers (transformers' own assistant mask) and without."""
    for conv in (CONV, CONV[:3], CONV[1:3], CONV[:4]):
        marked, plain = encode(conv, template("chatml_generation")), encode(conv, template("chatml"))
        assert marked["input_ids"] == plain["input_ids"] and marked["labels"] == plain["labels"]


def test_chat_ending_with_a_user_turn(tok):
    """The reasoning template then drops every turn's reasoning; the EOS carries no loss."""
    conv = CONV[:4]
    rendered = render_jinja_template([conv], chat_template=template("qwen3_reasoning"), **tok.special_tokens_map)[0][0]
    row = encode(conv, template("qwen3_reasoning"))
    assert (row["input_ids"], row["labels"]) == expected_labels(tok, rendered, ["five.\n<|im_end|>"], False)


@pytest.mark.parametrize(
    "broken,why",
    [
        (lambda t: t.replace("{%- if not (message.role == 'system' and loop.first) %}",
                             "{%- if not (message.role == 'system' and loop.first) and (message.role != 'assistant' or loop.last) %}"),
         "changes or drops"),
        (lambda t: "{{ messages | length }} messages\n" + t, "before it don't render as a prefix"),
    ],
    ids=["earlier-turns-dropped", "length-in-header"],
)  # fmt: skip
def test_turns_that_cant_be_located_are_refused(broken, why):
    with pytest.raises(TokenizeError, match=rf"{why}.*\{{% generation %\}}.*label_mask=all"):
        encode(CONV, broken(template("chatml")))
