"""Token ids and loss labels for one batch of raw examples: the pure-Python core of stage 2.

`Encoder` is what each Ray Data tokenize actor holds (it loads the tokenizer once) and is usable
without Ray, which the unit tests and the `datasets.map` benchmark baseline rely on.

Per example (labels are NOT shifted: labels[i] is the target of token i, the model shifts):

    chat         chat template rendered; loss on assistant turns (`assistant`), on the last
                 assistant turn only (`completion`) or everywhere (`all`). A turn is what the
                 template's {% generation %} block covers; without those markers, it is the
                 turn's text in the full rendering after the generation prompt, up to and
                 including its end-of-turn markup (<|im_end|>, <|eot_id|>, </s>, ...), never the
                 whitespace or header before the next message (raypack/data/turns.py). Earlier
                 turns train as the template renders them (reasoning templates drop their <think>)
    instruction  "### Instruction:\n{instruction}\n\n[### Input:\n{input}\n\n]### Response:\n"
                 + output; loss on the output (`completion`/`assistant`) or everywhere (`all`)
    completion   prompt + completion, tokenized apart so masking is exact at the seam
    tokenized    passed through; labels default to input_ids (stored as null, see labels_list)
    vision       a chat with images (the source stage's `vision` row): the model's processor, found
                 beside the tokenizer, expands each image into its tokens; labels as chat's
                 `assistant`; kept whole or dropped, never cut (raypack/data/images.py)
    preference   two rows a pair, prompt + chosen and prompt + rejected, tokenized as TRL's
                 DPOTrainer does; loss on the completions (raypack/data/pairs.py says how, and
                 how the over-length policy treats a pair)
    vision_preference  a preference pair whose prompt has images: as `preference`, with the
                 processor expanding each image (in both sequences); kept whole or dropped, the
                 images stored on the chosen row (raypack/data/vision_pairs.py)

EOS is appended once to text formats (not when the text already ends with it, as Phi-3's template
does) and, appended or not, carries loss when the example ends with supervised text (always,
unless a chat ends with a non-assistant turn).
Masked positions are -100. An example longer than `max_length` is dropped, truncated (its EOS is
then cut too), or split into pieces of at most `max_length` tokens with ids `parent_id + piece`
(source ids leave 10 low bits free, see raypack.data.sources).

A row with no label token the loss can see (labels[1:] all -100: a chat without an assistant
turn, a prompt that truncate cut before the answer, a split piece of prompt only) trains nothing
and is dropped and counted (`counts`): it would cost compute, and a dataset of only such rows
would "train" with loss 0.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from jinja2 import TemplateError
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from raypack import storage
from raypack.data.chat import TRAIN, empty_answer, unrendered_field
from raypack.data.formats import IGNORE_INDEX
from raypack.data.images import ImageTokenizer, Vision
from raypack.data.pairs import CHOSEN, REJECTED, Pair, fit_pair, tokenize_pairs
from raypack.data.tower import grid_work
from raypack.data.turns import TurnError, TurnLocator
from raypack.data.vision_pairs import KIND as PAIR_KIND, PairSide, VisionPair, encode_pairs
from raypack.errors import InputError

MAX_PIECES = 1 << 10
# Row flags, kept in a column until tokenize's stats pass has counted them.
OK, TRUNCATED, SPLIT, DROPPED = 0, 1, 2, 3
COLUMNS = ["example_id", "input_ids", "labels", "length", "label_tokens", "images", "image_grid_thw"]
"""The tokenized rows' columns; `label_tokens`: the row's tokens the loss sees (what a mixture's
sources contribute is counted from it, raypack/data/mixture.py)."""
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
OUT_SCHEMA = pa.schema(
    [
        ("example_id", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("images", pa.list_(pa.binary())),
        ("image_grid_thw", pa.list_(pa.int32())),
        ("_flag", pa.int8()),
        ("_label_tokens", pa.int32()),
        ("_source_label_tokens", pa.int32()),
        ("_image_tokens", pa.int32()),
        ("_vision_patches", pa.int32()),
    ]
)
"""Rows of `Encoder.encode_table`: the output columns (`images`: a vision row's encoded images,
`image_grid_thw` their grids flattened, 3 per image; null for text rows), the over-length flag,
the label tokens the loss sees (labels[1:] != -100), on an example's first row those of the whole
example before any cut (0 on its other pieces), and a vision row's image tokens and the vision
tower's patches, kept until tokenize has counted them."""


