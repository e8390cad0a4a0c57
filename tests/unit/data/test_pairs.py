"""Preference pairs (raypack/data/pairs.py): tokenized as TRL tokenizes them, cut to fit together,
and planned as one item whose two sequences always share a pack, adjacent, chosen first."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from paths import REPO

from raypack.config import ASSETS, PackConfig, load
from raypack.data.encode import DROPPED, OK, TRUNCATED, Encoder, counts, kept_rows
from raypack.data.formats import IGNORE_INDEX, FormatError, detect, validate
from raypack.data.listing import Sources, read_units
from raypack.data.pairs import check_pair_ids, fit_pair, tokenize_pairs
from raypack.data.sources import read_unit
from raypack.data.strategies import STRATEGIES, make_plan
from raypack.errors import ConfigError

SAMPLE = ASSETS / "sample" / "preference.jsonl"
TOKENIZER = str(ASSETS / "tokenizer")
STANDARD = [  # TRL's standard format
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, or 22 when read as text"},
    {"prompt": "Where is the sun? In the", "chosen": " sky.<|eos|>", "rejected": " sea."},  # EOS once
]
IMPLICIT = {"chosen": "Where is the sun? In the sky.", "rejected": "Where is the sun? In the moon."}


def _columns(records: list[dict]) -> dict[str, list]:
    normalized = [validate(r, "preference") for r in records]
    keys = ("prompt", "chosen", "rejected", "prompt_messages", "chosen_messages", "rejected_messages")
    return {k: [n.get(k) for n in normalized] for k in keys}


def _trl_tokenized(records: list[dict]):
    """TRL's own preprocessing of the same records (DPOTrainer._prepare_dataset)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    args = DPOConfig(output_dir="/tmp/unused", max_length=None, report_to=[], bf16=False, use_cpu=True)
    return DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), Dataset.from_list(records), tok, args,
                                       "train")


@pytest.mark.parametrize("kind", ["conversational", "standard"])
def test_pairs_tokenize_as_trl_does(kind):
    from transformers import AutoTokenizer

    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:6]] if kind == "conversational" else STANDARD
    pairs = tokenize_pairs(AutoTokenizer.from_pretrained(TOKENIZER), _columns(records))
    trl = _trl_tokenized(records)
    assert len(pairs) == len(trl) == len(records)
    for pair, ref in zip(pairs, trl):
        assert pair.prompt == len(ref["prompt_ids"]) > 0
        assert pair.chosen == ref["prompt_ids"] + ref["chosen_ids"]
        assert pair.rejected == ref["prompt_ids"] + ref["rejected_ids"]


def test_preference_format_detected_validated_and_refused_clearly():
    assert detect(["prompt", "chosen", "rejected"], "auto", "f") == "preference"
    assert detect(["chosen", "rejected"], "auto", "f") == "preference"
    implicit = validate(IMPLICIT, "preference")  # TRL's implicit prompt: the shared start
    assert implicit == {"prompt": "Where is the sun? In the", "chosen": " sky.", "rejected": " moon."}
    conv = json.loads(SAMPLE.read_text().splitlines()[0])
    full = {"chosen": conv["prompt"] + conv["chosen"], "rejected": conv["prompt"] + conv["rejected"]}
    assert validate(full, "preference") == validate(conv, "preference")  # the implicit prompt, conversational
    for bad, message in [
        ({"prompt": "p", "chosen": "a"}, "missing field `rejected`"),
        ({"prompt": "p", "chosen": "a", "rejected": ["b"]}, "field `rejected` must be a string"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "the same completion"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "bot", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "unknown role 'bot'"),
    ]:
        with pytest.raises(FormatError, match=message):
            validate(bad, "preference")


def _encoded(max_length: int, overlength: str, n: int = 40):
    unit = read_units(Sources.of((str(SAMPLE),)).files)[0]
    rows = read_unit({k: [v] for k, v in unit.items()}, "auto").slice(0, n)
    return Encoder(TOKENIZER, None, "auto", overlength, max_length).encode_table(rows)


def test_encoded_pairs_are_two_rows_with_labels_on_the_completions():
    table = _encoded(10_000, "truncate")
    ids = table["example_id"].to_numpy()
    check_pair_ids(ids)  # (chosen, rejected) of one parent, adjacent
    assert (table["_flag"].to_numpy() == OK).all()
    for chosen, rejected in zip(table.to_pylist()[0::2], table.to_pylist()[1::2]):
        prompt = next(i for i, v in enumerate(chosen["labels"]) if v != IGNORE_INDEX)
        assert chosen["input_ids"][:prompt] == rejected["input_ids"][:prompt]  # the shared prompt
        assert all(v == IGNORE_INDEX for v in rejected["labels"][:prompt])
        assert chosen["labels"][prompt:] == chosen["input_ids"][prompt:]
        assert rejected["labels"][prompt:] == rejected["input_ids"][prompt:]


