"""Data preparation on a local Ray cluster, against what the user was shown and promised:

- `raypack plan --config` prints, and writes with --out, exactly the plan prepare materializes
  (same config, same overrides; accumulation folded in, eval held out);
- `pack.repack_each_epoch` writes one plan per epoch, each covering every training example
  once, with different packs, and no more epochs than `train.max_steps` can use;
- packed data is reused only while its sources are unchanged, and data that trains on nothing
  is refused before anything is packed;
- small data prepared in the driver is what Ray prepares, a mixture of sources included.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from raypack.cli import main
from raypack.config import ASSETS, load
from raypack.data.encode import TokenizeError
from raypack.errors import InputError
from raypack.data import fingerprint
from raypack.data.cache import SourcesChangedError, reusable
from raypack.data.listing import Sources
from raypack.data.prepare import prepare
from raypack.data.shards import iter_epoch_packs, iter_rank_packs
from raypack.runs import absolute_paths

from paths import REPO

pytestmark = pytest.mark.ray

CONFIG = str(REPO / "jobs" / "configs" / "tiny_cpu.yaml")
LINES = (ASSETS / "sample" / "chat.jsonl").read_text().splitlines()[:40]


def pack(cfg, ranks, root, **kw):
    """prepare(), listing the sources now as a command would (after any edit the test made)."""
    return prepare(cfg, ranks, root, Sources.of(cfg.data.paths), **kw)


def _cells(rows_by_rank) -> dict[tuple[int, int], list[int]]:
    return {(r, row["step"]): row["example_ids"] for r, rows in rows_by_rank.items() for row in rows}


def test_plan_command_shows_the_plan_prepare_trains(ray_local, tmp_path, capsys):
    overrides = [f"run.storage_path={tmp_path}", "run.name=plan-vs-prepare", "pack.budget=256",
                 "train.num_workers=2", "train.grad_accum=2", "data.eval_fraction=0.2"]
    out = tmp_path / "plan.parquet"
    assert main(["plan", "--config", CONFIG, *overrides, "--json", "--out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)[0]

    cfg = absolute_paths(load(CONFIG, overrides))
    prepared = pack(cfg, 2, str(tmp_path / "packed"))
    assert shown["steps"] == prepared.steps_per_rank and shown["optimizer_steps"] == prepared.steps_per_rank // 2
    for key in ("packs", "token_imbalance", "attention_imbalance", "token_imbalance_worst"):
        assert shown[key] == prepared.stats[key], key
    planned = defaultdict(list)
    table = pq.read_table(out).to_pylist()
    for row in table:  # ordered by pack, pieces in pack order
        planned[(row["rank"], row["step"])].append(row["example_id"])
    written = _cells({r: list(iter_rank_packs(prepared.train_dir, r)) for r in range(2)})
    assert {k: v for k, v in written.items() if v} == dict(planned)
    assert len({row["example_id"] for row in table}) == prepared.stats["train_examples"]


def test_the_vlm_plan_shown_weighs_the_tower_as_prepare_does(ray_local, tmp_path, capsys):
    """Image data on a VLM: `raypack plan` tokenizes into the cache and weighs each example's patches
    (data/tower.py); prepare reads the tokenized rows back from the cache (the tower's work from
    their grids) and packs the same cells, with the same tower figures."""
    from raypack.model.build import model_config
    from raypack.train.memory.estimate import tower_cost

    config = str(REPO / "jobs" / "configs" / "vlm_quickstart.yaml")
    overrides = [f"run.storage_path={tmp_path}", "run.name=vlm-plan", f"data.cache_path={tmp_path / 'cache'}",
                 "train.num_workers=4"]
    out = tmp_path / "plan.parquet"
    assert main(["plan", "--config", config, *overrides, "--json", "--out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)[0]
    assert shown["widest_patches"] > 0 and shown["tower_imbalance"] >= 1.0

    cfg = absolute_paths(load(config, overrides))
    prepared = pack(cfg, 4, str(tmp_path / "packed"), vision_model=True, tower=tower_cost(model_config(cfg.model.name)))
    assert prepared.stats["tokenize_reused"]
    for key in ("packs", "token_imbalance", "attention_imbalance", "tower_imbalance", "work_imbalance", "widest_patches"):
        assert shown[key] == prepared.stats[key], key
    planned = defaultdict(list)
    for row in pq.read_table(out).to_pylist():
        planned[(row["rank"], row["step"])].append(row["example_id"])
    written = _cells({r: list(iter_rank_packs(prepared.train_dir, r)) for r in range(4)})
    assert {k: v for k, v in written.items() if v} == dict(planned)


def test_repack_each_epoch_writes_new_packs_per_epoch(ray_local, tmp_path):
    overrides = ["pack.strategy=random", "pack.repack_each_epoch=true", "pack.budget=256", "train.epochs=3",
                 "train.num_workers=2", "train.grad_accum=1"]
    cfg = absolute_paths(load(CONFIG, overrides))
    prepared = pack(cfg, 2, str(tmp_path / "packed"))
    assert len(prepared.epochs) == 3
    packs_per_epoch = []
    for epoch in range(3):
        rows = {r: list(iter_epoch_packs(prepared, r, epoch)) for r in range(2)}
        assert len(rows[0]) == len(rows[1]) == prepared.epoch_rows(epoch)[1]  # equal steps on every rank
        ids = sorted(i for rank_rows in rows.values() for row in rank_rows for i in row["example_ids"])
        assert len(ids) == len(set(ids)) == prepared.stats["train_examples"]  # every example once
        packs_per_epoch.append(sorted(tuple(sorted(row["example_ids"])) for rr in rows.values() for row in rr))
    assert packs_per_epoch[0] != packs_per_epoch[1] != packs_per_epoch[2]

    # max_steps inside the first epoch: the other epochs' plans would never be read
    short = absolute_paths(load(CONFIG, [*overrides, "train.max_steps=1"]))
    assert len(pack(short, 2, str(tmp_path / "short")).epochs) == 1


def cfg_for(path, *overrides):
    return load(None, [f"data.paths=[{path}]", "pack.budget=512", "pack.strategy=bfd", *overrides])


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_a_source_edited_under_an_existing_run_is_refused(ray_local, tmp_path, monkeypatch, large):
    if large:  # identified by size and times, and by its content where they moved
        monkeypatch.setattr(fingerprint, "HASH_BYTES", 4)
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    cfg, root = cfg_for(path), str(tmp_path / "packed")
    first = pack(cfg, 2, root)
    os.utime(path, ns=(1, 1))  # touched: same bytes, reused
    assert pack(cfg, 2, root) == first

    size = path.stat().st_size
    path.write_text("\n".join(LINES[:-1] + [LINES[0]]) + "\n")  # the last line edited in place
    why = f"size {size} -> {path.stat().st_size} bytes" if large and size != path.stat().st_size else "content changed"
    with pytest.raises(SourcesChangedError, match=rf"data.paths changed since .*: {path}: {why}.*run.name="):
        reusable(cfg, 2, root, Sources.of(cfg.data.paths))
    with pytest.raises(SourcesChangedError):
        pack(cfg, 2, root)  # never a silent reuse of the old packs
    again = pack(cfg, 2, root, reprepare=True)
    assert again.stats["examples_in"] == first.stats["examples_in"] and again == pack(cfg, 2, root)
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert list(manifest["sources"]) == [str(path)]


def test_data_without_a_label_token_is_refused_before_packing(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    no_answer = {"messages": [{"role": "user", "content": "hello?"}]}
    path.write_text((json.dumps(no_answer) + "\n") * 6)
    with pytest.raises(TokenizeError, match=rf"nothing to train on: of 6 examples, 6 had no token that carries loss \(first: {path} line 1\)"):
        pack(cfg_for(path), 2, str(tmp_path / "packed"))
    assert not (tmp_path / "packed").exists()


def test_a_rank_without_a_label_token_is_refused(ray_local, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(LINES[0] + "\n")  # one example for two ranks
    with pytest.raises(InputError, match="rank 1 of 2 gets no label token"):
        pack(cfg_for(path, "data.eval_fraction=0"), 2, str(tmp_path / "packed"))


def test_prepare_prints_progress_and_what_it_held_out(ray_local, tmp_path, capsys, monkeypatch):
    """Issue 25: a line per interval for each long stage (the interval shortened here), and the
    eval split's size and cause; no Ray Data progress bars."""
    import ray.data

    from raypack.data import progress

    monkeypatch.setattr(progress, "INTERVAL_S", 0.05)
    cfg = absolute_paths(load(CONFIG, [f"run.storage_path={tmp_path}", "pack.budget=256", "data.eval_fraction=0.2",
                                       "data.driver_max_mb=0"]))  # through Ray, whose stages report progress
    pack(cfg, 2, str(tmp_path / "packed"))
    out = capsys.readouterr().out.splitlines()
    assert ray.data.DataContext.get_current().enable_progress_bars is False
    assert any(re.fullmatch(r"\[raypack\] tokenize: [\d,]+ examples read(, [\d,]+/s)?", s) for s in out), out
    assert any(re.fullmatch(r"\[raypack\] pack train: [\d,]+ of [\d,]+ (examples routed|rows written) \(\d+%\)"
                            r"(, [\d,]+/s(, about \w+ left)?)?", s) for s in out), out
    held = [s for s in out if s.startswith("[raypack] held out ")]
    assert len(held) == 1 and held[0].endswith(" examples for eval (data.eval_fraction=0.2)"), held


