"""Where each assistant turn lies in a rendered chat, for templates without {% generation %} markers.

A template with markers says which characters are the assistant's; most shipped templates have
none, and many don't render a conversation's prefixes as prefixes of the whole: Phi-3 ends every
rendering with EOS, reasoning templates (Qwen3, DeepSeek-R1 distills) drop earlier turns'
<think> blocks. So each turn is located in the full rendering F itself:

    ...<|im_start|>user\\nWhat is 2+2?<|im_end|>\\n<|im_start|>assistant\\n4<|im_end|>\\n<|im_start|>user...
                                                                   a ──────────────┘ ↑   └── end
                                                                          content end e

    a    where F departs from the generation prompt rendered after the turn's preceding messages
         (render(conv[:j], add_generation_prompt=True)): the supervised text starts with what the
         model generates. Usually that prompt is a prefix of F; a prompt that opens more than F
         shows (DeepSeek-R1's "<｜Assistant｜><think>\\n") is cut where the two part.
    e    where the turn's content ends in F: the same conversation rendered with a private-use
         sentinel after each assistant content (before its trailing whitespace) must give F
         back once the sentinels are removed, with each sentinel exactly once.
    end  e, plus the content's trailing whitespace if the template kept it, plus the turn's
         closing markup: what the template emits after an assistant content both when the turn
         ends the chat and when a user message follows, in whole tokens, without trailing
         whitespace (<|im_end|>, <|eot_id|>, <|end|>, </s>, <end_of_turn>; nothing for
         plain-text templates).

So the supervised text of a turn is exactly what the template renders for that turn in F after
the generation prompt, up to and including its end-of-turn markup, and never the whitespace or
header that leads to the next message. Earlier turns are supervised as F renders them (a
reasoning template shows them without their reasoning). A turn that can't be located this way
is refused with TokenizeError; a template with {% generation %} markers always works.
"""

from __future__ import annotations

from transformers.utils.chat_template_utils import render_jinja_template

SENTINEL = 0xE000
"""First of the private-use characters marking content ends (one per assistant turn)."""
_FOLLOWER = "\uf8ff"


class TurnError(ValueError):
    """An assistant turn can't be located in the template's rendering."""


def _mark(content: str, char: str) -> str:
    """`content` with `char` after its last non-whitespace character: templates that trim
    content (Llama 3, Gemma) then keep it, and it still marks where the content ends."""
    body = content.rstrip()
    return body + char + content[len(body) :]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _calls_inside(message: dict, full: str, start: int, end: int, c: int, j: int) -> tuple[int, int]:
    """The span, once each of the turn's tool calls is seen in it by its function name: a template
    that renders a turn's calls only sometimes (DeepSeek-R1's: only beside null content) must not
    train the turn as if it had none."""
    for call in message.get("tool_calls") or ():
        name = call.get("function", call)["name"]
        if name not in full[start:end]:
            raise TurnError(f"conversation {c}, message {j}: the template does not render its tool call {name!r} in it")
    return start, end


def _bare(message: dict) -> bool:
    """An assistant turn of tool calls and no content: a sentinel in its content would change
    its rendering (Qwen3 puts a newline before the calls only after content; Llama 3.1 drops
    content beside calls), so it is located by its own rendering instead (`_bare_end`)."""
    return bool(message.get("tool_calls")) and not (message["content"] or "").strip()


