"""Epoch orders and the epoch reader: every epoch reads every stored optimizer step exactly once,
epochs differ, the micro-steps of one optimizer step stay together, a resume reads exactly the
rest, and a layout the reader does not expect is an error, not a silent reorder."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from raypack.data.pack import empty_rows, write_rank
from raypack.data.shards import WINDOW_GROUPS, Prepared, epoch_order, group_steps_for, iter_epoch_packs


@pytest.mark.parametrize("steps,group", [(1, 1), (7, 3), (100, 8), (1000, 64), (64, 64)])
def test_epoch_order_is_a_seeded_permutation_new_every_epoch(steps, group):
    first = epoch_order(steps, group, seed=5, epoch=0)
    assert np.array_equal(first, np.arange(steps))  # epoch 1 trains the plan's own (shuffled) order
    orders = [epoch_order(steps, group, seed=5, epoch=e) for e in range(1, 4)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(steps))
    assert np.array_equal(orders[0], epoch_order(steps, group, seed=5, epoch=1))  # deterministic
    if steps >= 7:
        assert not np.array_equal(orders[0], first) and not np.array_equal(orders[0], orders[1])
        assert not np.array_equal(orders[0], epoch_order(steps, group, seed=6, epoch=1))


def test_epoch_order_keeps_few_row_groups_open_and_mixes_them():
    steps, group = 5000, 16
    order = epoch_order(steps, group, seed=0, epoch=2)
    g = order // group
    last = {k: i for i, k in enumerate(g.tolist())}
    first = {k: i for i, k in reversed(list(enumerate(g.tolist())))}
    open_at = np.zeros(len(order) + 1, dtype=np.int64)
    for k in first:
        open_at[first[k]] += 1
        open_at[last[k] + 1] -= 1
    assert np.cumsum(open_at).max() <= 2 * WINDOW_GROUPS + 2  # the reader's memory bound
    # steps of one row group do not come back in a block: neighbours differ from epoch to epoch
    same = np.mean(np.abs(np.diff(order)) == 1)
    assert same < 0.2
    assert abs(np.corrcoef(np.arange(steps), order)[0, 1]) < 0.1  # no trace of the stored order


def _write_shards(root, ranks: int, steps: int, accum: int, group: int) -> None:
    """Rows whose example_ids name (rank, stored step), written as the pack stage writes them."""
    for rank in range(ranks):
        rows = empty_rows(rank, np.arange(steps), ranks)
        ids = pa.array([[rank * 10_000 + s] for s in range(steps)], pa.list_(pa.int64()))
        rows = rows.set_column(rows.schema.get_field_index("example_ids"), "example_ids", ids)
        write_rank(rows, f"{root}/rank={rank}", rank, steps, ranks, group * accum)


def _prepared(root, steps: int, accum: int, group: int, **extra) -> Prepared:
    return Prepared(root=str(root), fingerprint="x", train_dir=str(root), eval_dir=None, steps_per_rank=steps,
                    padded=False, pad_token_id=0, vocab_size=10, length_mean=1.0, length_sq_mean=1.0, stats={},
                    grad_accum=accum, group_steps=group, order_seed=1, **extra)


def test_every_epoch_reads_each_step_once_with_accumulation_together(tmp_path):
    ranks, accum, group, steps = 2, 3, 4, 3 * 37
    _write_shards(tmp_path, ranks, steps, accum, group)
    data = _prepared(tmp_path, steps, accum, group)
    per_epoch = []
    for epoch in range(3):
        by_rank = [list(iter_epoch_packs(data, r, epoch)) for r in range(ranks)]
        for r, rows in enumerate(by_rank):
            assert sorted(row["step"] for row in rows) == list(range(steps))  # exactly once
            assert all(row["rank"] == r for row in rows)
            micro = [row["step"] for row in rows]
            for i in range(0, steps, accum):  # an optimizer step's micro-steps, together and in order
                assert micro[i] % accum == 0 and micro[i : i + accum] == list(range(micro[i], micro[i] + accum))
        # every rank trains the same stored step at every position (packs balanced together)
        assert [row["step"] for row in by_rank[0]] == [row["step"] for row in by_rank[1]]
        per_epoch.append([row["step"] for row in by_rank[0]])
    assert per_epoch[0] == list(range(steps))
    assert per_epoch[1] != per_epoch[0] and per_epoch[2] != per_epoch[1]


def test_resume_mid_epoch_reads_exactly_the_rest(tmp_path):
    accum, group, steps = 2, 3, 2 * 40
    _write_shards(tmp_path, 1, steps, accum, group)
    data = _prepared(tmp_path, steps, accum, group)
    full = [row["step"] for row in iter_epoch_packs(data, 0, epoch=2)]
    for start in (0, 2, 34, steps - 2, steps):
        rest = [row["step"] for row in iter_epoch_packs(data, 0, epoch=2, start_step=start)]
        assert rest == full[start:]


def test_repacked_epochs_read_their_own_rows_in_plan_order(tmp_path):
    _write_shards(tmp_path / "e0", 1, 6, 1, 2)
    _write_shards(tmp_path / "e1", 1, 4, 1, 2)
    epochs = [{"dir": str(tmp_path / "e0"), "steps_per_rank": 6, "stats": {"token_imbalance": 1.5}},
              {"dir": str(tmp_path / "e1"), "steps_per_rank": 4, "stats": {"token_imbalance": 1.25}}]
    data = _prepared(tmp_path / "e0", 6, 1, 2, epochs=epochs)
    assert [r["step"] for r in iter_epoch_packs(data, 0, 1)] == [0, 1, 2, 3]
    assert data.epoch_rows(1) == (str(tmp_path / "e1"), 4, False)
    assert data.report_stats(1) == {"token_imbalance": 1.25}


def test_unexpected_layout_or_missing_rows_are_errors(tmp_path):
    _write_shards(tmp_path, 1, 12, 1, 4)
    with pytest.raises(RuntimeError, match="row groups of"):  # written for 4-step groups, read as 3
        list(iter_epoch_packs(_prepared(tmp_path, 12, 1, 3), 0, 1))
    with pytest.raises(RuntimeError, match="is a shard missing"):
        list(iter_epoch_packs(_prepared(tmp_path, 20, 1, 4), 0, 1))
    with pytest.raises(RuntimeError, match="holds 0 row groups"):
        list(iter_epoch_packs(dataclasses.replace(_prepared(tmp_path, 12, 1, 4), train_dir=str(tmp_path / "none")), 0, 0))


def test_group_steps_aim_at_a_few_megabytes():
    assert group_steps_for(4096, 1) == 64 and group_steps_for(32768, 1) == 8 and group_steps_for(131072, 4) == 1
    assert group_steps_for(512, 2) == 64


def test_each_rank_reads_the_images_of_its_own_examples_only(tmp_path):
    """prepare.write_images keeps the vision rows' images by example_id beside the packed rows;
    rank_images gives a rank those of the examples its train and eval rows name, none else."""
    import pyarrow.parquet as pq

    from raypack.data.prepare import write_images
    from raypack.data.shards import rank_images

    images = [[b"a"], None, [b"c1", b"c2"], [b"d"]]  # example 1 is a text row
    grids = [[1, 2, 2], None, [1, 2, 2, 1, 4, 4], [1, 2, 2]]
    tokenized = tmp_path / "tokenized.parquet"
    pq.write_table(pa.table({"example_id": pa.array([0, 1024, 2048, 3072], pa.int64()),
                             "images": pa.array(images, pa.list_(pa.binary())),
                             "image_grid_thw": pa.array(grids, pa.list_(pa.int32()))}), tokenized)  # fmt: skip
    folder = write_images([(str(tokenized), 0)], str(tmp_path / "images"))
    named = {("train", 0): [[0, 1024]], ("train", 1): [[2048]], ("eval", 0): [[3072]], ("eval", 1): [[]]}
    for (split, rank), rows in named.items():
        (tmp_path / split / f"rank={rank}").mkdir(parents=True)
        pq.write_table(pa.table({"example_ids": pa.array(rows, pa.list_(pa.int64()))}),
                       tmp_path / split / f"rank={rank}" / "part-000000.parquet")  # fmt: skip
    data = dataclasses.replace(_prepared(tmp_path / "train", 1, 1, 1), eval_dir=str(tmp_path / "eval"),
                               images_dir=folder)  # fmt: skip
    assert rank_images(data, 0) == {0: ([b"a"], [1, 2, 2]), 3072: ([b"d"], [1, 2, 2])}
    assert rank_images(data, 1) == {2048: ([b"c1", b"c2"], [1, 2, 2, 1, 4, 4])}
    assert rank_images(dataclasses.replace(data, images_dir=None), 0) == {}
