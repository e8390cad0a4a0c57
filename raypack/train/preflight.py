"""Everything about a run's input that can be checked without Ray, checked before Ray starts.

    checked = preflight(cfg)            # an InputError (ConfigError, SourceError, ...) or a record
    checked.cfg, checked.sources        # the config with absolute paths; data.paths listed once

A bad input then fails in seconds, on one line naming the field, the file or the row, before a
Ray instance starts or a file is written. In order, cheapest first:

1. `pack.strategy` (and `tune.strategies`) name registered strategies with the traits the
   config's options need (`strategies.check_strategies`);
2. every path in `data.paths` (or in each of `data.sources`, whose messages name the source)
   exists or its URI answers, is a known file type (a folder holds some), and each file's format
   is told from its first record (read by its source's `format` and `columns`). The listing is
   made here, once (`listing.Sources`), and every later stage of the command is handed it;
3. `tokenize.tokenizer` loads, with a chat template if a file holds chats;
4. `model.name` resolves to a config (a tiny family, a local folder or the hub; no weights are
   loaded) of a causal LM that, if the strategy packs, trains exactly on packed rows with the
   configured attention on the workers' device (a meta-device build: `check_packed_model`), and
   every id the tokenizer makes is below its vocabulary size; Liger-Kernel, where it is asked
   for, can run (`check_kernels`); with `model.peft`, its adapters apply to the model and the
   loss can train them (`check_adapters`); a local folder's weights are there, whole, of the
   config's shapes and in a range model.dtype holds (`check_weights`: the safetensors headers);
5. small local data (up to `ROW_CHECK_BYTES`): every row, as the Ray read would check it,
   pre-tokenized ids against the model's vocabulary included; larger data is checked row by row
   while Ray reads it, with the same messages. A weighted mixture whose weights give a source
   less than one example of those rows is refused here too (data/mixture.py);
6. a run that already packed its data: its sources have not changed since (`prepare.reusable`).

The most common mistakes (a config value, a path) are checked first, before the imports that
take seconds (transformers and torch for 3 and 4, Ray Data for 6).
What needs the tokenized data (examples without a label token, a rank without one) is checked
after tokenizing, still before training (raypack/data/prepare.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypack import storage
from raypack.config import Config
from raypack.data.formats import FormatError, detect, renamed, renames
from raypack.data.listing import Sources, source_bytes
from raypack.data.mixture import Mixture
from raypack.data.shards import Prepared
from raypack.data.sources import check_rows_here
from raypack.data.strategies import STRATEGIES, check_strategies
from raypack.errors import ConfigError, SourceError
from raypack.runs import absolute_paths, run_dir

ROW_CHECK_BYTES = 16 << 20
"""Local data up to this size has every row checked on the driver before Ray starts (1.3 s for
16 MiB of chats, 14,400 rows, on the 2-core dev machine); larger or remote data is checked as
Ray reads it, in parallel."""


@dataclass(frozen=True)
class Checked:
    """What preflight found, for the run it checked."""

    cfg: Config
    """The config with local paths made absolute (what the workers get)."""
    sources: Sources
    """The listing of `data.paths` and its fingerprint, made once: every stage after uses it."""
    formats: dict[str, str]
    """Format of every source file."""
    vocab_size: int | None = None
    """The model's vocabulary size: every token id must be below it (None: no model checked)."""
    prepared: Prepared | None = None
    """The run's packed data, if it was already made from this config and these sources."""
    vision_model: bool = False
    """model.name is a vision-language model (image rows train with their pictures)."""
    tower: Any = None
    """Its vision tower's cost (a data.tower.TowerCost), which the plan's balance weighs patches by."""


def preflight(cfg: Config, *, reprepare: bool = False) -> Checked:
    """Check `cfg` and its inputs without Ray; raises an InputError naming what is wrong."""
    checked = check_data(cfg, rows=False)
    cfg, formats = checked.cfg, checked.formats
    # Rows of text formats need no vocabulary bound: check them before the slow imports.
    bound = any(f in ("tokenized", "auto") for f in formats.values())
    if not bound:
        _check_rows(checked, None)
    vocab, vision_model, tower = check_model_and_tokenizer(cfg, _tokenizer(cfg, checked.sources, formats))
    if bound:
        _check_rows(checked, vocab)
    from raypack.data.cache import packed_root, reusable  # Ray Data: imported once the cheap checks passed

    n = cfg.train.data_parallel
    prepared = reusable(cfg, n, packed_root(cfg, n, run_dir(cfg)), checked.sources, reprepare, tower)
    return Checked(cfg=cfg, sources=checked.sources, formats=formats, vocab_size=vocab, prepared=prepared,
                   vision_model=vision_model, tower=tower)


