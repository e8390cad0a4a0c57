"""Pack stage without Ray: routing and row assembly in process follow the plan exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raypack.config import PackConfig
from raypack.data.pack import finish_rank_tables, plan_routing, route_block
from raypack.data.strategies import make_plan

from packcheck import check_rows, example_table, make_examples


@pytest.mark.parametrize("strategy,ranks", [("wrapped", 2), ("wrapped_noreset", 3), ("balanced", 4), ("pad", 1)])
def test_rows_follow_plan(tmp_path, strategy, ranks):
    budget = 48
    source = make_examples(90, budget, seed=2)
    table, ids, lengths = example_table(source)
    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget, batch_size=4, seed=5), ranks)
    routing = plan_routing(plan, ids)
    parts = [route_block(block, routing, ranks) for block in (table.slice(0, 40), table.slice(40))]
    parts = [p if ranks > 1 else (p,) for p in parts]
    for r in range(ranks):
        finish_rank_tables(str(tmp_path / f"rank={r}"), r, plan.num_steps, ranks, plan.reset_positions,
                            *[p[r] for p in parts])
    check_rows(str(tmp_path), plan, ids, source)
