"""Shared checks for the pack stage: synthetic examples whose tokens tell their origin, and a
checker that the materialized rows follow a plan exactly (used with and without Ray)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from raypack.data.formats import TRAINS_ON_IDS, row_labels
from raypack.data.shards import iter_rank_packs
from raypack.data.strategies import STRATEGIES


def make_examples(n: int, budget: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(10_000, size=n, replace=False) * 7 + 3  # unique, sparse, unordered
    rows = []
    for eid in ids.tolist():
        length = int(rng.integers(1, budget + 1))
        tokens = (eid * 1000 + np.arange(length)).astype(np.int32)  # every token tells its origin
        labels = np.where(rng.random(length) < 0.3, -100, tokens).astype(np.int32)
        if rng.random() < 0.3:
            labels = TRAINS_ON_IDS  # as pre-tokenized rows without labels are stored
        rows.append({"example_id": eid, "input_ids": tokens, "labels": labels, "length": length})
    return rows


def example_table(source: list[dict]) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """`make_examples`' rows as a tokenized table, and their ids and lengths ordered by example_id
    (what the planner sees)."""
    table = pa.table({
        "example_id": pa.array([r["example_id"] for r in source], pa.int64()),
        "input_ids": pa.array([r["input_ids"] for r in source], pa.list_(pa.int32())),
        "labels": pa.array([r["labels"] for r in source], pa.list_(pa.int32())),
        "length": pa.array([r["length"] for r in source], pa.int32()),
    })
    order = np.argsort(table["example_id"].to_numpy())
    return table, table["example_id"].to_numpy()[order], table["length"].to_numpy()[order]


def check_rows(out_dir, plan, ids, source):
    by_id = {r["example_id"]: r for r in source}
    seen = []
    for rank in range(plan.num_ranks):
        rows = list(iter_rank_packs(out_dir, rank))
        assert [r["step"] for r in rows] == list(range(plan.num_steps))
        for row in rows:
            pack = row["step"] * plan.num_ranks + rank
            assert row["pack"] == pack and row["rank"] == rank
            sel = np.flatnonzero(plan.pack == pack)
            if len(sel) == 0:
                assert row["input_ids"] == [0] and row["labels"] == [-100] and row["example_ids"] == []
                continue
            want_ids, want_lab, want_pos, on_ids = [], [], [], []
            for e in sel:
                src = by_id[int(ids[plan.example[e]])]
                s, t = int(plan.start[e]), int(plan.end[e])
                want_ids += list(src["input_ids"][s:t])
                want_lab += list(row_labels(src)[s:t])  # labels only from the piece's own example
                on_ids.append(src["labels"] is TRAINS_ON_IDS)
                want_pos += list(range(t - s))  # positions restart at every boundary
                seen.append((src["example_id"], s, t))
            if not plan.reset_positions:
                want_pos = list(range(len(want_ids)))
            assert row["input_ids"] == want_ids
            assert row_labels(row) == want_lab
            # stored once: a row whose every piece trains on its ids has no labels of its own
            assert (row["labels"] is TRAINS_ON_IDS) == all(on_ids)
            assert row["position_ids"] == want_pos
            assert row["example_ids"] == [int(ids[plan.example[e]]) for e in sel]
            assert row["num_tokens"] == len(want_ids)
            assert not STRATEGIES[plan.strategy].bounded_rows or len(want_ids) <= plan.budget
    tokens = sorted((eid, s + i) for eid, s, t in seen for i in range(t - s))
    assert tokens == sorted((r["example_id"], i) for r in source for i in range(r["length"]))
    assert list(iter_rank_packs(out_dir, 0, start_step=plan.num_steps - 1))[0]["step"] == plan.num_steps - 1