def _written(folder) -> dict[str, list]:
    """Every Parquet file under `folder`, by its path there: its rows."""
    return {str(f.relative_to(folder)): pq.read_table(f).to_pylist() for f in sorted(folder.rglob("*.parquet"))}


@pytest.mark.parametrize("data, overrides", [
    # every text format in one run, a long example split, a bad row skipped, eval held out
    (["sample/chat.jsonl", "sample/instruction.jsonl", "sample/completion.jsonl", "sample/tokenized.parquet"],
     ["pack.budget=256", "tokenize.overlength=split", "pack.strategy=wrapped", "data.on_bad_rows=skip"]),
    (["sample/preference.jsonl"], ["train.objective=dpo"]),
    (["vision_sample/vision.jsonl"], ["tokenize.tokenizer=raypack/assets/vlm_processor", "model.name=tiny-qwen2_5_vl",
                                      "pack.budget=256"]),
], ids=["text", "dpo", "vision"])
def test_small_data_prepared_in_the_driver_is_what_ray_prepares(ray_local, tmp_path, data, overrides):
    """data.driver_max_mb: data under it is tokenized and packed in the driver's process. Both
    ways write the same files with the same rows, and record the same counts."""
    bad = tmp_path / "bad.jsonl"  # a bad row among good ones, skipped both ways
    bad.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}\n'
                   "{not json\n")
    paths = [str(ASSETS / p) for p in data] + ([str(bad)] if "data.on_bad_rows=skip" in overrides else [])
    made = {}
    for limit in (0, 16):
        cfg = absolute_paths(load(CONFIG, [f"data.paths={json.dumps(paths)}", f"run.storage_path={tmp_path}",
                                           "data.eval_fraction=0.2", f"data.driver_max_mb={limit}", *overrides]))
        root = tmp_path / f"packed{limit}"
        prepared = pack(cfg, 2, str(root), vision_model="vision" in data[0])
        timing = ("tokenize_s", "prepare_s", "tokenize_reused", "seconds")
        made[limit] = (_written(root / "train"), _written(root / "eval"), _written(root / "images") if
                       (root / "images").exists() else {},
                       {k: v for k, v in prepared.stats.items() if k not in timing}, prepared.steps_per_rank)
    assert made[0][0], "nothing packed"
    assert made[16] == made[0]


