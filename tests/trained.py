"""What a run trained on, read back from its checkpoints and independently of it: the checks
behind "every example exactly once" (a worker killed, a run stopped and resumed)."""

from __future__ import annotations

from pathlib import Path


def trained_ids(checkpoint_dir: Path) -> tuple[list[int], list[list[int]]]:
    """Example ids and optimizer steps the final model took, from every rank's step log."""
    from raypack.train.checkpoint import read_steps_log

    ids, steps = [], []
    for log in sorted(Path(checkpoint_dir).glob("steps_rank*.npz")):
        entries = read_steps_log(log)
        steps.append([step for step, _, _ in entries])
        ids += [i for _, _, example_ids in entries for i in example_ids]
    return ids, steps


def planned_train_ids(cfg) -> list[int]:
    """Every example the data pipeline kept for training, read back independently of the run."""
    from raypack.data.holdout import is_eval
    from raypack.data.listing import Sources
    from raypack.data.tokenize import lengths_and_ids, tokenize_dataset
    from raypack.runs import absolute_paths

    cfg = absolute_paths(cfg)
    ds, _ = tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    _, ids = lengths_and_ids(ds)
    return sorted(ids[~is_eval(ids, cfg.data.eval_fraction, cfg.pack.seed)].tolist())


def planned_label_tokens(cfg) -> int:
    """Label tokens the loss sees in every example kept for training (each example's first
    position never counts: collate masks it), read back independently of the run."""
    import numpy as np

    from raypack.data.listing import Sources
    from raypack.data.tokenize import tokenize_dataset
    from raypack.runs import absolute_paths

    cfg = absolute_paths(cfg)
    ds, _ = tokenize_dataset(cfg, Sources.of(cfg.data.paths))
    keep = set(planned_train_ids(cfg))
    total = 0
    for row in ds.select_columns(["example_id", "labels", "length"]).iter_rows():
        if row["example_id"] in keep:
            labels = row["labels"]
            total += int(row["length"]) - 1 if labels is None else int((np.asarray(labels)[1:] != -100).sum())
    return total
