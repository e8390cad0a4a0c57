"""Stage 2: tokenize the raw examples with Ray Data, one tokenizer per actor, and count what happened.

    ds, stats = tokenize_dataset(cfg)     # ds: example_id, input_ids, labels, length
    print(stats.summary())

    raypack data --config jobs/configs/quickstart.yaml tokenize.overlength=split

Output contract (the planner and packer depend on it):

    example_id  int64         stable and unique (raypack.data.sources; split pieces add 0, 1, ...)
    input_ids   list<int32>
    labels      list<int32>   -100 where masked; not shifted (labels[i] is token i's own target)
    length      int32         len(input_ids), 1 <= length <= max_length

The encoding rules (templates, label masks, EOS, over-length policies) live in raypack.data.encode.
The dataset comes back materialized: counting needs every row anyway, and so does the planner.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import ray

from raypack.config import Config
from raypack.data.encode import Encoder, check_chat_template, load_tokenizer
from raypack.data.sources import read_sources_with_report

@dataclass
class TokenizeStats:
    examples_in: int = 0
    """Good source rows that went into tokenization."""
    examples_out: int = 0
    """Rows out (split pieces count one each; dropped examples none)."""
    tokens: int = 0
    label_tokens: int = 0
    """Tokens whose label is not -100."""
    bad_rows: int = 0
    """Source rows skipped under `data.on_bad_rows: skip`."""
    bad_examples: list[str] = field(default_factory=list)
    dropped: int = 0
    truncated: int = 0
    split: int = 0
    """Examples split; they became `pieces` rows."""
    pieces: int = 0
    max_length: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    """Every output row's length, in no particular order (what the planner needs)."""

    def summary(self) -> str:
        pct = np.percentile(self.lengths, [0, 50, 90, 99, 100]).astype(int) if len(self.lengths) else [0] * 5
        fmts = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        lines = [
            f"examples   {self.examples_in} in ({fmts}), {self.examples_out} out",
            f"tokens     {self.tokens}  ({self.label_tokens} with loss, {self.label_tokens / max(self.tokens, 1):.1%})",
            "length     min {} / p50 {} / p90 {} / p99 {} / max {}".format(*pct),
            f"over {self.max_length}  dropped {self.dropped}, truncated {self.truncated}, split {self.split} (into {self.pieces} rows)",
            f"bad rows   {self.bad_rows} skipped",
        ]
        lines += [f"           {msg}" for msg in self.bad_examples]
        return "\n".join(lines)


@ray.remote(num_cpus=0)
class _Counts:
    """Per-batch counts from the tokenizer actors, keyed so that a retried batch counts once."""

    def __init__(self):
        self.batches = {}

    def add(self, key, counts):
        self.batches[key] = counts

    def get(self):
        return list(self.batches.values())


def _send(counter, key, counts) -> None:
    ray.get(counter.add.remote(key, counts))


def tokenize_dataset(cfg: Config) -> tuple[ray.data.Dataset, TokenizeStats]:
    """Stages 1 and 2: read `cfg.data`, tokenize by `cfg.tokenize`; max_length defaults to `pack.budget`."""
    t = cfg.tokenize
    max_length = t.max_length or cfg.pack.budget
    src, report = read_sources_with_report(cfg.data)
    # Fail on the driver, with a config-level message, before any actor starts.
    tok = load_tokenizer(t.tokenizer, t.chat_template)
    if report.formats.get("chat"):
        check_chat_template(tok, t.tokenizer)
    # A single file reads into one block; smaller blocks let every tokenizer actor take a share.
    rows_per_block = max(t.batch_size, -(-report.rows // (4 * t.num_actors)))
    counter = _Counts.remote()
    # A single file reads into one block; smaller blocks let every tokenizer actor take a share.
    rows_per_block = max(t.batch_size, -(-report.rows // (4 * t.num_actors)))
    out = src.repartition(target_num_rows_per_block=rows_per_block).map_batches(
        Encoder,
        fn_constructor_kwargs=dict(
            tokenizer=t.tokenizer, chat_template=t.chat_template, label_mask=t.label_mask,
            overlength=t.overlength, max_length=max_length, report=functools.partial(_send, counter),
        ),
        batch_size=t.batch_size,
        batch_format="pyarrow",
        # The non-deprecated form of concurrency=N; fractional CPUs leave the read tasks room.
        compute=ray.data.ActorPoolStrategy(size=t.num_actors),
        num_cpus=t.num_cpus,
    ).materialize()
    batches = ray.get(counter.get.remote())
    ray.kill(counter)

    stats = TokenizeStats(
        examples_in=report.rows, bad_rows=report.bad_rows, bad_examples=report.bad_examples,
        formats=dict(report.formats), max_length=max_length,
    )
    for key in ("dropped", "truncated", "split", "pieces", "label_tokens"):
        setattr(stats, key, sum(b[key] for b in batches))
    stats.lengths = np.concatenate([b["lengths"] for b in batches]) if batches else np.zeros(0, np.int32)
    stats.examples_out, stats.tokens = len(stats.lengths), int(stats.lengths.sum())
    if stats.examples_out != out.count():  # cheap on a materialized dataset; guards the counting
        raise RuntimeError(f"tokenize counted {stats.examples_out} rows but produced {out.count()}")
    return out, stats


def run_cli(args) -> int:
    """`raypack data --config FILE [overrides]`: tokenize and print a summary."""
    from raypack.config import load

    cfg = load(args.config, args.overrides)
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()  # join the cluster the environment names
        else:
            # More logical CPUs than cores, so tokenizer actors never starve the read tasks.
            ray.init(address="local", num_cpus=max(4, (os.cpu_count() or 1) * 2))
    _, stats = tokenize_dataset(cfg)
    print(stats.summary())
    return 0
