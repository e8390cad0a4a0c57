"""Preference pairs (DPO): a pair's two sequences tokenized as TRL tokenizes them, fitted to the
budget together, and planned as one item so that both land in the same packed row.

    pairs = tokenize_pairs(tok, rows)            # [(prompt+chosen ids, prompt+rejected ids, prompt length)]
    cut = fit_pair(len(c), len(r), prompt, L)    # the over-length policy on the pair as a whole
    plan = plan_pairs(strategy, lengths, ranks)  # pairs as items; each becomes two adjacent pieces

Tokenization follows TRL's DPOTrainer (trl/trainer/dpo_trainer.py, `_prepare_dataset`), so that
a pair trains on the tokens TRL trains it on:

    standard        EOS text appended to chosen and rejected unless they end with it; prompt,
                    prompt + chosen and prompt + rejected each tokenized whole, with the
                    tokenizer's special tokens (its BOS)
    conversational  the chat template applied to the prompt (with the generation prompt), to
                    prompt + chosen and to prompt + rejected; no EOS added (the template ends the turn)

The completion starts where the tokenized prompt and the tokenized prompt + completion first
differ (TRL's `common_prefix_length`, the smaller over chosen and rejected), so a token merged
across the seam belongs to the completion. Each sequence's labels are its ids from there on,
-100 before. The two rows of a pair get the pair's example id with piece 0 (chosen) and 1
(rejected): sorted by id they are adjacent, chosen first, which is what the planner relies on.

A pair in a packed row, prompt p, chosen c and rejected r, positions restarting per sequence:

    input_ids     p0 p1 c0 c1 c2 | p0 p1 r0 r1
    labels        -- -- c0 c1 c2 | -- -- r0 r1     (-- = -100; collate masks each start too)
    position_ids   0  1  2  3  4 |  0  1  2  3
    example_ids   [pair | 0, pair | 1]

Over length. `max_length` (tokenize.max_length, else pack.budget) bounds the pair: both
sequences must fit one row. `drop` drops the pair; `truncate` cuts the prompt first, from its
start (the end of the prompt, nearest the answer, stays), down to one token if it must, then the
completions from their ends, the longer first; `split` is refused (a pair split is no pair).

Planning. A pair is one item of length len(chosen) + len(rejected) for the strategy's packing,
and its attention cost is len(chosen)² + len(rejected)² (two sequences, each attending to
itself) for the balanced layout; each item then becomes its two pieces, adjacent in one pack.
The strategies that cut examples into pieces (`splits_examples`: wrapped, wrapped_noreset) are
refused (raypack/data/strategies.py, `check_strategies`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from raypack.data.plan import Packing, Plan, check_lengths, place

PIECE_MASK = (1 << 10) - 1
"""The low bits of an example id that number its pieces (raypack/data/sources.py)."""
CHOSEN, REJECTED = 0, 1
"""The piece numbers of a pair's two rows."""


class Pair(NamedTuple):
    """One tokenized pair: the two full sequences and where their completions start."""

    chosen: list[int]
    rejected: list[int]
    prompt: int
    """Leading tokens the two share that carry no loss (TRL's prompt length)."""


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pairs(tok, rows: dict[str, list[Any]]) -> list[Pair]:
    """Pairs from normalized preference rows (formats.preference_record's fields, as columns):
    conversational where `chosen_messages` is set, standard otherwise."""
    n = len(rows["chosen_messages"] if rows.get("chosen_messages") is not None else rows["chosen"])
    conv = [i for i in range(n) if rows["chosen_messages"][i] is not None]
    text = [i for i in range(n) if rows["chosen_messages"][i] is None]
    out: list[Pair | None] = [None] * n
    if conv:
        def chat(convs, **kw):
            return tok.apply_chat_template(convs, tokenize=True, return_dict=True, **kw)["input_ids"]

        prompts = [rows["prompt_messages"][i] for i in conv]
        p = chat(prompts, add_generation_prompt=True)
        c = chat([q + rows["chosen_messages"][i] for q, i in zip(prompts, conv)])
        r = chat([q + rows["rejected_messages"][i] for q, i in zip(prompts, conv)])
        for k, i in enumerate(conv):
            out[i] = pair_from(p[k], c[k], r[k])
    if text:
        eos = tok.eos_token
        ends = [(rows["prompt"][i], *(_with_eos(rows[key][i], eos) for key in ("chosen", "rejected"))) for i in text]
        p = tok([e[0] for e in ends])["input_ids"]
        c = tok([e[0] + e[1] for e in ends])["input_ids"]
        r = tok([e[0] + e[2] for e in ends])["input_ids"]
        for k, i in enumerate(text):
            out[i] = pair_from(p[k], c[k], r[k])
    return out


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def pair_from(prompt: list[int], chosen: list[int], rejected: list[int]) -> Pair:
    """A Pair of the tokenized prompt, prompt + chosen and prompt + rejected (TRL's prompt length)."""
    return Pair(list(chosen), list(rejected),
                min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected)))