def check_data(cfg: Config, *, rows: bool = True) -> Checked:
    """Steps 1, 2, 3 and 5 alone, what `raypack data` and `raypack plan` need (no model, so no
    vocabulary bound on token ids)."""
    check_strategies(cfg)
    cfg = absolute_paths(cfg)
    sources = Sources.of_data(cfg.data)
    checked = Checked(cfg=cfg, sources=sources, formats=source_formats(cfg, sources))
    check_objective_formats(cfg, checked.formats)
    if rows:
        _tokenizer(cfg, checked.sources, checked.formats)
        _check_rows(checked, None)
    return checked


def check_objective_formats(cfg: Config, formats: dict[str, str]) -> None:
    """Preference files train with train.objective: dpo, and dpo trains on preference files only."""
    dpo = cfg.train.objective == "dpo"
    wrong = next((p for p, f in formats.items() if (f == "preference") != dpo), None)
    if wrong is not None and dpo:
        raise SourceError(f"{wrong}: holds {formats[wrong]} data, but train.objective: dpo trains on preference "
                          "rows (prompt, chosen, rejected)")
    if wrong is not None:
        raise SourceError(f"{wrong}: holds preference rows (prompt, chosen, rejected), which train with "
                          "train.objective: dpo")


def _tokenizer(cfg: Config, sources: Sources, formats: dict[str, str]):
    from raypack.data.encode import check_chat_template, load_tokenizer  # transformers: seconds

    tok = load_tokenizer(cfg.tokenize.tokenizer, cfg.tokenize.chat_template)
    kinds = dict(sources.files)
    # Conversational preference pairs (chosen and rejected as messages) are chat too: without
    # this, the missing template would fail a Ray Data task instead.
    if any(f in ("chat", "sharegpt") or (f == "preference" and (_first_record(p, kinds[p]) or {}).get("chosen")) for p, f in
           formats.items()):
        check_chat_template(tok, cfg.tokenize.tokenizer)
    return tok


def _check_rows(checked: Checked, vocab_size: int | None) -> None:
    local = all(not storage.is_uri(p) for p in checked.formats)
    if local and (source_bytes(checked.sources) or 0) <= ROW_CHECK_BYTES:
        good = check_rows_here(checked.cfg.data, checked.sources, vocab_size)
        mixture = Mixture.of(checked.cfg.data, checked.sources)
        if mixture is not None and mixture.weights is not None:
            # The most rows each source can give: a weight whose share of those is under one
            # example is under one in the draw, which sees fewer (data/mixture.py, Mixture.counts).
            mixture.counts(np.bincount(checked.sources.owners, weights=good, minlength=len(mixture.names)), most=True)


def check_model_and_tokenizer(cfg: Config, tok) -> tuple[int, bool, Any]:
    """The model's vocabulary size, once its config resolves and the tokenizer fits it, whether it
    trains as a vision-language model (images: `vision.trains_as_vlm`), and then its vision
    tower's cost (memory.tower_cost, for the plan's balance; None otherwise). The checks read one
    description of the config (raypack/model/facts.py), whose meta model those that only read it
    share; the adapters' and the tiled MLPs' checks change theirs, so build their own."""
    from raypack.data.encode import TokenizeError
    from raypack.model.build import model_config, model_vocab_size  # torch: seconds
    from raypack.model.facts import describe
    from raypack.train.memory.estimate import tower_cost
    from raypack.train.preflight_setup import check_qlora, check_setup
    from raypack.train.objectives.router_loss import check_router_setting

    m = cfg.model
    # A tiny model is built with the tokenizer's vocabulary (see raypack.data.prepare), so it fits.
    config = model_config(m.name, m.trust_remote_code, vocab_size=len(tok))
    check_packed_model(cfg, config)
    check_kernels(cfg, config)
    check_qlora(cfg, config)
    adapted = check_adapters(cfg, config)
    check_freeze(cfg, config)
    check_router_setting(cfg.train, config, m.name)
    check_setup(cfg, config, adapted)  # what the workers' setup refuses without a forward
    check_vlm_processor(cfg, config, tok)
    vocab = model_vocab_size(config)
    if len(tok) > vocab:
        raise TokenizeError(
            f"tokenize.tokenizer {cfg.tokenize.tokenizer!r} has {len(tok)} tokens but model.name {m.name!r} "
            f"embeds {vocab}: ids {vocab} and up would index past the embedding; use the model's own tokenizer"
        )
    check_weights(cfg, config)
    return vocab, describe(config, m.trust_remote_code).vlm, tower_cost(config, m.trust_remote_code)