class TokenizeError(InputError):
    """The tokenizer can't encode this data as configured (e.g. chat data without a template)."""


def load_tokenizer(name: str, chat_template: str | None = None):
    local = os.path.exists(os.path.expanduser(name))
    if not local and not storage.is_repo_id(name):  # a path, not there: not the hub's business
        raise TokenizeError(f"tokenize.tokenizer {name!r}: no such folder, and not a hub name (org/name)")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(name))
    except (OSError, ValueError) as e:  # not a folder, not on the hub, no network, not a tokenizer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if local else "not a local folder, and from the hub: "
        raise TokenizeError(f"tokenize.tokenizer {name!r}: can't load it ({where}{reason})") from e
    if chat_template is not None:
        tok.chat_template = template_text(chat_template)
    if tok.eos_token_id is None:
        raise TokenizeError(f"tokenize.tokenizer {name!r} has no EOS token; raypack appends EOS to every example")
    if not getattr(tok, "is_fast", False):
        raise TokenizeError(f"tokenize.tokenizer {name!r} is not a fast tokenizer; label masking needs character offsets")
    return tok


def template_text(chat_template: str) -> str:
    """tokenize.chat_template: the Jinja text, or a `.jinja` file holding it (as models ship
    chat_template.jinja), read whole."""
    if chat_template.endswith(".jinja") and "\n" not in chat_template:
        try:
            return storage.read_text(chat_template)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizeError(f"tokenize.chat_template {chat_template!r}: can't read it ({e})") from None
    return chat_template


