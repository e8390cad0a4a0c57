"""Data preparation on a local Ray cluster, against what the user was shown and promised:

- `raypack plan --config` prints, and writes with --out, exactly the plan prepare materializes
  (same config, same overrides; accumulation folded in, eval held out);
- `pack.repack_each_epoch` writes one plan per epoch, each covering every training example
  once, with different packs, and no more epochs than `train.max_steps` can use.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from raypack.cli import main
from raypack.config import load
from raypack.data.prepare import prepare
from raypack.data.shards import iter_epoch_packs, iter_rank_packs
from raypack.runtime import absolute_paths

from paths import REPO

pytestmark = pytest.mark.ray

CONFIG = str(REPO / "jobs" / "configs" / "tiny_cpu.yaml")


def _cells(rows_by_rank) -> dict[tuple[int, int], list[int]]:
    return {(r, row["step"]): row["example_ids"] for r, rows in rows_by_rank.items() for row in rows}


def test_plan_command_shows_the_plan_prepare_trains(ray_local, tmp_path, capsys):
    overrides = [f"run.storage_path={tmp_path}", "run.name=plan-vs-prepare", "pack.budget=256",
                 "train.num_workers=2", "train.grad_accum=2", "data.eval_fraction=0.2"]
    out = tmp_path / "plan.parquet"
    assert main(["plan", "--config", CONFIG, *overrides, "--json", "--out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)[0]

    cfg = absolute_paths(load(CONFIG, overrides))
    prepared = prepare(cfg, 2, str(tmp_path / "packed"))
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


def test_repack_each_epoch_writes_new_packs_per_epoch(ray_local, tmp_path):
    overrides = ["pack.strategy=random", "pack.repack_each_epoch=true", "pack.budget=256", "train.epochs=3",
                 "train.num_workers=2", "train.grad_accum=1"]
    cfg = absolute_paths(load(CONFIG, overrides))
    prepared = prepare(cfg, 2, str(tmp_path / "packed"))
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
    assert len(prepare(short, 2, str(tmp_path / "short")).epochs) == 1
