"""Property tests for the packing plan: every strategy's plan fills the (step, rank) grid, places
every token once, handles the remainder, rebuilds identically, and folds accumulation."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from raypack.config import PackConfig
from raypack.data.plan import fold_accumulation
from raypack.data.strategies import STRATEGIES, get_strategy, make_plan
from raypack.data.synthetic import sample_lengths

from planning import PACKED, plan_for, problems


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(sorted(STRATEGIES)))
def test_plan_invariants(problem, name):
    lengths, budget, ranks, batch, seed = problem
    plan = plan_for(name, lengths, budget, ranks, batch, seed)
    # every (rank, step) cell holds exactly one pack, and every rank runs the same steps
    assert plan.num_packs == plan.num_steps * ranks
    assert (plan.pack == plan.step * ranks + plan.rank).all()
    assert ((0 <= plan.rank) & (plan.rank < ranks)).all() and ((0 <= plan.step) & (plan.step < plan.num_steps)).all()
    assert (np.diff(plan.pack) >= 0).all()  # ordered by pack
    assert plan.num_steps == -(-plan.num_packs // ranks)
    # every token of every example is placed exactly once
    pieces = sorted(zip(plan.example.tolist(), plan.start.tolist(), plan.end.tolist()))
    if name.startswith("wrapped"):
        covered = {}
        for e, s, t in pieces:
            assert s == covered.get(e, 0) and t > s
            covered[e] = t
        assert covered == {i: int(n) for i, n in enumerate(lengths)}
    else:
        assert pieces == [(i, 0, int(n)) for i, n in enumerate(lengths)]
    tokens = plan.pack_tokens()
    if name in PACKED:
        assert (tokens <= budget).all()
    else:
        assert (np.bincount(plan.pack, minlength=plan.num_packs) <= batch).all()
    # a pack is split or emptied only when the count does not divide: at most ranks - 1 extra packs
    base = get_strategy(name, budget=budget, batch_size=batch, seed=seed).pack(lengths).num_packs
    assert plan.num_packs - base == (-base) % ranks
    # the same inputs rebuild the same plan
    again = plan_for(name, lengths, budget, ranks, batch, seed)
    for field in ("example", "start", "end", "pack", "rank", "step"):
        assert np.array_equal(getattr(plan, field), getattr(again, field))


def test_remainder_three_examples_eight_ranks():
    plan = plan_for("bfd", np.array([5, 3, 2]), 16, 8, 8, 0)
    assert plan.num_steps == 1 and plan.num_packs == 8
    sizes = np.bincount(plan.pack, minlength=8)
    assert sorted(sizes.tolist()) == [0, 0, 0, 0, 0, 1, 1, 1]  # split down to one example, then empty


def test_remainder_splits_the_largest_pack():
    plan = plan_for("bfd", np.array([8, 8, 8, 4, 4]), 8, 2, 8, 0)  # bfd: [8] [8] [8] [4 4] -> 4 packs
    assert plan.num_packs == 4
    plan = plan_for("bfd", np.array([8, 8, 4, 4]), 8, 2, 8, 0)  # [8] [8] [4 4]: split [4 4]
    assert sorted(plan.pack_tokens().tolist()) == [4, 4, 8, 8]


def test_steps_are_shuffled_not_sorted_by_length():
    lengths = sample_lengths("flan", 20_000, seed=1, max_length=2048)
    for name in ("bfd", "balanced", "pad_sorted", "greedy"):
        plan = plan_for(name, lengths, 2048, 4, 8, 0)
        longest = np.zeros(plan.num_steps, dtype=np.int64)
        np.maximum.at(longest, plan.step, plan.end - plan.start)
        corr = np.corrcoef(np.arange(plan.num_steps), longest)[0, 1]
        assert abs(corr) < 0.1, name


def test_plan_to_table_columns(tmp_path):
    plan = plan_for("wrapped", np.array([5, 9, 2]), 4, 2, 8, 0)
    path = tmp_path / "plan.parquet"
    pq.write_table(plan.to_table(), path)  # what `raypack plan --out` writes
    table = pq.read_table(path)
    assert table.column_names == ["example_id", "pack", "rank", "step", "start", "end"]
    assert table.num_rows == len(plan.example)


def test_fold_accumulation_gives_each_rank_accum_microsteps_per_virtual_step():
    lengths = np.random.default_rng(0).integers(1, 64, 500)
    plan = fold_accumulation(make_plan(lengths, PackConfig(strategy="balanced", budget=64), 2 * 3), 2, 3)
    assert plan.num_ranks == 2 and plan.num_steps % 3 == 0
    cells = set(zip(plan.rank.tolist(), plan.step.tolist()))
    assert len(cells) == len(set(plan.pack.tolist()))  # still one pack per (rank, step)
    assert max(plan.step) < plan.num_steps and set(plan.rank.tolist()) <= {0, 1}


def test_widest_padded_is_the_pack_whose_pieces_padded_make_the_largest_batch():
    """What a hybrid's mixers run on the torch path (raypack/train/memory/estimate.py sizes it): over every
    pack, the most pieces x longest piece, read back from the plan's own table."""
    lengths = sample_lengths("flan", 500, seed=3, max_length=512)
    plan = make_plan(lengths, PackConfig(strategy="bfd", budget=512), 2)
    table = plan.to_table().to_pandas()
    table["n"] = table["end"] - table["start"]
    per_pack = table.groupby("pack")["n"].agg(["count", "max"])
    widest = (per_pack["count"] * per_pack["max"]).max()
    examples, longest = plan.widest_padded()
    assert examples * longest == widest and examples > 1 and longest <= 512