@pytest.mark.parametrize("overlength", ["drop", "truncate"])
def test_over_length_policy_applies_to_the_pair(overlength):
    whole = _encoded(10_000, overlength)
    lengths = whole["length"].to_numpy()
    limit = int(np.median(lengths[0::2] + lengths[1::2]))  # about half the pairs are over it
    over = int(((lengths[0::2] + lengths[1::2]) > limit).sum())
    table = _encoded(limit, overlength)
    c = counts(table)
    kept = kept_rows(table)
    check_pair_ids(kept["example_id"].to_numpy())  # whole pairs only
    pair_lengths = kept["length"].to_numpy()[0::2] + kept["length"].to_numpy()[1::2]
    assert (pair_lengths <= limit).all()
    if overlength == "drop":
        assert c["dropped"] == over and (table["_flag"].to_numpy() == DROPPED).sum() == over  # one row per pair
        assert kept.num_rows == len(lengths) - 2 * over
        assert c["label_tokens_lost"]["over_length"] > 0
    else:
        assert c["truncated"] == over and (table["_flag"].to_numpy() == TRUNCATED).sum() == 2 * over
        assert kept.num_rows == len(lengths)
        # the prompt goes first: the completions of a pair cut only in its prompt are whole
        assert c["label_tokens_lost"]["truncated"] < c["source_label_tokens"]


def test_fit_pair_cuts_the_prompt_first_then_the_longer_completion():
    assert fit_pair(30, 25, 10, 100) == (0, 30, 25)  # fits: nothing cut
    drop, c, r = fit_pair(30, 25, 10, 45)  # 20 + 15 of completions, 5 of prompt each
    assert (drop, c, r) == (5, 25, 20) and c + r <= 45
    drop, c, r = fit_pair(110, 20, 10, 60)  # prompt down to one token, then the long chosen
    assert drop == 9 and r == 11 and c + r == 60
    assert fit_pair(30, 25, 10, 3) is None  # not even a token of prompt and one of each completion
    rng = np.random.default_rng(0)
    for _ in range(500):
        p, c, r = rng.integers(1, 60, 3)
        limit = int(rng.integers(4, 300))
        cut = fit_pair(int(p + c), int(p + r), int(p), limit)
        if cut is not None:
            drop, cl, rl = cut
            kept = p - drop
            assert cl + rl <= limit and cl - kept >= 1 and rl - kept >= 1
            if cl - kept < c or rl - kept < r:
                assert kept == 1  # completions are cut only once the prompt is down to one token


WHOLE = [n for n, s in STRATEGIES.items() if not s.splits_examples]


@pytest.mark.parametrize("name", WHOLE)
def test_every_pair_lands_whole_in_one_pack(name):
    rng = np.random.default_rng(1)
    pairs = 301
    lengths = np.stack([rng.integers(5, 200, pairs), rng.integers(5, 200, pairs)], axis=1).ravel()
    cfg = PackConfig(strategy=name, budget=512, batch_size=3)
    plan = make_plan(lengths, cfg, num_ranks=3, accum=2, pairs=True)
    assert sorted(plan.example.tolist()) == list(range(len(lengths)))  # every sequence once
    assert (plan.start == 0).all() and (plan.end == lengths[plan.example]).all()  # none cut
    order = np.lexsort((np.arange(len(plan.pack)), plan.pack))
    ex, pack = plan.example[order], plan.pack[order]
    chosen = np.flatnonzero(ex % 2 == 0)
    assert (ex[chosen + 1] == ex[chosen] + 1).all() and (pack[chosen + 1] == pack[chosen]).all()
    if not STRATEGIES[name].padded and STRATEGIES[name].bounded_rows:
        assert plan.pack_tokens().max() <= 512
    assert plan.num_steps % 2 == 0  # every rank the same multiple of accum


def test_balanced_counts_a_pairs_attention_as_its_two_sequences():
    """Pairs of one long and one short sequence: the attention a pack costs is Σ len² over its
    sequences, which the balanced layout must see, not (chosen + rejected)²."""
    rng = np.random.default_rng(2)
    lengths = np.stack([rng.integers(100, 240, 400), rng.integers(2, 20, 400)], axis=1).ravel()
    plan = make_plan(lengths, PackConfig(strategy="balanced", budget=512), num_ranks=4, pairs=True)
    assert plan.stats()["attention_imbalance"] < 1.03  # 1.04 when the layout sees (c + r)²


def test_strategies_that_split_examples_are_refused_by_name():
    from raypack.data.strategies import check_strategies

    cfg = load(REPO / "jobs/configs/quickstart.yaml", ["train.objective=dpo", "pack.strategy=wrapped_noreset"])
    with pytest.raises(ConfigError, match="wrapped_noreset cuts examples"):
        check_strategies(cfg)
    with pytest.raises(ConfigError, match="wrapped cuts examples"):
        make_plan(np.ones(4, np.int64), PackConfig(strategy="wrapped"), 1, pairs=True)


def _normalized(path) -> list[dict]:
    """Every row of a preference source, as read and validated (sources.read_unit), sorted by row."""
    keys = ("prompt", "chosen", "rejected", "prompt_messages", "chosen_messages", "rejected_messages")
    out = []
    for unit in read_units(Sources.of((str(path),)).files):
        table = read_unit({k: [v] for k, v in unit.items()}, "auto")
        assert table["error"].null_count == table.num_rows, table["error"].drop_null().to_pylist()[:1]
        out += [{k: r[k] for k in keys} for r in table.to_pylist()]
    return out


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_parquet_and_save_to_disk_read_as_jsonl(kind, tmp_path):
    """TRL's conversational pairs as Parquet (list<struct> columns) and as a datasets folder."""
    import datasets

    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:40]]
    ds = datasets.Dataset.from_list(records)
    if kind == "parquet":
        path = tmp_path / "pairs.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "pairs"
        ds.save_to_disk(str(path))
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _normalized(path) == _normalized(jsonl)