def test_a_mixture_prepared_in_the_driver_is_what_ray_prepares(ray_local, tmp_path):
    """data.sources through both ways: three formats, one under its own column names and one
    declared, weights that repeat one source and draw from the others, each source's eval split.
    Ray Data's read tasks read each unit by its source's format and columns as the driver does."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"what is {i} + 1?", "answer": f" {i + 1}"}) + "\n" for i in range(40)))
    mixture = json.dumps([{"paths": [str(ASSETS / "sample" / "chat.jsonl")], "weight": 0.5},
                          {"paths": [str(ASSETS / "sample" / "instruction.jsonl")], "weight": 0.3, "format": "instruction"},
                          {"paths": [str(qa)], "weight": 0.2, "name": "qa",
                           "columns": {"prompt": "question", "completion": "answer"}}])
    made = {}
    for limit in (0, 16):
        cfg = absolute_paths(load(CONFIG, ["data.paths=[]", f"data.sources={mixture}", f"run.storage_path={tmp_path}", "pack.budget=256",
                                           "data.eval_fraction=0.2", f"data.driver_max_mb={limit}"]))
        root = tmp_path / f"packed{limit}"
        prepared = prepare(cfg, 2, str(root), Sources.of_data(cfg.data))
        timing = ("tokenize_s", "prepare_s", "tokenize_reused", "seconds")
        made[limit] = (_written(root / "train"), _written(root / "eval"),
                       {k: v for k, v in prepared.stats.items() if k not in timing}, prepared.steps_per_rank,
                       prepared.eval_sources)
    assert made[16] == made[0]
    figures, eval_sources = made[0][2]["sources"], made[0][4]
    total = sum(f["available"] for f in figures)  # 510 after the eval splits: 255, 153, 102 exactly
    assert [f["examples"] for f in figures] == [total * 5 // 10, total * 3 // 10, total * 2 // 10] == [255, 153, 102]
    assert [s["name"] for s in eval_sources] == ["chat", "instruction", "qa"]
