"""Synthetic example lengths (and, built on them, examples) that follow real SFT corpora.

The packing work and the benchmarks need realistic length distributions at sizes no test can
download. Three shapes cover the cases the papers study:

- `flan`:     short with a wide spread (FLAN instructions: many tiny, some long)
- `orcamath`: longer and narrow (OrcaMath word problems with worked answers)
- `wildchat`: long-tailed multi-turn conversations

The parameters are lognormal fits chosen to match the shapes above, not measured corpora.

Three more shapes are held out for the balance targets (raypack/data/balance.py), chosen because
they are hard for it, not fitted to any corpus:

- `pareto`:  heavy-tailed, 24 * (1 + Pareto(1.1)): mostly short, a long tail up to the budget
- `bimodal`: 70% short answers (median 60) and 30% long documents (median 2500, narrow)
- `tiny`:    90% tiny examples (median 12 tokens) mixed with 10% flan-like ones
"""

from __future__ import annotations

import numpy as np

# (median tokens, lognormal sigma, min, max)
DISTRIBUTIONS: dict[str, tuple[float, float, int, int]] = {
    "flan": (180.0, 1.0, 8, 4096),
    "orcamath": (420.0, 0.3, 64, 2048),
    "wildchat": (700.0, 1.1, 16, 16384),
}


HELD_OUT: dict[str, tuple[int, int]] = {"pareto": (24, 16384), "bimodal": (8, 16384), "tiny": (2, 4096)}
"""(min, max) of the held-out shapes, drawn in `_held_out`."""
KINDS = (*DISTRIBUTIONS, *HELD_OUT)


