"""raypack/data/mixture.py: the draw's exact counts per source, its repeats, its seed, the epoch
sizes, the refusals; and a three-format mixture prepared in the driver (no Ray): its packed rows
hold the draw, packed together, with the figures printed and each eval step one source's."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from raypack.config import DataConfig, SourceConfig, load
from raypack.data.holdout import held_out_mask
from raypack.data.listing import Sources
from raypack.data.mixture import Mixture, source_names
from raypack.data.pairs import check_pair_ids
from raypack.data.sources import example_id, locate
from raypack.errors import InputError

SIZES = (10, 20, 30)


def mixture(weights=(0.5, 0.3, 0.2), sizes=SIZES, per_epoch="sum", names=(None, None, None)) -> Mixture:
    paths = [f"{'abc'[k]}.jsonl" for k in range(len(sizes))]
    data = DataConfig(sources=tuple(SourceConfig(paths=(p,), weight=w, name=n) for p, w, n in zip(paths, weights, names)),
                      examples_per_epoch=per_epoch)
    labels = tuple(f"data.sources[{k}] (paths: {p})" for k, p in enumerate(paths))
    return Mixture.of(data, Sources(tuple((p, "jsonl") for p in paths), {}, tuple(range(len(sizes))), (), labels))


def ids_of(sizes=SIZES, pieces=1) -> np.ndarray:
    return np.array([example_id(f, r, p) for f, n in enumerate(sizes) for r in range(n) for p in range(pieces)])


def test_each_source_gets_its_exact_share_repeated_evenly_where_it_asks_for_more():
    ids = ids_of()
    drawn = ids[mixture().draw(ids, seed=0)]  # 60 examples: 30, 18, 12
    times = Counter(drawn.tolist())
    by_source = [Counter(locate(i)[0] for i in drawn)[k] for k in range(3)]
    assert by_source == [30, 18, 12]
    assert {times[int(i)] for i in ids[:10]} == {3}  # source 0 holds 10: every one exactly 3 times
    assert all(times[i] == 1 for i in times if locate(i)[0] > 0)  # the others: none twice
    assert np.all(np.diff(drawn) >= 0)  # in example_id order, a repeat beside its row
    # 25 from 10: every one twice, five of them a third time
    drawn = ids[mixture((25, 20, 15), per_epoch=60).draw(ids, seed=0)]
    assert sorted(Counter(i for i in drawn.tolist() if locate(i)[0] == 0).values()) == [2] * 5 + [3] * 5


def test_the_draw_is_seeded():
    ids = ids_of()
    mix = mixture()
    assert np.array_equal(mix.draw(ids, seed=0), mix.draw(ids, seed=0))
    assert not np.array_equal(mix.draw(ids, seed=0), mix.draw(ids, seed=1))


@pytest.mark.parametrize("per_epoch, counts", [
    ("sum", [30, 18, 12]),             # 60 = 10 + 20 + 30
    ("first_exhausted", [10, 6, 4]),   # the most with none repeated: source 0 runs out at 20
    ("all_exhausted", [75, 45, 30]),   # the fewest that show all: source 2 needs 150
    (7, [4, 2, 1]),                    # 3.5, 2.1, 1.4: one more by largest remainder
])  # fmt: skip
def test_examples_per_epoch(per_epoch, counts):
    assert mixture(per_epoch=per_epoch).counts(np.array(SIZES)).tolist() == counts


def test_pieces_and_pairs_are_drawn_and_repeated_together():
    ids = ids_of(pieces=2)  # every row two pieces: a split example, or a (chosen, rejected) pair
    drawn = ids[mixture().draw(ids, seed=0)]
    check_pair_ids(drawn)  # whole pairs, each chosen beside its rejected
    assert [Counter(locate(i)[0] for i in drawn)[k] for k in range(3)] == [60, 36, 24]  # rows as before, x2


def test_without_weights_every_example_once():
    ids = ids_of()
    assert np.array_equal(mixture(weights=(None, None, None)).draw(ids, seed=0), np.arange(len(ids)))


def test_a_share_under_one_example_or_an_empty_source_is_refused_naming_it():
    with pytest.raises(InputError, match=r"^data.sources\[2\] \(paths: c.jsonl\): weight 0.001 of 1.001 names 0.06 of "
                                         r"the 60 examples of an epoch \(data.examples_per_epoch=sum\), less than one"):
        mixture(weights=(0.5, 0.5, 0.001)).counts(np.array(SIZES))
    with pytest.raises(InputError, match=r"^data.sources\[1\] \(paths: b.jsonl\): no training example left"):
        mixture().counts(np.array([10, 0, 30]))


def test_source_names():
    def names(*sources):
        return source_names(DataConfig(sources=tuple(SourceConfig(paths=(p,), name=n) for p, n in sources)))

    assert names(("data/chat.jsonl", None), ("s3://b/math/", None), ("x.parquet", "safety")) == ("chat", "math", "safety")
    assert names(("a/train.jsonl", None), ("b/train.jsonl", None)) == ("train-0", "train-1")
    with pytest.raises(InputError, match=r"data.sources\[1\].name: 'x' names data.sources\[0\] too"):
        names(("a.jsonl", "x"), ("b.jsonl", "x"))


def test_the_eval_split_is_each_sources_own():
    ids = ids_of((1000, 100))
    owner = np.repeat([0, 1], [1000, 100])
    cfg = load(None, ["data.eval_fraction=0.1", "data.eval_max_examples=20"])
    held = held_out_mask(ids, cfg, owner)
    assert held[owner == 0].sum() == 20 and held[owner == 1].sum() == 10  # capped alone, and the small one kept its 10%
    assert held_out_mask(ids, cfg).sum() == 20  # one source: the cap is the whole data's


# --- through prepare, in the driver ---------------------------------------------------------------

def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def three_formats(tmp_path) -> list[str]:
    """A mixture of three formats, one of them under its own column names: 6 chats, 10
    instruction rows, 20 question/answer rows read as completions."""
    chat = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hello {i}?"},
                                                          {"role": "assistant", "content": f"hi there {i}"}]}
                                            for i in range(6)])
    inst = _write(tmp_path / "inst.jsonl", [{"instruction": f"count to {i}", "output": " ".join(map(str, range(i + 1)))}
                                            for i in range(10)])
    qa = _write(tmp_path / "qa.jsonl", [{"question": f"what is {i} + 1?", "answer": f" {i + 1}"} for i in range(20)])
    return [json.dumps([{"paths": [chat], "weight": 0.5}, {"paths": [inst], "weight": 0.3, "format": "instruction"},
                        {"paths": [qa], "weight": 0.2, "name": "qa", "columns": {"prompt": "question",
                                                                                   "completion": "answer"}}])]


def test_a_three_format_mixture_is_drawn_packed_together_and_described(tmp_path, capsys):
    from raypack.data.prepare import prepare
    from raypack.data.shards import iter_rank_packs
    from raypack.runs import absolute_paths

    (sources,) = three_formats(tmp_path)
    cfg = absolute_paths(load(None, [f"data.sources={sources}", "data.eval_fraction=0", "pack.budget=128",
                                     "pack.strategy=bfd", "train.grad_accum=1", f"run.storage_path={tmp_path}"]))
    prepared = prepare(cfg, 2, str(tmp_path / "packed"), Sources.of_data(cfg.data))
    rows = [row for r in range(2) for row in iter_rank_packs(prepared.train_dir, r)]
    trained = Counter(i for row in rows for i in row["example_ids"])
    # 36 examples: 18 of the 6 chats (each 3 times), 10.8 -> 11 of the 10 instructions, 7.2 -> 7 of the 20
    assert [sum(n for i, n in trained.items() if locate(i)[0] == k) for k in range(3)] == [18, 11, 7]
    assert sorted(n for i, n in trained.items() if locate(i)[0] == 0) == [3] * 6
    assert sorted(n for i, n in trained.items() if locate(i)[0] == 1) == [1] * 9 + [2]
    assert len([i for i in trained if locate(i)[0] == 2]) == 7
    assert any(len({locate(i)[0] for i in row["example_ids"]}) > 1 for row in rows), "no row mixes sources"
    out = capsys.readouterr().out
    assert "[raypack] mixture of 3 sources: 36 examples an epoch (by weight, data.examples_per_epoch=sum)" in out
    assert "[raypack]   chat  weight 0.5, 18 from its 6, each 3 times: 50.0% of the examples; " in out
    assert "[raypack]   inst  weight 0.3, 11 from its 10, each 1 or 2 times: 30.6% of the examples; " in out
    assert "[raypack]   qa    weight 0.2, 7 of its 20, none twice: 19.4% of the examples; " in out
    figures = {f["name"]: f for f in prepared.stats["sources"]}
    tokens = Counter()
    for row in rows:  # label tokens the rows carry, by source: the figures' (no example is cut here)
        starts = np.flatnonzero(np.asarray(row["position_ids"]) == 0)
        labels = np.asarray(row["labels"])
        for i, (a, b) in zip(row["example_ids"], zip(starts, [*starts[1:], len(labels)])):
            tokens[locate(i)[0]] += int((labels[a + 1:b] != -100).sum())
    assert [figures[n]["label_tokens"] for n in ("chat", "inst", "qa")] == [tokens[0], tokens[1], tokens[2]]


def test_a_mixtures_eval_steps_are_one_source_each(tmp_path):
    from raypack.data.prepare import prepare
    from raypack.data.shards import iter_rank_packs
    from raypack.runs import absolute_paths

    (sources,) = three_formats(tmp_path)
    cfg = absolute_paths(load(None, [f"data.sources={sources}", "data.eval_fraction=0.3", "pack.budget=128",
                                     "train.grad_accum=1", f"run.storage_path={tmp_path}"]))
    prepared = prepare(cfg, 2, str(tmp_path / "packed"), Sources.of_data(cfg.data))
    assert [s["name"] for s in prepared.eval_sources] == ["chat", "inst", "qa"]
    seen = Counter()
    for r in range(2):
        for row in iter_rank_packs(prepared.eval_dir, r):
            owners = {["chat", "inst", "qa"][locate(i)[0]] for i in row["example_ids"]}
            assert owners <= {prepared.eval_source(row["step"])}, row["step"]
            seen.update(owners)
    held = {f["name"]: f["eval_examples"] for f in prepared.stats["sources"]}
    assert set(seen) == {n for n, k in held.items() if k} and all(held.values())


def test_a_preference_mixture_keeps_every_pair_whole_in_training_and_eval(tmp_path):
    """DPO on two weighted sources of preference pairs: a pair is drawn, repeated and packed as
    one item, in the training rows and in each source's eval steps."""
    from raypack.config import ASSETS
    from raypack.data.prepare import prepare
    from raypack.data.shards import iter_rank_packs
    from raypack.runs import absolute_paths

    from paths import REPO

    lines = (ASSETS / "sample" / "preference.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:20]))
    (tmp_path / "b.jsonl").write_text("".join(lines[20:60]))
    sources = f"data.sources=[{{paths: [{tmp_path / 'a.jsonl'}], weight: 3}}, {{paths: [{tmp_path / 'b.jsonl'}], weight: 1}}]"
    cfg = absolute_paths(load(str(REPO / "jobs" / "configs" / "dpo_quickstart.yaml"),
                              ["data.paths=[]", sources, "data.eval_fraction=0.2", f"run.storage_path={tmp_path}"]))
    prepared = prepare(cfg, 2, str(tmp_path / "packed"), Sources.of_data(cfg.data))
    for folder in (prepared.train_dir, prepared.eval_dir):
        for r in range(2):
            for row in iter_rank_packs(folder, r):
                pieces = Counter(i & ~1 for i in row["example_ids"])  # a pair: pieces 0 and 1 of one row
                assert all(n % 2 == 0 for n in pieces.values()), row["example_ids"]
    drawn = {f["name"]: f["examples"] for f in prepared.stats["sources"]}
    total = sum(f["available"] for f in prepared.stats["sources"])
    assert sum(drawn.values()) == total and abs(drawn["a"] - 0.75 * total) < 1  # pairs, by weight
    assert prepared.stats["train_examples"] == 2 * total  # two rows a pair