def fit_pair(chosen: int, rejected: int, prompt: int, max_length: int) -> tuple[int, int, int] | None:
    """How to cut a pair of `chosen` + `rejected` tokens sharing `prompt` leading ones to fit
    `max_length` together: (prompt tokens to drop from the start, chosen length, rejected length)
    after the cut, or None when even one prompt token and one completion token each don't fit."""
    if chosen + rejected <= max_length:
        return 0, chosen, rejected
    c, r = chosen - prompt, rejected - prompt
    keep = min(prompt, max((max_length - c - r) // 2, 1))  # the prompt first, down to one token
    room = max_length - 2 * keep
    c_kept = min(c, max(room - r, room // 2))  # then the longer completion, to an even share
    r_kept = min(r, room - c_kept)
    if c_kept < 1 or r_kept < 1:
        return None
    return prompt - keep, keep + c_kept, keep + r_kept


def check_pair_ids(ids: np.ndarray) -> None:
    """Tokenized rows in example_id order hold whole pairs: (chosen, rejected) of one parent, adjacent."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) % 2 or ((ids[0::2] & PIECE_MASK) != CHOSEN).any() or (ids[1::2] != ids[0::2] + REJECTED).any():
        raise ValueError("the tokenized rows do not come in (chosen, rejected) pairs: were they tokenized as preference "
                         "data (train.objective: dpo)?")


def plan_pairs(strategy, lengths: np.ndarray, num_ranks: int,
               extra: tuple[np.ndarray, np.ndarray] | None = None) -> Plan:
    """`strategy.plan` over pairs: `lengths` holds each pair's chosen then rejected length
    (tokenized rows in example_id order); every pair is one item and its two pieces share a pack.
    `extra`: per row, the linear work and attention cost its vision tower adds (an image pair's
    two sequences each run the tower on their copy: raypack/data/vision_pairs.py, data/tower.py),
    which the layout weighs beside the pair's tokens and attention cost."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) % 2:
        raise ValueError(f"plan_pairs: {len(lengths)} lengths, expected a (chosen, rejected) length for every pair")
    chosen, rejected = lengths[0::2], lengths[1::2]
    units = check_lengths(chosen + rejected, strategy.budget, False, strategy.name)
    packing = strategy.pack(units)
    # Each unit piece's attention cost: its two sequences', not the square of their sum.
    cost = (chosen * chosen + rejected * rejected).astype(np.float64)
    tokens = None
    if extra is not None and not strategy.splits_examples:  # (splitting strategies are refused for pairs)
        tokens = (chosen + rejected + extra[0][0::2] + extra[0][1::2])[packing.example]
        cost = cost + extra[1][0::2] + extra[1][1::2]
    packing, cell = strategy.layout(packing, num_ranks, attention=cost[packing.example], tokens=tokens)
    pair = packing.example
    example = np.stack([2 * pair, 2 * pair + 1], axis=1).ravel()
    end = np.stack([chosen[pair], rejected[pair]], axis=1).ravel()
    pieces = Packing(example, np.zeros(len(example), np.int64), end, np.repeat(packing.pack, 2), packing.num_packs)
    return place(pieces, cell, num_ranks, strategy=strategy.name, budget=strategy.budget, padded=strategy.padded,
                 reset_positions=strategy.reset_positions)
