"""Pack stage on a local Ray cluster: the materialized rows follow the global plan exactly."""

from __future__ import annotations

import pyarrow as pa
import pytest

from raypack.config import PackConfig
from raypack.data.pack import materialize
from raypack.data.strategies import make_plan
from raypack.data.tokenize import lengths_and_ids

from packcheck import check_rows, make_examples


@pytest.mark.parametrize(
    "strategy,n,ranks",
    [("balanced", 120, 3), ("wrapped_noreset", 20, 2), ("bfd", 3, 8)],
)
def test_materialize_follows_plan(ray_local, tmp_path, strategy, n, ranks):
    import ray

    budget = 64
    source = make_examples(n, budget)
    table = pa.table(
        {
            "example_id": pa.array([r["example_id"] for r in source], pa.int64()),
            "input_ids": pa.array([r["input_ids"] for r in source], pa.list_(pa.int32())),
            "labels": pa.array([r["labels"] for r in source], pa.list_(pa.int32())),
            "length": pa.array([r["length"] for r in source], pa.int32()),
        }
    )
    ds = ray.data.from_arrow([table.slice(0, n // 2), table.slice(n // 2)])  # like tokenize's output
    lengths, ids = lengths_and_ids(ds)
    assert list(ids) == sorted(r["example_id"] for r in source)
    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget, seed=1), ranks)
    info = materialize(ds, plan, ids, str(tmp_path / "packed"))
    assert info["rows"] == plan.num_packs
    check_rows(str(tmp_path / "packed"), plan, ids, source)
    # the label tokens per rank that prepare checks are the ones training counts
    from raypack.data.collate import collate_packed, count_label_tokens
    from raypack.data.shards import iter_rank_packs

    trained = [sum(count_label_tokens(collate_packed([row])) for row in iter_rank_packs(str(tmp_path / "packed"), r))
               for r in range(ranks)]
    assert info["rank_label_tokens"] == trained