def check_weights(cfg: Config, config) -> None:
    """A local folder's weights: present, whole, of the config's shapes and in a range model.dtype
    holds, read from the safetensors headers alone (raypack/model/folder.py). Last of the model's
    checks: a config-only folder still gets the refusals that say what raypack can't train."""
    import torch

    from raypack.model.facts import describe
    from raypack.model.folder import check_folder

    m = cfg.model
    if not os.path.isdir(m.name):  # tiny-<family>, a hub name
        return
    dtype = m.dtype if m.dtype != "auto" else ("bfloat16" if cfg.train.use_gpu else "float32")
    check_folder(m.name, config, getattr(torch, dtype), describe(config, m.trust_remote_code).meta_model())


def check_vlm_processor(cfg: Config, config, tok) -> None:
    """A VLM's processor folder (tokenize.tokenizer) gives images its model takes: grids, whole
    pictures or tiles, and its image token; refused here rather than on the workers. A folder without an
    image processor, or with one raypack has no data path for, passes: text rows train, and image
    rows are refused when they are tokenized, naming the trait."""
    from raypack.data.encode import load_image_tokenizer
    from raypack.errors import InputError
    from raypack.model.facts import describe
    from raypack.model.vision import vlm_model_class
    from raypack.train.vision_rows import check_processor_fits

    if not describe(config, cfg.model.trust_remote_code).vlm:
        return
    try:
        images = load_image_tokenizer(cfg.tokenize.tokenizer, tok)
    except InputError:
        return
    check_processor_fits(vlm_model_class(config), config, images.layout.inputs, images.pad_id, cfg.tokenize.tokenizer)


def check_packed_model(cfg: Config, config=None) -> None:
    """Refuse a model that is not a causal LM, or, for a packed strategy, one that can't train
    exactly on this run's packed rows (raypack.model.traits): a token mixer besides attention
    (whatever `model.attention`, `sdpa` included: a convolution mixes a packed row's examples
    under any attention), or a trait the backend the workers will run lacks. Padded strategies
    load the model with its own attention, so every causal LM passes there. Builds the model on
    the meta device (no weights). `config`: the model's config if already loaded."""
    from raypack.model.build import check_model  # torch: seconds

    m = cfg.model
    strategy = STRATEGIES[cfg.pack.strategy]
    # flatten's rows are minibatches, unbounded by the budget (the attention function checks
    # those rows as they come)
    max_row = cfg.pack.budget if strategy.bounded_rows else None
    check_model(config if config is not None else m.name, attention=m.attention,
                device_type="cuda" if cfg.train.use_gpu else "cpu", trust_remote_code=m.trust_remote_code,
                max_row_tokens=max_row, name=m.name, packed=not strategy.padded,
                split=cfg.train.sequence_parallel, compiled=cfg.train.compile)  # fmt: skip


def check_kernels(cfg: Config, config) -> None:
    """model.kernels: liger and train.loss: liger where Liger-Kernel can't run (no CUDA, no
    package, a family it has no kernels for, a structure it is not verified on), and selective
    checkpointing beside Liger's kernels uncompiled, are refused here, before Ray starts."""
    from raypack.model.facts import describe
    from raypack.model.kernels import check_selective_with, liger_loss_available, resolve_kernels

    device = "cuda" if cfg.train.use_gpu else "cpu"
    facts = describe(config, cfg.model.trust_remote_code)
    kernels = resolve_kernels(cfg.model.kernels, facts.model_type, device, compiled=cfg.train.compile)
    if kernels == "liger":
        resolve_kernels(cfg.model.kernels, facts.model_type, device, facts.meta_model(), cfg.train.compile)
    check_selective_with(kernels, cfg.train.compile, cfg.model.gradient_checkpointing)
    if cfg.train.loss == "liger":
        liger_loss_available(device)


