"""The pack benchmark's baselines (benchmarks/pack_baselines.py) follow the plan exactly, as the
routed pack stage does, checked by the same plan checker: the benchmark compares like with like."""

from __future__ import annotations

import pyarrow as pa
import pytest

from benchmarks.pack_baselines import materialize
from raypack.config import PackConfig
from raypack.data.strategies import make_plan
from raypack.data.tokenize import lengths_and_ids

from packcheck import check_rows, make_examples


@pytest.mark.parametrize("method", ["shuffle", "routed_files"])
def test_baseline_follows_plan(ray_local, tmp_path, method):
    import ray

    n, budget, ranks = 20, 64, 2
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
    plan = make_plan(lengths, PackConfig(strategy="wrapped_noreset", budget=budget, seed=1), ranks)
    info = materialize(ds, plan, ids, str(tmp_path / "packed"), method=method)
    assert info["rows"] == plan.num_packs and info["method"] == method
    check_rows(str(tmp_path / "packed"), plan, ids, source)