def _held_out(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if kind == "pareto":
        return 24.0 * (1.0 + rng.pareto(1.1, n))
    if kind == "bimodal":
        short = rng.random(n) < 0.7
        return np.where(short, rng.lognormal(np.log(60), 0.5, n), rng.lognormal(np.log(2500), 0.3, n))
    tiny = rng.random(n) < 0.9
    return np.where(tiny, rng.lognormal(np.log(12), 0.5, n), rng.lognormal(np.log(180), 1.0, n))


def sample_lengths(kind: str, n: int, seed: int = 0, max_length: int | None = None) -> np.ndarray:
    """`n` example lengths (int64) drawn from distribution `kind` (one of KINDS), clipped to
    [min, max_length]."""
    rng = np.random.default_rng(seed)
    if kind in DISTRIBUTIONS:
        median, sigma, lo, hi = DISTRIBUTIONS[kind]
        lengths = rng.lognormal(np.log(median), sigma, size=n)
    elif kind in HELD_OUT:
        lo, hi = HELD_OUT[kind]
        lengths = _held_out(kind, rng, n)
    else:
        raise ValueError(f"unknown length distribution {kind!r}; expected one of {', '.join(KINDS)}")
    hi = min(hi, max_length) if max_length else hi
    return np.clip(np.rint(lengths), lo, hi).astype(np.int64)


# --- synthetic examples --------------------------------------------------------------------------
# Text is drawn from a small fixed word list, so the bundled tokenizer (trained on this same text)
# turns roughly one word into one token; other tokenizers give somewhat more tokens a word. Lengths
# are therefore targets in words, which track token lengths closely enough for packing work.

_WORDS = (
    "the of and to in is was for on that with as by at from it be are this an or which have not "
    "they has but were had their one all can more other been also when there who some first time "
    "into two new after would these many so only most over may such years its about then them "
    "made where between each under while state three both through world used work during under "
    "number part system water people day long city year old called high could well government "
    "since group later found school area each known four found large small five number point "
    "river north south east west data model train token pack batch rank step loss value answer "
    "question solve total each cost price apples books minutes hours miles speed rate sum half "
    "double twice remaining left right first second third last next every per percent equals"
).split()
_DEFAULT_KIND = {"chat": "wildchat", "instruction": "flan", "completion": "orcamath"}
FORMATS = tuple(_DEFAULT_KIND)


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(len(_WORDS), size=max(1, n_words))
    out, since_stop = [], 0
    for i in words:
        out.append(_WORDS[i])
        since_stop += 1
        if since_stop > 6 and rng.random() < 0.12:  # sentences of a plausible size
            out[-1] += "."
            since_stop = 0
    return " ".join(out) + "."


def corpus_text(n: int, seed: int = 0) -> list[str]:
    """`n` paragraphs of synthetic text (what tools/make_tokenizer.py trains on)."""
    rng = np.random.default_rng(seed)
    return [_text(rng, int(rng.integers(20, 200))) for _ in range(n)] + ["0 1 2 3 4 5 6 7 8 9 , . ? ! : ; ( ) ' \" - + = * /"]


def make_examples(fmt: str, n: int, seed: int = 0, kind: str | None = None, max_length: int | None = None) -> list[dict]:
    """`n` synthetic records in format `fmt` (chat, instruction or completion) whose total length
    in words follows `sample_lengths(kind, ...)`; `kind` defaults per format (chat: wildchat,
    instruction: flan, completion: orcamath)."""
    if fmt not in _DEFAULT_KIND:
        raise ValueError(f"unknown example format {fmt!r}; expected one of {', '.join(FORMATS)}")
    lengths = sample_lengths(kind or _DEFAULT_KIND[fmt], n, seed=seed, max_length=max_length)
    rng = np.random.default_rng(seed + 1)
    records = []
    for total in lengths.tolist():
        if fmt == "chat":
            # Template markers cost ~3 tokens a turn; turns share what is left (about 1/3 prompts).
            turns = int(rng.integers(1, 4)) if total > 60 else 1
            budget = max(2 * turns, total - 3 * 2 * turns - 1)
            shares = rng.dirichlet(np.ones(2 * turns)) * budget
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": _text(rng, 4)})
            for t in range(turns):
                messages.append({"role": "user", "content": _text(rng, int(shares[2 * t] * 0.5))})
                messages.append({"role": "assistant", "content": _text(rng, int(shares[2 * t] * 0.5 + shares[2 * t + 1]))})
            records.append({"messages": messages})
        else:
            prompt_words = max(1, int(total * rng.uniform(0.2, 0.6)))
            answer_words = max(1, total - prompt_words - 8)
            if fmt == "instruction":
                has_input = rng.random() < 0.5
                instr = prompt_words // 2 if has_input else prompt_words
                records.append(
                    {
                        "instruction": _text(rng, instr),
                        "input": _text(rng, prompt_words - instr) if has_input else "",
                        "output": _text(rng, answer_words),
                    }
                )
            else:
                records.append({"prompt": _text(rng, prompt_words), "completion": " " + _text(rng, answer_words)})
    return records


def make_preference_examples(n: int, seed: int = 0, max_words: int = 60) -> list[dict]:
    """`n` conversational preference pairs ({"prompt", "chosen", "rejected"}, TRL's format) with a
    signal a tiny model can learn in minutes: the chosen answer is drawn from one half of the word
    list and the rejected one from the other, at similar lengths, so a model that learns the
    preference generalizes it to held-out pairs (the DPO quickstart's eval accuracy)."""
    rng = np.random.default_rng(seed)
    half = len(_WORDS) // 2
    preferred, other = _WORDS[:half], _WORDS[half:]

    def answer(words: tuple[str, ...], k: int) -> str:
        return " ".join(words[i] for i in rng.choice(len(words), size=k)) + "."

    records = []
    for _ in range(n):
        prompt = [{"role": "user", "content": _text(rng, int(rng.integers(4, max_words)))}]
        k = int(rng.integers(3, max_words))
        chosen, rejected = answer(preferred, k), answer(other, max(1, k + int(rng.integers(-3, 4))))
        records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
    return records