def check_adapters(cfg: Config, config):
    """With `model.peft`: its target modules exist in the model, the loss can train it (the chunked
    loss refuses an adapted output head), and QLoRA's bitsandbytes is installed. On the meta device;
    returns that adapted model (None without model.peft)."""
    p = cfg.model.peft
    if not p.enabled:
        return None
    import importlib.util

    from raypack.model.adapters import AdapterError, apply_adapters
    from raypack.model.build import meta_model
    from raypack.train.objectives.loss import CausalLMLoss

    if p.method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        raise AdapterError("model.peft.method=qlora: needs the bitsandbytes package (pip install bitsandbytes)")
    model = apply_adapters(meta_model(config, cfg.model.trust_remote_code), p, cfg.model.name)
    CausalLMLoss(model, cfg.train.loss)
    return model


def check_freeze(cfg: Config, config) -> None:
    """model.freeze names parts the model has: a vision tower and/or a projector (on the meta device)."""
    if not cfg.model.freeze:
        return
    from raypack.model.facts import describe
    from raypack.model.vision import parts

    facts = describe(config, cfg.model.trust_remote_code)
    if not facts.vlm:
        raise ConfigError(f"model.freeze={list(cfg.model.freeze)}: model.name {cfg.model.name!r} is not a "
                          "vision-language model; there is no vision tower or projector to freeze")
    parts(facts.meta_model())


def source_formats(cfg: Config, sources: Sources) -> dict[str, str]:
    """{file: format} for every source file, from its first record (or `data.format`, or its
    source's `format`); a file of `data.sources` whose format can't be told names its source."""
    out = {}
    for i, (path, kind) in enumerate(sources.files):
        declared, columns = sources.reading[i] if sources.reading else (cfg.data.format, "")
        source = f"{sources.where(i)}: " if sources.owners else ""
        try:
            fields = _first_record(path, kind)
            if fields is not None and columns:  # read as the source names its fields (sources.renamed)
                fields = renamed(fields, renames({"columns": columns}))
            out[path] = detect(list(fields), declared, path) if fields is not None else declared
        except FormatError as e:
            message = str(e).replace("or set data.format", f"or set data.sources[{sources.owners[i]}].format "
                                     "or its columns") if sources.owners else str(e)
            raise SourceError(source + message) from None
        except OSError as e:
            raise SourceError(f"{source}{path}: can't read it ({str(e).strip().splitlines()[0]})") from e
    return out


HEAD_BYTES = 64 << 10
"""How much of a JSONL file preflight reads to tell its format (more when its first line is longer)."""


def _first_record(path: str, kind: str) -> dict[str, bool] | None:
    """{field: whether it holds a list} of a file's first record. A JSONL file whose first lines
    (64 KiB, or its whole first line) hold no JSON object is a SourceError saying what the file is
    instead (binary, a JSON array, one object over many lines); one whose first line alone is bad
    is left to the row check, which names the line. None for an empty file (the read says so)."""
    fs, p = storage.resolve(path)
    if kind in ("parquet", "arrow"):
        if kind == "parquet":
            schema = pq.read_schema(p, filesystem=fs)
        else:
            with fs.open_input_stream(p) as f:
                schema = pa.ipc.open_stream(f).schema
        return {f.name: pa.types.is_list(f.type) or pa.types.is_large_list(f.type) for f in schema}
    with fs.open_input_stream(p) as f:
        head = f.read(HEAD_BYTES)
        while b"\n" not in head and len(head) % HEAD_BYTES == 0 and len(head) < (64 << 20):
            more = f.read(HEAD_BYTES)  # a first line longer than the head: read on to its end
            if not more:
                break
            head += more
    for line in head.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return {k: isinstance(v, list) for k, v in rec.items()}
    if head.strip():
        raise SourceError(f"{path}: not JSON Lines ({_what_it_is(head)}); raypack reads one JSON object per line")
    return None


def _what_it_is(head: bytes) -> str:
    """What a file that holds no JSON object per line looks like, from its first bytes."""
    try:
        text = head[:-4].decode() if len(head) >= HEAD_BYTES else head.decode()  # a cut multi-byte character
    except UnicodeDecodeError as e:
        return f"a binary file: byte {head[e.start]:#04x} at offset {e.start} is not UTF-8 text"
    if "\x00" in text:
        return f"a binary file: a NUL byte at offset {text.index(chr(0))}"
    start = text.lstrip()
    if start.startswith("["):
        return "a JSON array: write one object per line, e.g. `jq -c '.[]' FILE > FILE.jsonl`"
    if start.startswith("{"):
        return "a JSON object over several lines: write each object on one line, e.g. `jq -c . FILE`"
    first = start.splitlines()[0] if start else ""
    return f"line 1 is no JSON object: {first[:60]!r}"