def load_image_processor(name: str):
    """The image processor in the tokenizer's folder (a VLM's processor folder), for vision rows."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(os.path.expanduser(name))
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizeError(f"tokenize.tokenizer {name!r}: the data has images, but no image processor loads from "
                            f"there ({reason}); point tokenize.tokenizer at the model's processor folder") from e


def load_image_tokenizer(name: str, tok) -> ImageTokenizer:
    """The image+text tokenizer of a VLM's processor folder: its image processor, the processor's
    settings (processor_config.json, where it has one) and `tok`, its tokenizer. Refuses (naming
    the trait) an image processor raypack has no exact data path for."""
    from raypack.data.image_layouts import processor_settings

    image_processor = load_image_processor(name)
    try:
        return ImageTokenizer(image_processor, tok, processor_settings(name))
    except InputError as e:
        raise TokenizeError(f"tokenize.tokenizer {name!r}: {e}") from None


def check_vision_label_mask(label_mask: str) -> None:
    """Vision rows train on the assistant's tokens (`auto`, `assistant`); the other masks have no
    vision path yet."""
    if label_mask not in ("auto", "assistant"):
        raise TokenizeError(f"tokenize.label_mask={label_mask}: image rows train on the assistant's tokens only "
                            "(auto or assistant) so far")


def check_chat_template(tok, name: str) -> None:
    if not tok.chat_template:
        raise TokenizeError(
            f"tokenize.tokenizer {name!r} has no chat template but the data has chat examples; "
            "set tokenize.chat_template to a Jinja template"
        )


class Encoder:
    """Ray Data `map_batches` callable class: raw example rows (pyarrow) -> OUT_SCHEMA rows."""

    def __init__(
        self, tokenizer: str, chat_template: str | None, label_mask: str, overlength: str, max_length: int, report=None
    ):
        """`report(key, counts)`, when given, receives each batch's counts (see `counts`); tokenize
        passes one that forwards them to a Ray actor, so no second pass over the rows is needed."""
        self.report = report
        if report is not None:
            # Inside a Ray actor: parallelism comes from the actor pool (num_actors), so one
            # tokenizer thread per actor keeps a small host from being oversubscribed.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tok = load_tokenizer(tokenizer, chat_template)
        self.name, self.label_mask, self.overlength, self.max_length = tokenizer, label_mask, overlength, max_length
        self.eos = self.tok.eos_token_id
        # Whatever the tokenizer puts before a text (BOS, for most causal LMs), minus a trailing EOS.
        self.prefix = [t for t in self.tok("")["input_ids"] if t != self.eos]
        self.images = None  # the image tokenizer, loaded at the first vision row
        self.empty_answers: list[int] = []

    # --- per format: lists of (ids, labels) as int lists / arrays ---------------------------------

    def _spans(self, convs: list[list[dict]], rendered: list[str], indices, tools=None) -> list[list[tuple[int, int]]]:
        """Character spans of each assistant turn in each rendered conversation."""
        if indices is not None:
            return [list(x) for x in indices]
        try:  # no {% generation %} markers: locate each turn in the rendering (raypack.data.turns)
            return TurnLocator(self.tok, self.tok.chat_template, tools).spans(convs, rendered)
        except TurnError as e:
            raise TokenizeError(
                f"chat template of {self.name!r}: can't locate the assistant turns in its rendering ({e}). Use a "
                "template whose assistant turns are wrapped in {% generation %}...{% endgeneration %} (content and "
                "end-of-turn markup; tokenize.chat_template), or tokenize.label_mask=all"
            ) from None

    def encode_chat(self, messages: list[str], tools: list[str | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Chat rows (sources.SCHEMA's `messages` and `tools`, JSON: raypack/data/chat.py), rendered
        with `tools=` as a TRL run renders them; a turn with `train: false` carries no loss."""
        check_chat_template(self.tok, self.name)
        convs = [json.loads(m) for m in messages]
        flags = [[m.pop(TRAIN, True) for m in conv if m["role"] == "assistant"] for conv in convs]
        if field := unrendered_field(self.tok.chat_template, convs, tools):
            raise TokenizeError(f"the data has `{field}`, but the chat template of {self.name!r} never renders it, so "
                                "those rows would train without it; use the model's template that does "
                                "(tokenize.chat_template), or remove the field")
        self.empty = [i for i, (conv, trains) in enumerate(zip(convs, flags)) if empty_answer(conv, trains)]
        out: list = [None] * len(convs)
        groups: dict[str | None, list[int]] = {}
        for i, t in enumerate(tools):  # render_jinja_template takes one `tools` per call
            groups.setdefault(t, []).append(i)
        for t, rows in groups.items():
            encoded = self._encode_chats([convs[i] for i in rows], None if t is None else json.loads(t),
                                         [flags[i] for i in rows])
            for i, r in zip(rows, encoded):
                out[i] = r
        return out

    def _encode_chats(self, convs: list[list[dict]], tools: list | None,
                      flags: list[list[bool]]) -> list[tuple[np.ndarray, np.ndarray]]:
        template = self.tok.chat_template
        marked = bool(_GENERATION.search(template))
        kw = dict(self.tok.special_tokens_map, tools=tools)
        try:
            rendered, indices = render_jinja_template(convs, chat_template=template, return_assistant_tokens_mask=marked,
                                                      **kw)  # fmt: skip
            spans = self._spans(convs, rendered, indices if marked else None, tools)
        except (TemplateError, TypeError) as e:  # its raise_exception (Llama 3.1: one call a turn); str + dict
            raise TokenizeError(f"chat template of {self.name!r} can't render a row: {e}") from None
        enc = self.tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for conv, ids, offsets, sp, trains in zip(convs, enc["input_ids"], enc["offset_mapping"], spans, flags):
            ids = np.asarray(ids, dtype=np.int32)
            mode = "assistant" if self.label_mask == "auto" else self.label_mask
            if len(sp) != len(trains) and not all(trains):
                raise TokenizeError(f"chat template of {self.name!r}: {len(sp)} {{% generation %}} blocks for "
                                    f"{len(trains)} assistant turns, so `train: false` can't tell which to leave out")
            sp = [s for s, t in zip(sp, trains) if t] if len(sp) == len(trains) else sp
            if mode == "all":
                keep = np.ones(len(ids), dtype=bool)
            else:
                starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
                keep = np.zeros(len(ids), dtype=bool)
                for s, e in sp[-1:] if mode == "completion" else sp:
                    keep |= (starts >= s) & (starts < e)
            ends_trained = conv[-1]["role"] == "assistant" and (not trains or trains[-1])
            out.append(self._finish(ids, keep, eos_loss=mode == "all" or ends_trained))
        return out

    def encode_vision(self, messages: list[str], images: list[list[bytes]], eids: list[int]) -> list[Vision]:
        """Vision rows (messages in parts as JSON, images' bytes) with the model's image processor,
        found beside the tokenizer (tokenize.tokenizer: the model's processor folder)."""
        check_vision_label_mask(self.label_mask)
        return self.image_tokenizer().rows(messages, images, eids)

    def image_tokenizer(self) -> ImageTokenizer:
        if self.images is None:
            self.images = load_image_tokenizer(self.name, self.tok)
        return self.images

    def encode_pairs(self, prompts: list[str], completions: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        p_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        c_ids = self.tok(completions, add_special_tokens=False)["input_ids"]
        out = []
        for p, c in zip(p_ids, c_ids):
            ids = np.asarray(self.prefix + p + c, dtype=np.int32)
            keep = np.ones(len(ids), dtype=bool)
            if self.label_mask != "all":
                keep[: len(self.prefix) + len(p)] = False
            out.append(self._finish(ids, keep, eos_loss=True))
        return out

    def _finish(self, ids: np.ndarray, keep: np.ndarray, eos_loss: bool) -> tuple[np.ndarray, np.ndarray]:
        if len(ids) == 0 or ids[-1] != self.eos:
            ids = np.append(ids, np.int32(self.eos))
            keep = np.append(keep, eos_loss)
        else:  # the template ended with EOS already (Phi-3): it trains like the one raypack appends
            keep = keep.copy()
            keep[-1] |= eos_loss
        return ids, np.where(keep, ids, np.int32(IGNORE_INDEX)).astype(np.int32)

    # --- the batch callable -----------------------------------------------------------------------

    def encode(self, batch: pa.Table) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batch's (ids, labels) per row; `empty_answers` then holds the example ids of its
        chats that end with an empty assistant turn (tokenize counts them)."""
        formats = batch["format"].to_pylist()
        results: list = [None] * len(formats)
        self.empty_answers = []
        for fmt in set(formats):
            rows = [i for i, f in enumerate(formats) if f == fmt]
            sub = batch.take(rows)
            if fmt == "chat":
                encoded = self.encode_chat(sub["messages"].to_pylist(), sub["tools"].to_pylist())
                self.empty_answers += [sub["example_id"][i].as_py() for i in self.empty]
            elif fmt == "completion":
                encoded = self.encode_pairs(sub["prompt"].to_pylist(), sub["completion"].to_pylist())
            elif fmt == "vision":
                encoded = self.encode_vision(sub["vision_messages"].to_pylist(), sub["images"].to_pylist(),
                                             sub["example_id"].to_pylist())
            elif fmt == PAIR_KIND:  # its labels: the completions, as any pair's (train.objective: dpo)
                check_chat_template(self.tok, self.name)
                encoded = encode_pairs(self.image_tokenizer(), sub["vision_messages"].to_pylist(),
                                       sub["images"].to_pylist(), sub["example_id"].to_pylist())
            elif fmt == "preference":
                columns = sub.select(["prompt", "chosen", "rejected", "prompt_messages", "chosen_messages",
                                      "rejected_messages"]).to_pydict()
                if any(m is not None for m in columns["chosen_messages"]):
                    check_chat_template(self.tok, self.name)
                encoded = tokenize_pairs(self.tok, columns)
            elif fmt == "instruction":
                prompts = [
                    f"### Instruction:\n{ins}\n\n" + (f"### Input:\n{inp}\n\n" if inp else "") + "### Response:\n"
                    for ins, inp in zip(sub["instruction"].to_pylist(), sub["input"].to_pylist())
                ]
                encoded = self.encode_pairs(prompts, sub["output"].to_pylist())
            else:
                encoded = []
                for ids, labels in zip(sub["input_ids"].to_numpy(zero_copy_only=False), sub["labels"].to_pylist()):
                    ids = np.asarray(ids, dtype=np.int32)
                    given = labels is not None and self.label_mask != "all"
                    encoded.append((ids, np.asarray(labels, dtype=np.int32) if given else ids.copy()))
            for i, r in zip(rows, encoded):
                results[i] = r
        return results

    def __call__(self, batch: pa.Table) -> pa.Table:
        table = self.encode_table(batch)
        if self.report is not None and table.num_rows:
            # Keyed by the batch's first id, so a retried batch is counted once.
            self.report((batch["example_id"][0].as_py(), batch.num_rows), counts(table))
        return kept_rows(table)

    def encode_table(self, batch: pa.Table) -> pa.Table:
        """Rows in OUT_SCHEMA: the output columns plus a flag and label-token count per row
        (dropped examples stay, flagged, until __call__ removes them)."""
        self.empty_answers = []  # this batch's (encode sets them; pre-tokenized rows have none)
        if batch.num_rows and pc.all(pc.equal(batch["format"], "tokenized")).as_py():
            if (table := self._tokenized_table(batch)) is not None:
                return table
        ids_out, labels_out, eids, flags, source, vision = [], [], [], [], [], {}
        L = self.max_length
        for eid, encoded in zip(batch["example_id"].to_pylist(), self.encode(batch)):
            if isinstance(encoded, Vision):
                # Whole or not at all: a cut through an image's tokens, or a piece without the
                # images its positions count, would not be the example (docs/guides/vision.md).
                fits = len(encoded.ids) <= L
                vision[len(ids_out)] = encoded
                ids_out.append(encoded.ids if fits else encoded.ids[:0])
                labels_out.append(encoded.labels if fits else encoded.labels[:0])
                eids.append(eid)
                flags.append(OK if fits else DROPPED)
                source.append(int((encoded.labels[1:] != IGNORE_INDEX).sum()))
                continue
            if isinstance(encoded, (Pair, VisionPair)):
                # An image pair is kept whole or dropped, as an image example is (vision_pairs.py).
                pair = encoded.pair if isinstance(encoded, VisionPair) else encoded
                for i, lab, piece, flag, whole in self._pair_rows(pair, cut=pair is encoded):
                    if pair is not encoded and flag != DROPPED:
                        vision[len(ids_out)] = encoded.side(piece)
                    ids_out.append(i)
                    labels_out.append(lab)
                    eids.append(eid + piece)
                    flags.append(flag)
                    source.append(whole)
                continue
            ids, labels = encoded
            n = len(ids)
            whole = int((labels[1:] != IGNORE_INDEX).sum())
            if n <= L:
                pieces, flag = [(ids, labels)], OK
            elif self.overlength == "drop":
                pieces, flag = [(ids[:0], labels[:0])], DROPPED
            elif self.overlength == "truncate":
                pieces, flag = [(ids[:L], labels[:L])], TRUNCATED
            else:
                count = -(-n // L)
                if count > MAX_PIECES:
                    raise TokenizeError(f"example {eid}: {n} tokens split into {count} pieces; at most {MAX_PIECES}")
                pieces, flag = [(ids[k * L : (k + 1) * L], labels[k * L : (k + 1) * L]) for k in range(count)], SPLIT
            for k, (i, lab) in enumerate(pieces):
                ids_out.append(i)
                labels_out.append(lab)
                eids.append(eid + k)
                flags.append(flag)
                source.append(whole if k == 0 else 0)
        return _table(eids, ids_out, labels_out, flags, source, vision)

    def _pair_rows(self, pair: Pair, cut: bool = True):
        """(ids, labels, piece, flag, source label tokens) of a pair's rows: chosen and rejected,
        cut to fit `max_length` together (`cut`: under tokenize.overlength truncate) or dropped as
        one (a single flagged row, as `drop` leaves for any example); a pair of which either side
        has no label token the loss sees is dropped whole (both rows counted as no label tokens)."""
        rows = []
        for piece, seq in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            ids = np.asarray(seq, dtype=np.int32)
            labels = ids.copy()
            labels[: pair.prompt] = IGNORE_INDEX
            rows.append([ids, labels, piece])
        whole = sum(int((lab[1:] != IGNORE_INDEX).sum()) for _, lab, _ in rows)
        fit = fit_pair(len(pair.chosen), len(pair.rejected), pair.prompt, self.max_length)
        if fit == (0, len(pair.chosen), len(pair.rejected)):
            flag = OK
        elif self.overlength == "truncate" and cut and fit is not None:
            drop, c_len, r_len = fit
            for row, n in zip(rows, (c_len, r_len)):
                row[0], row[1] = row[0][drop: drop + n], row[1][drop: drop + n]
            flag = TRUNCATED
        else:  # drop (split is refused for pairs at load), or nothing of the pair fits
            return [(rows[0][0][:0], rows[0][1][:0], CHOSEN, DROPPED, whole)]
        if any((lab[1:] == IGNORE_INDEX).all() for _, lab, _ in rows):
            for row in rows:  # no pair without both completions: both rows trainless, dropped together
                row[1] = np.full(len(row[1]), IGNORE_INDEX, np.int32)
        return [(ids, lab, piece, flag, whole if piece == CHOSEN else 0) for ids, lab, piece in rows]

    def _tokenized_table(self, batch: pa.Table) -> pa.Table | None:
        """encode_table for pre-tokenized rows, column-wise: what the per-row path does, without a
        Python loop over the rows (at a million rows that loop was most of prepare's own work).
        None when a row must be split (the per-row path cuts the pieces)."""
        L = self.max_length
        ids = batch["input_ids"].combine_chunks()
        lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
        over = lengths > L
        if over.any() and self.overlength == "split":
            return None
        labels = batch["labels"].combine_chunks()
        # Rows without labels, and every row under label_mask=all, train on their ids.
        on_ids = self.label_mask == "all" or labels.null_count == len(labels)
        labels = ids if on_ids else pc.if_else(pc.is_valid(labels), labels, ids)
        whole = _label_tokens(lengths, pc.list_flatten(labels).to_numpy())
        if over.any():  # truncate, or drop (a dropped row's tokens are never counted or kept)
            ids, labels = pc.list_slice(ids, 0, L), pc.list_slice(labels, 0, L)
        flags = np.where(over, DROPPED if self.overlength == "drop" else TRUNCATED, OK)
        kept = np.minimum(lengths, L).astype(np.int32)
        return _columns(batch["example_id"].to_numpy(), kept, pc.list_flatten(ids).to_numpy(),
                        pc.list_flatten(labels).to_numpy(), flags, whole,
                        same=np.ones(len(kept), bool) if on_ids else None)


def kept_rows(table: pa.Table) -> pa.Table:
    """The output columns of the rows that train: not dropped for length, with a label token."""
    keep = pc.and_(pc.not_equal(table["_flag"], DROPPED), pc.greater(table["_label_tokens"], 0))
    kept = table.filter(keep)
    return kept.append_column("label_tokens", kept["_label_tokens"]).select(COLUMNS)


def counts(table: pa.Table) -> dict:
    """What tokenize reports for one encoded batch (lengths and tokens: the rows kept)."""
    flag = table["_flag"].to_numpy()
    eid = table["example_id"].to_numpy()
    label_tokens = table["_label_tokens"].to_numpy()
    first_piece = (eid & (MAX_PIECES - 1)) == 0
    # An example (all pieces of a split one) without a label token is dropped as a whole; a
    # split piece without one, from an example whose other pieces have some, on its own.
    live = flag != DROPPED
    parents, inverse = np.unique(eid[live] & ~np.int64(MAX_PIECES - 1), return_inverse=True)
    per_parent = np.bincount(inverse, weights=label_tokens[live], minlength=len(parents))
    unsupervised = per_parent == 0
    kept = live & (label_tokens > 0)
    # Label tokens lost, by what cut them: whole examples over the length limit, the tails that
    # truncate cut, and the first token of each split piece after the first (which starts a row).
    whole = table["_source_label_tokens"].to_numpy()
    lost = {flag_name: int(whole[flag == f].sum() - label_tokens[kept & (flag == f)].sum())
            for flag_name, f in (("over_length", DROPPED), ("truncated", TRUNCATED), ("split", SPLIT))}
    return {
        "dropped": int((flag == DROPPED).sum()),
        "truncated": int(((flag == TRUNCATED) & first_piece).sum()),  # a truncated pair: one example
        "split": int(((flag == SPLIT) & first_piece).sum()),
        "pieces": int((flag == SPLIT).sum()),
        "no_labels": int(unsupervised.sum()),
        "no_label_pieces": int(((label_tokens[live] == 0) & ~unsupervised[inverse]).sum()),
        "no_label_examples": parents[unsupervised][:5].tolist(),
        "label_tokens": int(label_tokens[kept].sum()),
        "source_label_tokens": int(whole.sum()),
        "label_tokens_lost": lost,
        "images": int(pc.sum(pc.list_value_length(table["images"].filter(pa.array(kept)))).as_py() or 0),
        "image_tokens": int(table["_image_tokens"].to_numpy()[kept].sum()),
        "vision_patches": int(table["_vision_patches"].to_numpy()[kept].sum()),
        "lengths": table["length"].to_numpy()[kept],
        "ids": eid[kept],
        "label_counts": label_tokens[kept],
        # per kept row, the vision tower's patches and Σ patches² (data/tower.py): image data only
        **({"tower": grid_work(table["image_grid_thw"])[kept]} if table["images"].null_count < table.num_rows else {}),
    }


def _table(eids, ids_out, labels_out, flags, source, vision: dict[int, Vision | PairSide] | None = None) -> pa.Table:
    lengths = np.fromiter((len(x) for x in ids_out), dtype=np.int32, count=len(ids_out))
    cat = (lambda xs: np.concatenate(xs).astype(np.int32, copy=False)) if ids_out else (lambda xs: np.zeros(0, np.int32))
    table = _columns(np.asarray(eids, dtype=np.int64), lengths, cat(ids_out), cat(labels_out), np.asarray(flags),
                     np.asarray(source, dtype=np.int32))
    if not vision:
        return table
    n = len(ids_out)
    columns = {
        "images": pa.array([vision[i].images if i in vision else None for i in range(n)], pa.list_(pa.binary())),
        "image_grid_thw": pa.array([vision[i].grid if i in vision else None for i in range(n)], pa.list_(pa.int32())),
        "_image_tokens": pa.array([vision[i].image_tokens if i in vision else 0 for i in range(n)], pa.int32()),
        "_vision_patches": pa.array([vision[i].patches if i in vision else 0 for i in range(n)], pa.int32()),
    }
    for name, column in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def labels_list(offsets: np.ndarray, ids: np.ndarray, labels: np.ndarray, same: np.ndarray | None = None) -> pa.ListArray:
    """The labels column of rows whose flat ids and labels `offsets` cuts: null for a row whose
    labels are its ids (`formats.TRAINS_ON_IDS`), so that pre-tokenized data without labels, the
    common case at scale, moves and stores its tokens once instead of twice."""
    if same is None:
        differ = np.concatenate(([0], np.cumsum(ids != labels)))
        same = differ[offsets[1:]] == differ[offsets[:-1]]
    if not same.any():
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels.astype(np.int32, copy=False)))
    lengths = np.diff(offsets)
    kept = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(np.where(same, 0, lengths), out=kept[1:])
    values = labels[:0] if same.all() else labels[np.repeat(~same, lengths)]
    values = values.astype(np.int32, copy=False)
    return pa.ListArray.from_arrays(pa.array(kept), pa.array(values, pa.int32()), mask=pa.array(same))


def _label_tokens(lengths: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Label tokens the loss sees in each row of flat `labels` (row i: the next lengths[i] values).
    A row's first token predicts nothing before it (collate masks every example start), so a
    label there counts for nothing."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    seen = labels != IGNORE_INDEX
    seen[offsets[:-1][lengths > 0]] = False
    supervised = np.concatenate([[0], np.cumsum(seen)])
    return supervised[offsets[1:]] - supervised[offsets[:-1]]


def _columns(eids: np.ndarray, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray, flags: np.ndarray,
             source: np.ndarray, same: np.ndarray | None = None) -> pa.Table:
    """OUT_SCHEMA rows from flat arrays: row i's tokens are the next lengths[i] values of ids / labels.
    `same`: the rows whose labels are their ids, when the caller knows (else they are compared)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    label_tokens = _label_tokens(lengths, labels)
    return pa.Table.from_arrays(
        [
            pa.array(eids, pa.int64()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int32, copy=False))),
            labels_list(offsets, ids, labels, same),
            pa.array(lengths.astype(np.int32, copy=False)),
            pa.nulls(len(lengths), pa.list_(pa.binary())),
            pa.nulls(len(lengths), pa.list_(pa.int32())),
            pa.array(flags.astype(np.int8)),
            pa.array(label_tokens.astype(np.int32)),
            pa.array(source.astype(np.int32, copy=False)),
            pa.array(np.zeros(len(lengths), np.int32)),
            pa.array(np.zeros(len(lengths), np.int32)),
        ],
        schema=OUT_SCHEMA,
    )