class TurnLocator:
    """Character spans of the assistant turns of rendered chats (see the module docstring)."""

    def __init__(self, tokenizer, template: str, tools: list | None = None):
        """`tools`: the conversations' tool schemas (one list for all), rendered in every rendering."""
        self.tok, self.template = tokenizer, template
        self.kw = dict(tokenizer.special_tokens_map, tools=tools)

    def _render(self, convs: list[list[dict]], generation_prompt: bool = False) -> list[str]:
        if not convs:
            return []
        return render_jinja_template(convs, chat_template=self.template, add_generation_prompt=generation_prompt,
                                     **self.kw)[0]  # fmt: skip

    def _closing(self, after_last: str, after_follow: str) -> str:
        """What follows a content both when the turn ends the chat and when a message follows:
        their common text, cut back to whole tokens of the former (two different next markups
        can share a first character, as "<|" in <|eos|> and <|user|>), without trailing whitespace."""
        common = _common_prefix(after_last, after_follow)
        offsets = self.tok(after_last, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        whole = max((e for _, e in offsets if e <= common), default=0)
        return after_last[:whole].rstrip()

    def spans(self, convs: list[list[dict]], rendered: list[str]) -> list[list[tuple[int, int]]]:
        """[(start, end)] per assistant turn, per conversation, in `rendered` (its full renderings)."""
        turns = [[j for j, m in enumerate(conv) if m["role"] == "assistant"] for conv in convs]
        marked = []
        for conv, js in zip(convs, turns):
            if len(js) > 0x1000:
                raise TurnError(f"{len(js)} assistant turns in one conversation; at most 4096")
            chars = {j: chr(SENTINEL + k) for k, j in enumerate(js) if not _bare(conv[j])}
            marked.append([dict(m, content=_mark(m["content"], chars[j])) if j in chars else m for j, m in enumerate(conv)])
        whole = self._render([m for m, js in zip(marked, turns) if js])
        # per turn: the prompt before it, and the turn ending the chat with or without a follower
        jobs = [(c, j) for c, js in enumerate(turns) for j in js]
        prompts = self._render([convs[c][:j] for c, j in jobs], generation_prompt=True)
        last = [marked[c][: j + 1] for c, j in jobs]
        ends = self._render(last)
        follows = self._render([t + [{"role": "user", "content": _FOLLOWER}] for t in last])

        out, k, w = [], 0, 0
        for c, (conv, js) in enumerate(zip(convs, turns)):
            if not js:
                out.append([])
                continue
            full = rendered[c]
            content_end = self._content_ends(whole[w], full, [not _bare(conv[j]) for j in js], c)
            w += 1
            spans, prev = [], 0
            for t, j in enumerate(js):
                start = self._start(prompts[k], full, convs[c][:j], c, j)
                if content_end[t] is None:  # tool calls without content: no sentinel to place
                    end = self._bare_end(prompts[k], ends[k], full, start, c, j, convs[c])
                    spans.append(_calls_inside(conv[j], full, start, end, c, j))
                    prev, k = end, k + 1
                    continue
                char = chr(SENTINEL + t)
                closing = self._closing(ends[k].split(char, 1)[1], follows[k].split(char, 1)[1])
                end = content_end[t]
                rest, trailing = full[end:], conv[j]["content"][len(conv[j]["content"].rstrip()) :]
                if rest.startswith(trailing + closing):
                    end += len(trailing) + len(closing)
                elif rest.startswith(closing):
                    end += len(closing)
                else:
                    raise TurnError(f"conversation {c}, message {j}: its closing markup {closing!r} does not follow it")
                if not prev <= start <= content_end[t]:
                    raise TurnError(f"conversation {c}, message {j}: its generation prompt ends after its content starts")
                spans.append(_calls_inside(conv[j], full, start, end, c, j))
                prev, k = end, k + 1
            out.append(spans)
        return out

    def _bare_end(self, prompt: str, alone: str, full: str, start: int, c: int, j: int, conv: list[dict]) -> int:
        """Where a turn of tool calls without content ends in `full`. Its text in `alone` (the
        chat rendered up to it, it last), after the generation prompt, without trailing
        whitespace, standing in `full` at `start` whole; else, where the next message starts
        (`_before_next`). A turn neither finds is refused."""
        alone = "".join(ch for ch in alone if not 0 <= ord(ch) - SENTINEL < 0x1000)  # earlier turns' marks
        text = alone[_common_prefix(prompt, alone):].rstrip()
        if text and full.startswith(text, start):
            return start + len(text)
        # Qwen3 opens an empty <think> block in the last turn only: as the chat's end the turn
        # renders otherwise than in it
        end = self._before_next(conv, j, full) if j + 1 < len(conv) else None
        if end is None or end <= start:
            raise TurnError(f"conversation {c}, message {j}: its tool calls render otherwise when the turn ends the chat")
        return end

    def _before_next(self, conv: list[dict], j: int, full: str) -> int | None:
        """The end of turn j's closing markup in `full`, found from the message after it: that
        message's content marked at its start gives where it starts in `full`; what precedes
        the mark alike in `full` and in the chat with turn j as plain content (its closing
        markup and the next message's header) is cut there, less the header (None if the
        template renders either otherwise)."""
        after = conv[j + 1]
        if not isinstance(after.get("content"), str) or not after["content"]:
            return None
        mark, plain_mark = chr(SENTINEL), chr(SENTINEL + 1)
        nxt = dict(after, content=mark + after["content"])
        plain = {"role": "assistant", "content": plain_mark}
        real, alike, alone, follow = self._render([conv[: j + 1] + [nxt] + conv[j + 2 :],
                                                  conv[:j] + [plain, nxt] + conv[j + 2 :],
                                                  conv[:j] + [plain], conv[:j] + [plain, {"role": "user", "content": _FOLLOWER}]])
        if real.count(mark) != 1 or real.replace(mark, "") != full or alike.count(plain_mark) != 1:
            return None
        at = real.index(mark)
        gap = alike[alike.index(plain_mark) + 1 : alike.index(mark)]  # closing markup, then the header
        closing = self._closing(alone.split(plain_mark, 1)[1], follow.split(plain_mark, 1)[1])
        if not gap.startswith(closing) or not real[:at].endswith(gap[len(closing):]) or not real[:at - len(gap) + len(closing)].endswith(closing):
            return None
        return at - len(gap) + len(closing)

    def _content_ends(self, marked: str, full: str, expected: list[bool], c: int) -> list[int | None]:
        """Offsets in `full` where each assistant content ends, from the sentinel rendering (None
        for the turns not `expected` to carry a sentinel)."""
        count = len(expected)
        ends, plain, last = [None] * count, [], 0
        for i, ch in enumerate(marked):
            t = ord(ch) - SENTINEL
            if 0 <= t < count:
                if ends[t] is not None:
                    raise TurnError(f"conversation {c}: the template renders an assistant turn twice")
                plain.append(marked[last:i])
                ends[t] = sum(map(len, plain))
                last = i + 1
        plain.append(marked[last:])
        found = [e for e in ends if e is not None]
        if "".join(plain) != full or [e is not None for e in ends] != expected or found != sorted(found):
            raise TurnError(f"conversation {c}: the template changes or drops assistant content it renders")
        return ends

    def _start(self, prompt: str, full: str, before: list[dict], c: int, j: int) -> int:
        if full.startswith(prompt):
            return len(prompt)
        # A generation prompt that opens more than the rendering shows (a <think> tag): cut
        # where they part, as long as the messages before the turn render as F's prefix.
        context = self._render([before])[0] if before else ""
        if full.startswith(context) and prompt.startswith(context):
            # cut back to where both the prompt's tokens and F's part: F's turn can begin with the
            # character the prompt goes on with ("<" of DeepSeek-R1's "<｜tool▁calls▁begin｜>" after
            # its "<think>"), and a token of F that starts before the cut would not train
            common = _common_prefix(prompt, full)
            ends = {e for _, e in self.tok(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]}
            starts = {s for s, _ in self.tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]}
            return max((e for e in ends & starts if e <= common), default=0)
        raise TurnError(f"conversation {c}, message {j}: the messages before it don't render as a prefix of the chat")
