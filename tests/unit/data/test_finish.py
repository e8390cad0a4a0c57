"""The streaming finish (raypack.data.pack.finish_rank) writes exactly what assembling a whole
rank at once wrote: the same rows, row groups and files, in batches of any size."""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypack.config import PackConfig
from raypack.data import pack
from raypack.data.pack import (assemble_rows, empty_rows, finish_rank, label_tokens, plan_routing, route_block,
                               write_rank)
from raypack.data.strategies import make_plan

from packcheck import example_table, make_examples


def _whole_rank(out, rank, num_steps, num_ranks, reset, parts, group_rows):
    """The finish before streaming: every piece of the rank assembled at once, then written."""
    parts = [t for t in parts if t.num_rows]
    rows = (assemble_rows(pa.concat_tables(parts), reset) if parts
            else empty_rows(rank, np.zeros(0, np.int64), num_ranks))
    return write_rank(rows, out, rank, num_steps, num_ranks, group_rows), label_tokens(rows)


def _files(folder):
    return [(os.path.basename(f), [pq.ParquetFile(f).metadata.row_group(g).num_rows
                                   for g in range(pq.ParquetFile(f).metadata.num_row_groups)], pq.read_table(f))
            for f in sorted(glob.glob(f"{folder}/*.parquet"))]


@pytest.mark.parametrize("strategy,ranks,group_rows,batch_tokens", [
    ("balanced", 3, 4, 100), ("wrapped_noreset", 2, 8, 1), ("pad", 1, 2, 10**9), ("wrapped", 4, 1, 300)])
def test_streamed_rank_is_the_whole_rank(tmp_path, monkeypatch, strategy, ranks, group_rows, batch_tokens):
    monkeypatch.setattr(pack, "FINISH_TOKENS", batch_tokens)
    monkeypatch.setattr(pack, "ROWS_PER_FILE", 16)  # several files of whole row groups
    budget = 48
    source = make_examples(300, budget, seed=4)
    table, ids, lengths = example_table(source)
    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget, batch_size=4, seed=1), ranks)
    routing = plan_routing(plan, ids)
    parts = [route_block(table.slice(a, 70), routing, ranks) for a in range(0, 300, 70)]
    parts = [p if ranks > 1 else (p,) for p in parts]
    for r in range(ranks):
        mine = [p[r] for p in parts]
        old = _whole_rank(str(tmp_path / f"old/rank={r}"), r, plan.num_steps, ranks, plan.reset_positions, mine,
                          group_rows)
        new = finish_rank(str(tmp_path / f"new/rank={r}"), r, plan.num_steps, ranks, plan.reset_positions, mine,
                          group_rows)
        assert new == old
        a, b = _files(tmp_path / f"old/rank={r}"), _files(tmp_path / f"new/rank={r}")
        assert [(n, g) for n, g, _ in a] == [(n, g) for n, g, _ in b]
        assert all(x.equals(y) for (_, _, x), (_, _, y) in zip(a, b))


def test_a_rank_without_pieces_writes_its_empty_packs(tmp_path):
    empty = empty_rows(1, np.zeros(0, np.int64), 2).slice(0, 0)
    assert finish_rank(str(tmp_path / "r"), 1, 5, 2, True, [], 2) == (5, 0)
    assert pq.read_table(tmp_path / "r")["step"].to_pylist() == [0, 1, 2, 3, 4]
    assert finish_rank(str(tmp_path / "z"), 1, 0, 2, True, [], 2) == (0, 0)
    assert pq.read_table(tmp_path / "z").schema.equals(empty.schema)
