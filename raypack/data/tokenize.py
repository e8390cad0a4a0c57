"""Stage 2: tokenize the raw examples with Ray Data, one tokenizer per actor, and count what happened.

    ds, stats = tokenize_dataset(cfg, sources)   # ds: example_id, input_ids, labels, length
    print(stats.summary())                # what `raypack data` prints
    lengths, ids = ordered(stats.lengths, stats.ids)  # the planner's input, ordered by example_id

Output contract (the planner and packer depend on it):

    example_id  int64         stable and unique (raypack.data.sources; split pieces add 0, 1, ...)
    input_ids   list<int32>
    labels      list<int32>   -100 where masked; not shifted (labels[i] is token i's own target)
    length      int32         len(input_ids), 1 <= length <= max_length

The encoding rules (templates, label masks, EOS, over-length policies) live in raypack.data.encode.
Reading streams into tokenization (no pass over the read rows first): the tokenizer actors count
good and bad source rows as they go, and a bad row under `on_bad_rows: error` (or an unreadable
file) stops the pipeline, after which the driver re-reads the sources, in parallel and without
tokenizing, to name the first bad row in file order exactly as `read_sources_with_report` does. The rows
stream into Parquet files (prepare), or into the object store (tests, small tools): the planner
needs only the lengths and ids, which the actors report with their counts.

Data of up to `data.driver_max_mb` is tokenized in the driver's own process instead
(`tokenize_here`): the same reading, encoder, counts and rows, without the seconds that Ray Data's
read tasks and tokenizer actor take to start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypack import raycompat, storage
from raypack.config import Config
from raypack.data.encode import (Encoder, TokenizeError, check_chat_template, check_vision_label_mask, counts,
                                 kept_rows, load_image_tokenizer, load_tokenizer)
from raypack.data.listing import Sources, known_rows
from raypack.data.progress import Progress, on_driver_node
from raypack.data.sources import read_rows, read_sources_with_report, row_location, rows_here
from raypack.data.vision_pairs import KIND as PAIR_KIND, check_layout
from raypack.errors import SourceError


TOKENIZED_BATCH = 4096
"""Least rows per batch for `data.format: tokenized`."""
TOKENIZER_MEMORY = 2**30
"""Memory each tokenizer actor declares to Ray: torch, transformers and a tokenizer imported, plus a
few batches. Measured at 1M-10M pre-tokenized rows (benchmarks/results/prepare_scale_cpu_20261127.md):
up to 1.2 GiB RSS with shared pages, and no Ray process held more than 591 MiB of its own."""
TOKENIZED_FILE_BYTES = 32 * 2**20
"""Least bytes of tokenized rows (in memory) per Parquet file written for the pack stage."""


@dataclass
class TokenizeStats:
    examples_in: int = 0
    """Good source rows that went into tokenization."""
    examples_out: int = 0
    """Rows out (split pieces count one each; dropped examples none)."""
    tokens: int = 0
    label_tokens: int = 0
    """Tokens whose label the loss sees (not -100, and not an example's first token)."""
    source_label_tokens: int = 0
    """The same, in the examples as they came (before any were dropped, truncated or split)."""
    label_tokens_lost: dict[str, int] = field(default_factory=dict)
    """Label tokens lost, by cause: `over_length` (dropped), `truncated`, `split` (a piece's first token)."""
    bad_rows: int = 0
    """Source rows skipped under `data.on_bad_rows: skip`."""
    bad_examples: list[str] = field(default_factory=list)
    dropped: int = 0
    truncated: int = 0
    split: int = 0
    """Examples split; they became `pieces` rows."""
    pieces: int = 0
    no_labels: int = 0
    """Examples dropped because no token of theirs carries loss (see raypack.data.encode)."""
    no_label_pieces: int = 0
    """Split pieces dropped for the same reason, from examples whose other pieces train."""
    no_label_examples: list[str] = field(default_factory=list)
    """Where the first few of the `no_labels` examples are (file:line)."""
    empty_answers: int = 0
    """Chats that end with an empty assistant turn, whose end-of-turn markup trains as the answer."""
    empty_answer_examples: list[str] = field(default_factory=list)
    """Where the first few of them are (file:line)."""
    max_length: int = 0
    pad_token_id: int = 0
    """The tokenizer's pad id (its EOS where it has none): what padded batches and empty packs hold."""
    tokenizer_size: int = 0
    """len(tokenizer): a tiny model is built with this vocabulary."""
    formats: dict[str, int] = field(default_factory=dict)
    images: int = 0
    """Images in the rows out (vision rows: raypack/data/images.py)."""
    image_tokens: int = 0
    """Their tokens, counted in `tokens` and in each row's length (what the plan packs)."""
    vision_patches: int = 0
    """The vision tower's patches for them (its work, before the merge into image tokens)."""
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    """Every output row's length, in no particular order (what the planner needs)."""
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    """Every output row's example_id, in the order of `lengths`."""
    label_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    """Every output row's label tokens, in the order of `lengths`."""
    tower: np.ndarray | None = field(default=None, repr=False)
    """Image data only: every output row's vision-tower patches and Σ patches² (rows of 2, in the
    order of `lengths`; zeros for text rows), what the plan's balance counts (data/tower.py)."""

    def summary(self) -> str:
        pct = np.percentile(self.lengths, [0, 50, 90, 99, 100]).astype(int) if len(self.lengths) else [0] * 5
        fmts = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        lines = [
            f"examples   {self.examples_in} in ({fmts}), {self.examples_out} out",
            f"tokens     {self.tokens}  ({self.label_tokens} with loss, {self.label_tokens / max(self.tokens, 1):.1%})",
            "length     min {} / p50 {} / p90 {} / p99 {} / max {}".format(*pct),
            f"over {self.max_length}  dropped {self.dropped}, truncated {self.truncated}, split {self.split} (into {self.pieces} rows)",
            f"no labels  {self.no_labels} dropped (no token carries loss)"
            + (f", and {self.no_label_pieces} split pieces" if self.no_label_pieces else "")
            + (f"; first: {', '.join(self.no_label_examples[:3])}" if self.no_label_examples else ""),
            f"bad rows   {self.bad_rows} skipped",
            *([f"empty      {self.empty_answers} chats end with an empty assistant turn, whose end-of-turn markup "
               f"trains as the answer (tokenize.empty_answers=error refuses them); first: "
               f"{', '.join(self.empty_answer_examples[:3])}"] if self.empty_answers else []),
            *([f"images     {self.images} ({self.image_tokens} image tokens in the lengths, "
               f"{self.vision_patches} vision-tower patches)"] if self.images else []),
            f"lost       {self.losses()}",
        ]
        lines += [f"           {msg}" for msg in self.bad_examples]
        return "\n".join(lines)

    def losses(self) -> str:
        """What share of the examples and of their label tokens won't train, by cause."""
        rows = self.examples_in + self.bad_rows
        by_row = [(self.dropped, f"over {self.max_length} tokens"), (self.no_labels, "without a label token"),
                  (self.bad_rows, "bad rows")]
        by_token = [(n, cause.replace("_", "-")) for cause, n in sorted(self.label_tokens_lost.items())]
        if self.label_tokens and not self.source_label_tokens:  # a cache entry from before they were counted
            return f"{_shares(by_row, rows)} of the examples (label tokens lost: not counted when this was tokenized)"
        return (f"{_shares(by_row, rows)} of the examples and "
                f"{_shares(by_token, self.source_label_tokens)} of their label tokens")


@ray.remote(num_cpus=0)
class _Counts:
    """Per-batch counts from the tokenizer actors, keyed so that a retried batch counts once."""

    def __init__(self):
        self.batches = {}

    def add(self, key, counts):
        self.batches[key] = counts

    def get(self):
        return list(self.batches.values())

    def rows(self) -> int:
        """Source rows tokenized so far (a batch's key is its first id and its rows)."""
        return sum(rows for _, rows in self.batches)


def _shares(parts: list[tuple[int, str]], whole: int) -> str:
    """"12.0% (10.0% over 512 tokens, 2.0% bad rows)": the total share of `whole`, and each nonzero part's."""
    lost = sum(n for n, _ in parts)
    each = ", ".join(f"{n / whole:.1%} {what}" for n, what in parts if n) if whole else ""
    return f"{lost / max(whole, 1):.1%}" + (f" ({each})" if each else "")


def _send(counter, key, counts) -> None:
    ray.get(counter.add.remote(key, counts))


def _read_so_far(counter, files) -> tuple[str, int, int | None]:
    """The tokenize stage's progress (raypack/data/progress.py): source rows tokenized, of how
    many where known."""
    return "examples read", ray.get(counter.rows.remote(), timeout=30), known_rows(files)


class _SourceEncoder(Encoder):
    """The Encoder fed straight from stage 1's rows, flagged bad ones included (see module doc)."""

    def __init__(self, on_bad_rows: str, **kwargs):
        super().__init__(**kwargs)
        self.on_bad_rows = on_bad_rows

    def __call__(self, batch: pa.Table) -> pa.Table:
        bad = pc.is_valid(batch["error"])
        if pc.any(bad).as_py() and (self.on_bad_rows == "error" or pc.any(batch["fatal"]).as_py()):
            raise SourceError("bad source rows")  # the driver re-reads to say which (module doc)
        rows, c = encode_source_batch(self, batch)
        # Keyed by the batch's first id, so a retried batch is counted once.
        if batch.num_rows:
            self.report((batch["example_id"][0].as_py(), batch.num_rows), c)
        return rows


def encode_source_batch(encoder: Encoder, batch: pa.Table) -> tuple[pa.Table, dict]:
    """Stage 1's rows (bad ones flagged, skipped here) -> (the rows that train, the batch's counts)."""
    bad = pc.is_valid(batch["error"])
    good = batch.filter(pc.invert(bad)).drop_columns(["error", "fatal"])
    table = encoder.encode_table(good)
    c = counts(table)
    empty = sorted(getattr(encoder, "empty_answers", []))  # set by the encode above (chat rows)
    c["empty_answers"], c["empty_answer_examples"] = len(empty), empty[:5]
    c["formats"] = {v["values"]: v["counts"] for v in pc.value_counts(good["format"]).to_pylist()}
    b = batch.filter(bad)
    c["bad_rows"] = b.num_rows
    c["bad_examples"] = sorted(zip(b["example_id"].to_pylist(), b["error"].to_pylist()))[:5]
    return kept_rows(table), c


def tokenize_dataset(cfg: Config, sources: Sources, vocab_size: int | None = None,
                     out_dir: str | None = None) -> tuple[ray.data.Dataset | None, TokenizeStats]:
    """Stages 1 and 2: read `sources` (the listing of `cfg.data.paths`), tokenize by
    `cfg.tokenize`, keep examples of up to `cfg.max_length` tokens whole. `vocab_size` (the
    model's), when given, bounds the ids of pre-tokenized rows.

    Where the rows go: with `out_dir`, streamed into Parquet files there (what prepare packs
    from: they never all sit in the object store) and returned as a lazy dataset over them;
    `out_dir=""` keeps none (counts only, bounded memory: `raypack plan`); without, the dataset
    comes back materialized in the object store."""
    t = cfg.tokenize
    max_length = cfg.max_length
    # Fail on the driver, with a config-level message, before any actor starts.
    tok = load_tokenizer(t.tokenizer, t.chat_template)
    src = read_rows(cfg.data, sources, vocab_size)
    # Declared pre-tokenized data runs no tokenizer: small batches would only add per-batch cost
    # (at 1M rows, 4,000 batches of 256).
    batch_size = max(t.batch_size, TOKENIZED_BATCH) if cfg.data.format == "tokenized" else t.batch_size
    counter = on_driver_node(_Counts).remote()
    try:
        # Blocks of a few batches let every actor take a share of a large read unit, and the
        # streaming repartition keeps reading and tokenizing overlapped.
        with Progress("tokenize", functools.partial(_read_so_far, counter, sources.files)):
            pipeline = src.repartition(target_num_rows_per_block=4 * batch_size).map_batches(
                _SourceEncoder,
                fn_constructor_kwargs=dict(
                    on_bad_rows=cfg.data.on_bad_rows, tokenizer=t.tokenizer, chat_template=t.chat_template,
                    label_mask=t.label_mask, overlength=t.overlength, max_length=max_length,
                    report=functools.partial(_send, counter),
                ),
                batch_size=batch_size,
                batch_format="pyarrow",
                # The non-deprecated form of concurrency=N; fractional CPUs leave the read tasks room.
                compute=ray.data.ActorPoolStrategy(size=t.num_actors),
                num_cpus=t.num_cpus,
                memory=TOKENIZER_MEMORY,
            )
            if out_dir:
                # Files of a few tens of MB: each is one routing task's read (pack.route_file).
                # Uncompressed: written once and read once, on this cluster's own storage, and
                # snappy's CPU (2.5x the write and read here) buys ~3% of the bytes on token ids,
                # which Parquet's dictionary encoding already packs.
                # A row's bytes at most, for a Ray without min_bytes_per_file: two int32 token
                # columns of max_length, its id and length (a vision row's images not counted).
                size = raycompat.parquet_min_file(TOKENIZED_FILE_BYTES, 8 * max_length + 16)
                pipeline.write_parquet(out_dir, **size, compression="none")
                out = ray.data.read_parquet(out_dir) if storage.exists(out_dir) else None  # none: no row kept
            elif out_dir is not None:
                for _ in pipeline.iter_internal_ref_bundles():
                    pass
                out = None
            else:
                out = pipeline.materialize()
        batches = ray.get(counter.get.remote())
    except Exception:
        # A bad row or chat data without a template stopped the pipeline inside an actor, where
        # Ray wraps the error. Raise ours instead, in the order the checks used to run.
        _, report = read_sources_with_report(cfg.data, sources, vocab_size)
        check_encodable(cfg, tok, report.formats)
        raise
    finally:
        ray.kill(counter)
    stats = gather_stats(batches, tok, max_length, sources)
    if out is not None and stats.examples_out != out.count():  # cheap: the block or file metadata
        raise RuntimeError(f"tokenize counted {stats.examples_out} rows but produced {out.count()}")
    return out, stats


def on_driver(cfg: Config, nbytes: int | None) -> bool:
    """Whether data of `nbytes` (None: not known) is small enough to tokenize or pack in the
    driver's own process (`data.driver_max_mb`)."""
    return nbytes is not None and nbytes <= cfg.data.driver_max_mb * 2**20


def tokenize_here(cfg: Config, sources: Sources, out_dir: str, vocab_size: int | None = None) -> TokenizeStats:
    """`tokenize_dataset(cfg, sources, vocab_size, out_dir)` for data small enough to tokenize
    in this process (`on_driver`): the same reading (`rows_here`), the same encoder and
    counts, the same rows written (one Parquet file, none for `out_dir=""`), without the seconds
    that Ray Data's read tasks and tokenizer actors take to start."""
    t = cfg.tokenize
    tok = load_tokenizer(t.tokenizer, t.chat_template)
    tables = rows_here(cfg.data, sources, vocab_size)  # raises on bad rows as the Ray read does
    formats = {}
    for table in tables:
        good = table.filter(pc.is_null(table["error"]))
        for v in pc.value_counts(good["format"]).to_pylist():
            formats[v["values"]] = formats.get(v["values"], 0) + v["counts"]
    check_encodable(cfg, tok, formats)
    encoder = Encoder(t.tokenizer, t.chat_template, t.label_mask, t.overlength, cfg.max_length)
    batch_size = max(t.batch_size, TOKENIZED_BATCH) if cfg.data.format == "tokenized" else t.batch_size
    batches, kept = [], []
    with Progress("tokenize", lambda: ("examples read", sum(b["bad_rows"] + sum(b["formats"].values()) for b in batches),
                                       known_rows(sources.files))):
        for table in tables:
            for start in range(0, table.num_rows, batch_size):
                rows, c = encode_source_batch(encoder, table.slice(start, batch_size))
                batches.append(c)
                kept.append(rows)
    stats = gather_stats(batches, encoder.tok, cfg.max_length, sources)
    if out_dir and stats.examples_out:  # as Ray's write: no file where no row is kept
        fs, path = storage.resolve(out_dir)
        fs.create_dir(path, recursive=True)
        pq.write_table(pa.concat_tables(kept), f"{path}/part-000000.parquet", filesystem=fs, compression="none")
    return stats


def check_encodable(cfg: Config, tok, formats: dict[str, int]) -> None:
    """What the encoder would fail on for rows of `formats`, as a config-level error: chat rows
    without a chat template; vision rows (chats and preference pairs with images) with a label
    mask, or an image processor, raypack has no data path for."""
    t = cfg.tokenize
    images = formats.get("vision", 0) + formats.get(PAIR_KIND, 0)
    if formats.get("chat") or images:
        check_chat_template(tok, t.tokenizer)
    if images:  # no image processor there, or one raypack has no data path for
        if formats.get("vision"):  # pairs train on their completions (train.objective: dpo checks the mask)
            check_vision_label_mask(t.label_mask)
        images_tok = load_image_tokenizer(t.tokenizer, tok)
        if formats.get(PAIR_KIND):
            check_layout(images_tok)


def gather_stats(batches: list[dict], tok, max_length: int, sources: Sources) -> TokenizeStats:
    """The whole run's TokenizeStats from each batch's counts (`encode_source_batch`)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stats = TokenizeStats(max_length=max_length, pad_token_id=int(pad), tokenizer_size=len(tok))
    for key in ("dropped", "truncated", "split", "pieces", "no_labels", "no_label_pieces", "label_tokens", "bad_rows",
                "source_label_tokens", "images", "image_tokens", "vision_patches"):
        setattr(stats, key, sum(b[key] for b in batches))
    for b in batches:
        for cause, n in b["label_tokens_lost"].items():
            stats.label_tokens_lost[cause] = stats.label_tokens_lost.get(cause, 0) + n
    stats.no_label_examples = [row_location(e, sources.files) for e in sorted(e for b in batches for e in b["no_label_examples"])[:5]]
    stats.empty_answers = sum(b.get("empty_answers", 0) for b in batches)
    stats.empty_answer_examples = [row_location(e, sources.files)
                                   for e in sorted(e for b in batches for e in b.get("empty_answer_examples", []))[:5]]
    for b in batches:
        for fmt, n in b["formats"].items():
            stats.formats[fmt] = stats.formats.get(fmt, 0) + n
    stats.examples_in = sum(stats.formats.values())
    stats.bad_examples = [msg for _, msg in sorted(e for b in batches for e in b["bad_examples"])[:5]]
    stats.lengths = np.concatenate([b["lengths"] for b in batches]) if batches else np.zeros(0, np.int32)
    stats.ids = np.concatenate([b["ids"] for b in batches]) if batches else np.zeros(0, np.int64)
    stats.label_counts = np.concatenate([b["label_counts"] for b in batches]) if batches else np.zeros(0, np.int32)
    if any("tower" in b for b in batches):
        stats.tower = np.concatenate([b.get("tower", np.zeros((len(b["lengths"]), 2))) for b in batches])
    stats.examples_out, stats.tokens = len(stats.lengths), int(stats.lengths.sum())
    return stats


def require_supervised(stats: TokenizeStats, cfg: Config) -> None:
    """Refuse data that would train on nothing: no example left with a label token (a loss
    divided by zero label tokens would read 0.0 and the run would look fine); under
    tokenize.no_labels=error, any example without one; and data that lost more than
    `data.max_dropped_fraction` of its rows, or of its label tokens to dropped examples, naming
    the cause and the setting behind it. Truncation that cut more than that is a warning."""
    if stats.no_labels and cfg.tokenize.no_labels == "error":
        raise TokenizeError(
            f"{stats.no_label_examples[0]}: no token carries loss (a chat without an assistant turn, or a prompt "
            f"truncated before its answer); {stats.no_labels} such examples. tokenize.no_labels=drop drops them"
        )
    if stats.empty_answers and cfg.tokenize.empty_answers == "error":
        raise TokenizeError(
            f"{stats.empty_answer_examples[0]}: the chat ends with an empty assistant turn, whose end-of-turn markup "
            f"would train as the answer; {stats.empty_answers} such examples. Remove those turns, or "
            "tokenize.empty_answers=train trains them"
        )
    causes = drop_causes(stats, cfg)
    if stats.label_tokens == 0:
        raise TokenizeError(
            f"{cfg.data.setting}: nothing to train on: of {stats.examples_in} examples, "
            + ("; ".join(text for _, text in causes) or "none are left")
        )
    rows = stats.examples_in + stats.bad_rows
    lost = sum(n for n, _ in causes)
    limit = cfg.data.max_dropped_fraction
    if rows and lost / rows > limit:
        n, text = max(causes)
        raise TokenizeError(
            f"{cfg.data.setting}: {lost} of {rows} source rows ({lost / rows:.0%}) would not train, more than "
            f"data.max_dropped_fraction={limit:g}; the largest cause: {n} {text.split(' ', 1)[1]}. Change that "
            "setting, fix the data, or raise data.max_dropped_fraction to train on the rest"
        )
    # Label tokens: those of dropped examples count against the limit like the examples do (the
    # longest examples can hold most of them); those that truncation or splitting cut, under a
    # policy the config chose, are said loudly but not refused.
    tokens, lost = stats.source_label_tokens, stats.label_tokens_lost
    cut = f"{stats.max_length} tokens (tokenize.max_length, else pack.budget)"
    if tokens and lost.get("over_length", 0) / tokens > limit:
        n = lost["over_length"]
        raise TokenizeError(
            f"{cfg.data.setting}: {n} of {tokens} label tokens ({n / tokens:.0%}) are in examples longer than {cut}, which "
            f"tokenize.overlength=drop dropped: more than data.max_dropped_fraction={limit:g}. Raise that length, use "
            "tokenize.overlength=truncate or split, or raise data.max_dropped_fraction to train on the rest"
        )
    for cause, what in (("truncated", "tokenize.overlength=truncate cut off"), ("split", "tokenize.overlength=split left")):
        if tokens and lost.get(cause, 0) / tokens > limit:
            print(f"[raypack] warning: {what} {lost[cause] / tokens:.0%} of the label tokens at {cut}"
                  + (" (each piece's first token)" if cause == "split" else "")
                  + "; a longer limit keeps them", flush=True)


def drop_causes(stats: TokenizeStats, cfg: Config) -> list[tuple[int, str]]:
    """(count, what happened and which setting did it) for each way tokenize dropped examples."""
    causes = []
    if stats.no_labels:
        first = f" (first: {stats.no_label_examples[0]})" if stats.no_label_examples else ""
        causes.append((stats.no_labels, f"{stats.no_labels} had no token that carries loss{first}: chats without an "
                       f"assistant turn under tokenize.label_mask={cfg.tokenize.label_mask}, or prompts that "
                       f"tokenize.overlength=truncate cut at {stats.max_length} tokens (tokenize.max_length, else "
                       "pack.budget) before the answer"))
    if stats.dropped:
        causes.append((stats.dropped, f"{stats.dropped} were longer than {stats.max_length} tokens "
                       "(tokenize.overlength=drop at tokenize.max_length, else pack.budget)"))
    if stats.bad_rows:
        causes.append((stats.bad_rows, f"{stats.bad_rows} bad rows were skipped (data.on_bad_rows=skip: the data itself)"))
    return causes


def lengths_and_ids(ds) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, example_ids) of a tokenized dataset, both ordered by example_id: one pass over
    the dataset (a cached one); `ordered(stats.lengths, stats.ids)` gives the same without it."""
    ids, lengths = [], []
    for batch in ds.select_columns(["example_id", "length"]).iter_batches(batch_size=65536, batch_format="numpy"):
        ids.append(np.asarray(batch["example_id"], dtype=np.int64))
        lengths.append(np.asarray(batch["length"], dtype=np.int64))
    return ordered(np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
                   np.concatenate(ids) if ids else np.zeros(0, np.int64))


def ordered(lengths: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, example_ids) as int64, ordered by example_id; refuses a repeated id."""
    ids_arr, len_arr = np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    order = np.argsort(ids_arr, kind="stable")
    ids_arr, len_arr = ids_arr[order], len_arr[order]
    if len(ids_arr) > 1 and (np.diff(ids_arr) == 0).any():
        raise ValueError("example_id is not unique in the tokenized dataset")
    return len_arr, ids_arr
