"""Pack stage without Ray: routing and row assembly in process follow the plan exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raypack.config import PackConfig
from raypack.data.pack import _finish_rank_tables, _route_block, _routing, iter_rank_packs
from raypack.data.plan import make_plan


def _examples(n: int, budget: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(10_000, size=n, replace=False) * 7 + 3  # unique, sparse, unordered
    rows = []
    for eid in ids.tolist():
        length = int(rng.integers(1, budget + 1))
        tokens = (eid * 1000 + np.arange(length)).astype(np.int32)  # every token tells its origin
        labels = np.where(rng.random(length) < 0.3, -100, tokens).astype(np.int32)
        rows.append({"example_id": eid, "input_ids": tokens, "labels": labels, "length": length})
    return rows


def _check(out_dir, plan, ids, source):
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
            want_ids, want_lab, want_pos = [], [], []
            for e in sel:
                src = by_id[int(ids[plan.example[e]])]
                s, t = int(plan.start[e]), int(plan.end[e])
                want_ids += list(src["input_ids"][s:t])
                want_lab += list(src["labels"][s:t])  # labels only from the piece's own example
                want_pos += list(range(t - s))  # positions restart at every boundary
                seen.append((src["example_id"], s, t))
            if not plan.reset_positions:
                want_pos = list(range(len(want_ids)))
            assert row["input_ids"] == want_ids
            assert row["labels"] == want_lab
            assert row["position_ids"] == want_pos
            assert row["example_ids"] == [int(ids[plan.example[e]]) for e in sel]
            assert row["num_tokens"] == len(want_ids)
            assert plan.padded or plan.strategy == "flatten" or len(want_ids) <= plan.budget
    tokens = sorted((eid, s + i) for eid, s, t in seen for i in range(t - s))
    assert tokens == sorted((r["example_id"], i) for r in source for i in range(r["length"]))
    assert list(iter_rank_packs(out_dir, 0, start_step=plan.num_steps - 1))[0]["step"] == plan.num_steps - 1


@pytest.mark.parametrize("strategy,ranks", [("wrapped", 2), ("wrapped_noreset", 3), ("balanced", 4), ("pad", 1)])
def test_rows_follow_plan(tmp_path, strategy, ranks):
    budget = 48
    source = _examples(90, budget, seed=2)
    table = pa.table(
        {
            "example_id": pa.array([r["example_id"] for r in source], pa.int64()),
            "input_ids": pa.array([r["input_ids"] for r in source], pa.list_(pa.int32())),
            "labels": pa.array([r["labels"] for r in source], pa.list_(pa.int32())),
            "length": pa.array([r["length"] for r in source], pa.int32()),
        }
    )
    order = np.argsort(table["example_id"].to_numpy())
    ids, lengths = table["example_id"].to_numpy()[order], table["length"].to_numpy()[order]
    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget, batch_size=4, seed=5), ranks)
    routing = _routing(plan, ids)
    parts = [_route_block(block, routing, ranks) for block in (table.slice(0, 40), table.slice(40))]
    parts = [p if ranks > 1 else (p,) for p in parts]
    for r in range(ranks):
        _finish_rank_tables(str(tmp_path / f"rank={r}"), r, plan.num_steps, ranks, plan.reset_positions,
                            *[p[r] for p in parts])
    _check(str(tmp_path), plan, ids, source)
