"""The packed data as the workers see it: the record the driver hands them, and their rows.

    data = Prepared.from_dict(config["data"])                    # from train_loop_config
    for row in iter_rank_packs(data.train_dir, rank, start_step=state.micro_step):
        ...                                                      # one packed row per plan step

The driver writes both (raypack/data/prepare.py, raypack/data/pack.py): Parquet under
`<dir>/rank=<r>/`, files named in step order, one row per (rank, step). Each worker reads exactly
its own rank's rows, in plan order, so every rank runs the same number of steps. This module
starts no Ray work and tokenizes nothing, so a worker imports none of the driver's pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypack import storage


@dataclass(frozen=True)
class Prepared:
    """What the workers need to know about the packed data; travels in `train_loop_config`."""

    root: str
    fingerprint: str
    """Hash of everything that shaped the packs; checkpoints record it (see loop.restore)."""
    train_dir: str
    eval_dir: str | None
    steps_per_rank: int
    """Micro-steps (packs) per rank per epoch; a multiple of train.grad_accum."""
    padded: bool
    """The plan's `Plan.padded` (its strategy's `padded`): rows are collated into padded batches
    and the model attends with its own SDPA instead of a varlen attention."""
    pad_token_id: int
    vocab_size: int
    length_mean: float
    length_sq_mean: float
    """Mean and mean square of the trained examples' lengths: their attention cost, for MFU."""
    stats: dict[str, Any]
    """Tokenize counts and plan statistics (efficiency, padding, imbalance) for reports and logs."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Prepared:
        return cls(**raw)

    def total_steps(self, grad_accum: int, epochs: int, max_steps: int | None) -> int:
        """Optimizer steps a run over this data takes: every epoch's, or `max_steps` if fewer."""
        total = self.steps_per_rank // grad_accum * epochs
        return min(total, max_steps) if max_steps else total

    def report_stats(self) -> dict[str, float]:
        keys = ("packing_efficiency", "padding_fraction", "token_imbalance", "attention_imbalance")
        return {k: float(self.stats[k]) for k in keys if k in self.stats}


def iter_rank_packs(out_dir: str, rank: int, start_step: int = 0, batch_rows: int = 16) -> Iterator[dict[str, Any]]:
    """The packed rows of `rank` in step order, from `start_step` on (resume skips the rest).

    Streams `batch_rows` rows at a time: a whole file of long packs as Python lists would cost
    gigabytes per rank."""
    folder = f"{out_dir.rstrip('/')}/rank={rank}"
    fs, _ = storage.resolve(folder)
    for f in storage.list_files(folder, ".parquet"):
        with fs.open_input_file(f) as handle:
            parquet = pq.ParquetFile(handle)
            last_step = parquet.metadata.row_group(parquet.metadata.num_row_groups - 1)
            steps_stats = last_step.column(parquet.schema_arrow.get_field_index("step")).statistics
            if steps_stats is not None and steps_stats.has_min_max and steps_stats.max < start_step:
                continue  # the whole file lies before the resume point
            for batch in parquet.iter_batches(batch_size=batch_rows):
                steps = batch.column("step").to_numpy()
                if len(steps) and steps[-1] < start_step:
                    continue
                if "rank" not in batch.schema.names:
                    batch = batch.append_column("rank", pa.array(np.full(batch.num_rows, rank), pa.int32()))
                yield from batch.filter(pa.array(steps >= start_step)).to_pylist()
