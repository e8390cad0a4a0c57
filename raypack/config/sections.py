"""The run's sections: one frozen dataclass per stage of the data flow (data, tokenize, pack,
model and its adapters, train, run), each field followed by its docstring. `raypack.config`
assembles them into `Config` and loads them from YAML; the sweep's sections are in `sweep.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from raypack.typed import check as _check

ASSETS = Path(__file__).parents[1] / "assets"
"""Bundled tiny tokenizer and sample data: the embedded default needs nothing from a hub."""
ASSETS_PREFIX = "raypack/assets/"
"""A config path that starts with this names a file under ASSETS, wherever raypack is installed."""
MAX_IMAGE_PIXELS = 178_956_970
"""data.max_image_pixels' default: PIL's limit, past which Image.open raises DecompressionBombError."""


Format = Literal["auto", "chat", "sharegpt", "instruction", "completion", "tokenized", "preference"]
EXAMPLE_FIELDS = ("messages", "conversations", "tools", "instruction", "input", "output", "prompt", "completion", "input_ids", "labels",
                  "chosen", "rejected")
"""The fields of the example formats (raypack/data/formats.py): what `data.sources[].columns` maps onto."""
DEFAULT_PATHS = (str(ASSETS / "sample" / "chat.jsonl"),)


def source_where(index: int, paths: tuple[str, ...]) -> str:
    """How every message names a source of `data.sources`: its index and its paths."""
    return f"data.sources[{index}] (paths: {', '.join(paths)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """One source of a mixture (`data.sources`): its files, its share of each epoch, and how its
    rows read where that differs from the others'. raypack/data/mixture.py draws the epoch."""

    paths: tuple[str, ...] = ()
    """Its JSONL, Parquet or `save_to_disk` folders or hub datasets, as `data.paths` takes them."""
    weight: float | None = None
    """Its share of each epoch's examples, relative to the other sources' weights (0.5, 0.3, 0.2 and
    5, 3, 2 mix alike; `data.examples_per_epoch` says how many an epoch holds): a seeded draw of that
    many of its training examples, without repeats where it holds that many, else every one of them
    repeated as evenly as the count allows. Give every source a weight, or none: without weights
    every example of every source trains once per epoch (their concatenation)."""
    name: str | None = None
    """What the prepare and plan lines and the eval split's steps call it; null: the file name of its
    first path, without its extension (with `-N` added where two sources would share one)."""
    format: Format | None = None
    """Its example format, as `data.format` names them; null: `data.format`'s."""
    config: str | None = None
    """Of a Hugging Face Hub dataset (`org/name`): its config, the subset `load_dataset` calls `name`;
    null: the dataset's default (docs/guides/data.md#hugging-face-hub-datasets)."""
    split: str | None = None
    """Of a hub dataset: its split; null: train."""
    revision: str | None = None
    """Of a hub dataset: the branch, tag or commit to read; null: main."""
    columns: dict[str, str] = field(default_factory=dict)
    """Its own column names for the format's fields, `{field: column}`: `{prompt: question,
    completion: answer}` reads a `question` column as the prompt and `answer` as the completion
    (LLaMA-Factory's `columns`, Axolotl's `field_*`). Fields not named keep their own names."""

    @staticmethod
    def describe_raw(index: int, raw) -> str:
        """Where a source whose mapping doesn't load is, for the loader's message (raypack/typed.py)."""
        paths = raw.get("paths") if isinstance(raw, dict) else None
        paths = [paths] if isinstance(paths, str) else paths
        return f"data.sources[{index}] has paths: {', '.join(map(str, paths))}" if paths else f"data.sources[{index}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    paths: tuple[str, ...] = DEFAULT_PATHS
    """JSONL, Parquet or `save_to_disk` folders; local paths or any URI Ray Data reads; or Hugging
    Face Hub datasets, `org/name` or `hf://datasets/org/name[@revision][/path]` (their default
    config's train split; a source's `config`, `split` and `revision` choose others). The
    one-source form of `data.sources`: give one or the other."""
    sources: tuple[SourceConfig, ...] = ()
    """Several datasets mixed by weight, each with its own `paths`, `weight` and, where it differs,
    `format` and `columns` (docs/guides/data.md#mixtures). Each source's examples are tokenized
    alike and packed together, globally; its eval split is held out of it alone."""
    examples_per_epoch: Literal["sum", "first_exhausted", "all_exhausted"] | int = "sum"
    """How many examples an epoch of a weighted mixture holds, shared out by the weights: `sum`, as
    many as the sources' training examples together; `first_exhausted`, the most that repeat no
    example (the source its weight exhausts first gives all of its own); `all_exhausted`, the
    fewest that show every example at least once (Hugging Face `interleave_datasets`' stopping
    strategies, LLaMA-Factory's `interleave_under` / `interleave_over`); a number, that many."""
    format: Format = "auto"
    """Example format; `auto` detects it from the columns of each source. `preference` rows
    (prompt, chosen, rejected) train with `train.objective: dpo`."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """`error` stops at the first bad row naming its file and line; `skip` counts and reports them."""
    max_image_pixels: int | None = MAX_IMAGE_PIXELS
    """Most pixels (width x height) an image of an image+text example may have, read from its
    header before it is decoded: one over it is a bad row naming its file and line (skipped under
    on_bad_rows: skip), not a decoded picture of gigabytes. The default is PIL's own limit (twice
    its MAX_IMAGE_PIXELS: 13,377 x 13,377 a square); null: no limit."""
    max_dropped_fraction: float = 0.2
    """Largest share of the source rows that tokenize may drop (over-length under
    tokenize.overlength=drop, without a label token, bad rows skipped), or of their label tokens
    in dropped examples, before the run stops with an error naming the cause: losing most of a
    dataset to a setting should never look like success. Truncation that cuts more than this share
    of the label tokens is a warning (the prepare line states every share, by cause)."""
    eval_fraction: float = 0.1
    """Share of examples held out for eval loss, chosen by a seeded hash of `example_id`
    (raypack/data/holdout.py), up to `eval_max_examples`: the familiar 10% split on small data,
    a fixed few thousand on large. 0 holds out none, as TRL, Axolotl and LLaMA-Factory do."""
    eval_max_examples: int | None = 2000
    """Most examples held out, whatever the fraction (the lowest hashes: the same ones every
    run). An eval loss's noise depends on how many examples it averages, not on their share of
    the data: 2,000 pin it to a few percent and evaluate in seconds, where a tenth of 3M examples
    is 300k examples not trained on and minutes of every eval. null: no cap."""
    cache_path: str | None = None
    """Folder or URI that keeps the tokenized examples and the packed rows, each under a key of
    everything that shaped it, so runs and sweep trials with the same data and tokenize config
    tokenize once (and with the same pack config, pack once). None: tokenize in memory and pack
    under the run dir. `raypack sweep` sets it to `<experiment>/cache` for its trials."""
    driver_max_mb: float = 8.0
    """Data of at most this many MiB (the source files, then the tokenized rows) is tokenized and
    packed in the driver's own process, by the same code that Ray Data's tokenizer actors and
    Ray's pack tasks run, without the seconds those take to start: 0.03x Ray's time for the
    quickstart's data, 0.31x at 4 MiB of chats, even at 16 MiB on 2 cores
    (benchmarks/prepare_driver.py). Larger data, or any with 0 here, goes through Ray, in
    parallel across the cluster."""

    def __post_init__(self) -> None:
        if self.sources:
            # paths holds its default unless the config set it too; set, it is refused
            _check(self.paths in (DEFAULT_PATHS, ()), "data.paths", "no paths beside data.sources (data.paths is "
                   "the one-source form of data.sources: give one or the other; data.paths=[] clears a file's)",
                   list(self.paths))
            object.__setattr__(self, "paths", ())
            self._check_sources()
        else:
            _check(len(self.paths) > 0, "data.paths", "at least one path", self.paths)
            _check(self.examples_per_epoch == "sum", "data.examples_per_epoch", "sum without weighted data.sources "
                   "(it shares an epoch out by the sources' weights)", self.examples_per_epoch)
        _check(self.max_image_pixels is None or self.max_image_pixels > 0, "data.max_image_pixels",
               "a positive int or null", self.max_image_pixels)
        _check(self.driver_max_mb >= 0, "data.driver_max_mb", "a float >= 0", self.driver_max_mb)
        _check(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", "a float in [0, 1)", self.eval_fraction)
        _check(self.eval_max_examples is None or self.eval_max_examples > 0, "data.eval_max_examples",
               "a positive int or null", self.eval_max_examples)
        _check(0.0 <= self.max_dropped_fraction <= 1.0, "data.max_dropped_fraction", "a float in [0, 1]",
               self.max_dropped_fraction)

    @property
    def setting(self) -> str:
        """The field that names the data, as messages about all of it say: data.paths or data.sources."""
        return "data.sources" if self.sources else "data.paths"

    def _check_sources(self) -> None:
        weights = [s.weight for s in self.sources]
        for i, s in enumerate(self.sources):
            where = source_where(i, s.paths)
            _check(len(s.paths) > 0, f"data.sources[{i}].paths", "at least one path", list(s.paths))
            _check(s.weight is None or s.weight > 0, f"{where}: weight", "a number > 0 (a share of the epoch)",
                   s.weight)
            for key, column in s.columns.items():
                _check(key in EXAMPLE_FIELDS, f"{where}: columns.{key}", "a field of an example format ("
                       + ", ".join(EXAMPLE_FIELDS) + ")", key)
                _check(column != "", f"{where}: columns.{key}", "a column name", column)
            _check(len(set(s.columns.values())) == len(s.columns), f"{where}: columns",
                   "a different column for each field", s.columns)
            _check((s.weight is None) == (weights[0] is None), f"{where}: weight",
                   "a weight on every source or on none" + (" (data.sources[0] has one)" if weights[0] else ""),
                   s.weight)
        n = self.examples_per_epoch
        if weights[0] is None:
            _check(n == "sum", "data.examples_per_epoch", "sum without weights on data.sources (it shares an epoch "
                   "out by the weights)", n)
        elif not isinstance(n, str):
            _check(n > 0, "data.examples_per_epoch", "a positive int, sum, first_exhausted or all_exhausted", n)
            for i, s in enumerate(self.sources):  # the draw's own check, where no data is needed to make it
                quota = s.weight / sum(weights) * n
                _check(quota >= 1, f"{source_where(i, s.paths)}: weight", f"a share of data.examples_per_epoch={n} "
                       "of at least one example (raise the weight or the examples per epoch)",
                       f"{s.weight:g} of {sum(weights):g}, {quota:.2g} examples")


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = str(ASSETS / "tokenizer")
    """Hugging Face tokenizer name or local path."""
    chat_template: str | None = None
    """Jinja chat template that replaces (or supplies) the tokenizer's own: its text, or a `.jinja`
    file (a path or URI every node can read, as data.paths; the cache keys by its text)."""
    label_mask: Literal["auto", "assistant", "completion", "all"] = "auto"
    """Which tokens carry loss. `auto`: assistant turns for chat, the output/completion otherwise."""
    overlength: Literal["drop", "truncate", "split"] = "truncate"
    """What happens to an example longer than `max_length` (default: the pack budget)."""
    no_labels: Literal["drop", "error"] = "drop"
    """An example no token of which carries loss (a chat without an assistant turn, a prompt that
    truncate cut before its answer) is dropped and counted, or is an error naming it."""
    empty_answers: Literal["train", "error"] = "train"
    """A chat that ends with an empty assistant turn (no content, tool call or reasoning) trains its
    end-of-turn markup as the answer, as TRL does, and is counted in `raypack data`'s summary; or
    is an error naming it."""
    max_length: int | None = None
    """Longest example kept whole; None means `pack.budget` (`Config.max_length` says which applies)."""
    batch_size: int = 256
    """Rows per `map_batches` call (at least 4096 under `data.format: tokenized`, where no tokenizer runs)."""
    num_actors: int = 1
    """Tokenizer actors; each loads the tokenizer once."""
    num_cpus: float = 0.5
    """Logical CPUs per tokenizer actor. Fractional, so read tasks still get a core on small hosts."""

    def __post_init__(self) -> None:
        _check(self.max_length is None or self.max_length > 0, "tokenize.max_length", "a positive int or null", self.max_length)
        _check(self.batch_size > 0, "tokenize.batch_size", "a positive int", self.batch_size)
        _check(self.num_actors > 0, "tokenize.num_actors", "a positive int", self.num_actors)
        _check(self.num_cpus > 0, "tokenize.num_cpus", "a positive float", self.num_cpus)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    strategy: str = "balanced"
    """Packing strategy by name: pad, pad_sorted, flatten, wrapped, wrapped_noreset, random, greedy, bfd, balanced
    (the registry is raypack.data.strategies.STRATEGIES, which checks the name)."""
    budget: int = 1024
    """Tokens per packed row (the micro-batch for packed strategies)."""
    batch_size: float = 8.0
    """Examples per minibatch for pad, pad_sorted and flatten (the papers' B). A fraction makes
    minibatches of the two nearest whole sizes whose mean is B (2.5: 2, 3, 2, 3, ...); a sweep
    uses that to give padded trials the packed trials' tokens per step (tune.equal_work)."""
    seed: int = 0
    """Seed for every random choice of the plan and of each epoch's step order (seeded by
    (seed, epoch)); the same seed rebuilds the same plan and orders on resume."""
    repack_each_epoch: bool = False
    """A new plan (new packs) every epoch, seeded by (seed, epoch), for the strategies whose packs
    depend on the seed (pad, flatten, wrapped, wrapped_noreset, random); refused for the others,
    whose epochs differ in step order only. Writes one set of packed rows per epoch."""

    def __post_init__(self) -> None:
        _check(self.budget > 0, "pack.budget", "a positive int", self.budget)
        _check(self.batch_size >= 1, "pack.batch_size", "a number >= 1", self.batch_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeftConfig:
    method: Literal["none", "lora", "qlora"] = "none"
    """`none` trains every weight; `lora` trains low-rank adapters (the `peft` library) on frozen base
    weights; `qlora` does the same on 4-bit base weights (bitsandbytes; CUDA, ZeRO 0-2 only)."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """LoRA alpha: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with `use_rslora`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or name suffixes) that get adapters; `[all-linear]` is every linear layer but the
    output head, as in peft."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters and saved with them (e.g. a new token's embeddings)."""
    use_rslora: bool = False
    """Rank-stabilized LoRA: scale by alpha / sqrt(r)."""
    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA): a trained magnitude per output feature on top of the adapter."""
    merge: bool = True
    """Also write the merged model (`merge_and_unload`) as `model/` beside `adapter/` at the end."""

    def __post_init__(self) -> None:
        _check(self.r > 0, "model.peft.r", "a positive int", self.r)
        _check(self.alpha > 0, "model.peft.alpha", "a positive int", self.alpha)
        _check(0.0 <= self.dropout < 1.0, "model.peft.dropout", "a float in [0, 1)", self.dropout)
        _check(len(self.target_modules) > 0, "model.peft.target_modules", "[all-linear] or module names", self.target_modules)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    name: str = "tiny-llama"
    """Hugging Face model name or path, or `tiny-<family>` for a small random model built from a config."""
    attention: Literal["auto", "flash_attn", "torch_varlen", "sdpa_varlen", "sdpa"] = "auto"
    """Attention backend for packed rows; `auto` picks flash-attn, then torch varlen on CUDA, then exact SDPA."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; `auto` is bfloat16 on CUDA and float32 on the CPU."""
    trust_remote_code: bool = False
    """Allow model code from the hub; off unless you trust the source."""
    gradient_checkpointing: Literal["auto", "full", "selective", "none"] | bool = "auto"
    """What the backward recomputes instead of keeping from the forward (raypack/model/checkpointing.py):
    `none` keeps every activation (fastest, most memory); `selective` keeps the matmul and attention
    outputs and recomputes the cheap elementwise work (norms, RoPE, activations); `full` keeps only each
    decoder layer's input and recomputes the whole layer (least memory); `auto` takes the fastest that
    raypack's memory estimate (raypack/train/memory/estimate.py) fits on the worker's GPU with a margin, and says
    which and why when training starts. true and false (the former setting) mean full and none."""
    tiled_mlp_tokens: int = 0
    """Long rows: run each layer's MLP this many tokens at a time, each tile recomputed in backward,
    so its [tokens, intermediate] activations exist one tile at a time (raypack/model/kernels.py); 0: off."""
    offload_checkpoints: bool = False
    """Long rows, with gradient_checkpointing: keep each layer's checkpointed input in host memory
    between forward and backward instead of on the GPU."""
    kernels: Literal["auto", "liger", "none"] = "auto"
    """Fused kernels for the same math (raypack/model/kernels.py): `liger` swaps in Liger-Kernel's
    RMSNorm, RoPE and SwiGLU/GeGLU (CUDA, `pip install 'raypack[liger]'`, the families it has
    kernels for; refused elsewhere), `auto` does where it can (with train.compile: leaves it to
    Inductor to fuse the same work), `none` never."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """Parameter-efficient fine-tuning: LoRA or QLoRA adapters instead of every weight."""
    freeze: tuple[Literal["vision", "projector"], ...] = ()
    """A vision-language model's parts that don't train (raypack/model/vision.py): `vision`, the
    vision tower, and/or `projector`, what maps its features into the language model. A frozen
    part still runs and passes gradients back to what is before it; its weights get none."""

    def __post_init__(self) -> None:
        if isinstance(self.gradient_checkpointing, bool):  # the former boolean: one canonical value
            object.__setattr__(self, "gradient_checkpointing", "full" if self.gradient_checkpointing else "none")
        _check(self.tiled_mlp_tokens >= 0, "model.tiled_mlp_tokens", "an int >= 0", self.tiled_mlp_tokens)
        # Offloading is for the checkpoints of full recompute (a layer's input): under selective or none,
        # autograd saves far more, and every byte of it would cross to the host and back.
        _check(not self.offload_checkpoints or self.gradient_checkpointing == "full", "model.offload_checkpoints",
               "false unless model.gradient_checkpointing is full", self.offload_checkpoints)
        # Selective checkpointing keeps the MLP's matmul outputs, the [tokens, intermediate] tensors that
        # tiling exists not to keep (each tile is recomputed whole in backward anyway).
        _check(not self.tiled_mlp_tokens or self.gradient_checkpointing != "selective", "model.gradient_checkpointing",
               "full, none or auto with model.tiled_mlp_tokens", self.gradient_checkpointing)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_workers: int | tuple[int, ...] = 2
    """Ray Train workers. Each is a data-parallel rank, or with `sequence_parallel` N one of the N
    ranks of a group that trains one packed row together. `[min, max]`: an elastic run (Ray
    Train's elastic scaling; on DeepSpeed where its state reshards exactly), which goes on from
    its last checkpoint on as many workers as the cluster holds, between min and max, when a node
    is lost or comes back (docs/guides/stops.md). It becomes `num_workers: max` and `elastic: [min, max]`."""
    elastic: tuple[int, ...] = ()
    """`[min, max]` of an elastic run, as `num_workers: [min, max]` sets it; `num_workers` is then the
    size the run's data is planned for now (max at the start). Empty: a fixed size."""
    elastic_resize_interval_s: float = 60.0
    """An elastic run: how often Ray Train looks whether the cluster holds more workers than the
    group (capacity come back), to restart it on them from the last checkpoint (Ray Train's
    `ScalingConfig(elastic_resize_monitor_interval_s)`). Each grow costs a restart: shorter grows
    back sooner, and may restart more often while nodes come back one by one."""
    sequence_parallel: int = 1
    """Ranks that split each packed row's tokens (Ulysses: every attention layer exchanges tokens
    for heads with two all-to-alls, raypack/model/ulysses.py). It must divide num_workers, which
    then form num_workers / N data-parallel groups, and the model's attention heads;
    `pack.budget` is a row's tokens over its whole group."""
    use_gpu: bool = False
    """One GPU per worker when true; gloo on the CPU otherwise."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """How workers spread over nodes; SPREAD puts ranks on different nodes where it can."""
    engine: Literal["deepspeed", "torch"] = "deepspeed"
    """What trains the model: `deepspeed` (ZeRO with its JSON presets and offload) or `torch`, torch's
    own data parallelism (DDP at zero_stage 0, FSDP2 at 1-3, the bare model on one rank), without
    DeepSpeed (raypack/train/engines/). The default stays deepspeed until a GPU has measured the two
    side by side (docs/guides/engines.md)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """What each rank keeps whole, on either engine: 0 everything (replicated); 1-2 the weights,
    sharded optimizer state and gradients (DeepSpeed's ZeRO-1/2; FSDP2 gathering the weights and
    reduce-scattering the gradients once an optimizer step); 3 the weights sharded too (ZeRO-3;
    FSDP2 resharding after each layer's forward and backward, every micro-batch)."""
    deepspeed_preset: str | None = None
    """A DeepSpeed JSON preset by name (raypack/configs/deepspeed/<name>.json) or a path, overlaid by this config."""
    offload_optimizer: bool = False
    """Optimizer state offload to CPU (DeepSpeed's CPU Adam; on the torch engine FSDP2's
    CPUOffloadPolicy, which keeps the sharded weights and gradients on the host with it)."""
    offload_params: bool = False
    """ZeRO-3 parameter offload to CPU (on the torch engine, the same CPUOffloadPolicy)."""
    optimizer: Literal["torch", "deepspeed"] = "torch"
    """`torch` passes torch AdamW (fused on CUDA) and skips DeepSpeed's JIT op builds; `deepspeed`
    (train.engine deepspeed only) takes DeepSpeed's own."""
    precision: Literal["mixed", "bf16"] = "mixed"
    """`mixed`: bf16 (or model.dtype's) weights and gradients, fp32 master weights and Adam moments
    (16 bytes a trained parameter before ZeRO shards them). `bf16`: weights, master weights, gradients
    and moments all in bf16, as a bf16-loaded model trains under TRL (DeepSpeed's
    bf16_master_weights_and_grads and bf16_optimizer_states), updated by torch-optimi's AdamW with
    Kahan compensation, so updates below half a bf16 ulp still add up (raypack/train/engines/optim.py).
    Needs model.dtype auto or bfloat16, ZeRO 1-3, the torch optimizer and no optimizer offload."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of `lr`."""
    warmup_steps: int = 2
    """Linear warmup optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0 turns it off."""
    grad_accum: int = 1
    """Micro-batches (plan steps) per optimizer step."""
    epochs: int = 1
    """Passes over the training packs."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    seed: int = 0
    """Model init and dropout seed."""
    report_every_steps: int | None = None
    """Optimizer steps between `ray.train.report` calls. null (the default): chosen at each report so
    that reports cost under 1% of the training time, from the last report's and the steps' measured
    times (ray.train.report blocks on a barrier through Ray Train's controller; raypack/train/metrics.py);
    the first report comes at step 10. A number fixes it (a sweep ranking trials by eval_loss needs one)."""
    eval_every_steps: int = 0
    """Optimizer steps between evals; 0 evaluates only at the end."""
    checkpoint_every_steps: int = 0
    """Optimizer steps between checkpoints; 0 checkpoints only at the end."""
    save_final: bool = True
    """Checkpoint, with the Hugging Face model, at the last step. False ends the run without one, for
    throughput measurements that keep nothing (benchmarks/peers.py); such a run, run again, trains
    again from its last checkpoint, or from the start."""
    overlap_start: bool = False
    """Start the worker group as the data preparation starts (tokenize, plan, pack on the driver),
    the workers waiting for the data (raypack/train/handoff.py), instead of one after the other. Both
    are mostly CPU work: on 2 cores it measured no gain (benchmarks/startup.py); for machines with
    cores to spare, where Ray Data doesn't need the CPUs the workers reserve."""
    max_failures: int = 1
    """Worker-group restarts from the last checkpoint before the run fails."""
    keep_checkpoints: int = 2
    """Checkpoints Ray Train keeps (the latest; older ones are deleted): what `raypack export
    --checkpoint N / --best eval_loss` can choose from. Each holds the optimizer state too."""
    start_timeout_s: float | None = 600.0
    """On a cluster raypack joined: how long a start waits for room for its workers (an autoscaler
    adding nodes, other work finishing) before it stops with one line; null waits as long as it
    takes. Workers that the cluster's nodes and published node types can never hold stop it at once."""
    stop_grace_s: float = 25.0
    """How long a run asked to stop (SIGTERM: a pod evicted, `ray job stop`, Slurm, `kill`; or
    Ctrl-C) has to finish its step and save a checkpoint before it stops at once; below
    Kubernetes' default 30 s terminationGracePeriodSeconds (raypack/train/stop.py)."""
    stop_checkpoint_after_s: float = 60.0
    """A run that stops (a signal, its node preempted) saves a checkpoint at the step it stops
    after when the last one is older than this, in seconds: redoing a minute of steps costs about
    what writing one more checkpoint would. 0: always."""
    objective: Literal["sft", "dpo"] = "sft"
    """`sft`: cross-entropy on the label tokens; `dpo`: preference tuning on (prompt, chosen,
    rejected) pairs, each pair packed whole in one row (the `dpo:` section, raypack/train/objectives/dpo.py)."""
    loss: Literal["chunked", "full", "liger"] = "chunked"
    """`chunked` computes the loss from the final hidden states a chunk of label tokens at a time and
    never holds the [tokens, vocab] logits (raypack/train/objectives/loss.py; a model it can't reproduce exactly
    is refused at setup); `full` takes the model's own logits, for any model; `liger` is Liger-Kernel's
    fused linear cross-entropy on the same hidden states (CUDA, `raypack[liger]`)."""
    router_aux_loss_coef: Literal["auto"] | float = "auto"
    """A mixture-of-experts model's router load-balancing loss, added to the step's loss times this
    coefficient (raypack/train/objectives/router_loss.py). `auto`: the model config's `router_aux_loss_coef`,
    or 0.001 for an MoE model whose config names none (TRL's default), 0 for a dense model; a
    number >= 0 sets it (0: off). A model whose router raypack can't find is refused when it is > 0."""
    router_aux_loss: Literal["example", "micro_batch"] = "example"
    """`example`: each example's load-balancing loss over its own tokens (found from the packed
    row's boundaries), averaged over the step's examples on every rank, so packing, strategy and
    rank count don't change it; `micro_batch`: transformers' value pooled over each micro-batch's
    tokens, as TRL and Axolotl train it (it depends on which examples share a row)."""
    compile: bool = False
    """torch.compile each decoder layer whole, attention and gradient checkpointing's recompute
    included (regional, dynamic shapes: a new packed length doesn't recompile; a layer that can't
    compile whole is refused at setup; raypack/model/kernels.py). Not with ZeRO-3 or sequence_parallel."""
    loss_chunk_tokens: int = 0
    """Label tokens per chunk of the chunked loss; 0: 2048, fewer where one chunk's fp32 logits would pass 1 GiB."""
    tensorboard: bool = True
    """Write per-step TensorBoard events into <run>/tensorboard (local storage paths only)."""
    mlflow: bool = False
    """Also log to MLflow (local file store under the storage path unless MLFLOW_TRACKING_URI is set)."""

    def __post_init__(self) -> None:
        self._check_elastic()
        for name in ("num_workers", "grad_accum", "epochs", "keep_checkpoints"):
            _check(getattr(self, name) > 0, f"train.{name}", "a positive int", getattr(self, name))
        for name in ("warmup_steps", "eval_every_steps", "checkpoint_every_steps", "max_failures", "loss_chunk_tokens"):
            _check(getattr(self, name) >= 0, f"train.{name}", "an int >= 0", getattr(self, name))
        _check(self.max_steps is None or self.max_steps > 0, "train.max_steps", "a positive int or null", self.max_steps)
        _check(self.report_every_steps is None or self.report_every_steps > 0, "train.report_every_steps",
               "a positive int or null (chosen as the run goes)", self.report_every_steps)
        if self.engine == "torch":
            self._check_torch_engine()
        if self.precision == "bf16" and self.engine == "deepspeed":
            # DeepSpeed keeps bf16 master weights only in a ZeRO optimizer (stage 1-3), and with
            # optimizer offload only in its CPU Adam, which rounds every update to nearest.
            _check(self.zero_stage > 0, "train.precision", "mixed with train.zero_stage 0 (bf16 master weights "
                   "live in ZeRO's optimizer, stages 1-3; train.engine torch trains bf16 weights at stage 0)",
                   self.precision)
            _check(not self.offload_optimizer and self.optimizer == "torch", "train.precision",
                   "mixed with train.offload_optimizer or train.optimizer: deepspeed (DeepSpeed's CPU Adam rounds "
                   "bf16 updates to nearest and loses the small ones)", self.precision)
        _check(self.lr > 0, "train.lr", "a positive float", self.lr)
        _check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "a float in [0, 1]", self.min_lr_ratio)
        _check(self.cpus_per_worker > 0, "train.cpus_per_worker", "a positive float", self.cpus_per_worker)
        _check(self.start_timeout_s is None or self.start_timeout_s > 0, "train.start_timeout_s",
               "a positive number or null", self.start_timeout_s)
        _check(self.stop_grace_s > 0, "train.stop_grace_s", "a positive number", self.stop_grace_s)
        _check(self.stop_checkpoint_after_s >= 0, "train.stop_checkpoint_after_s", "a number >= 0",
               self.stop_checkpoint_after_s)
        _check(not self.offload_params or self.zero_stage == 3, "train.offload_params", "zero_stage 3", self.zero_stage)
        _check(self.router_aux_loss_coef == "auto" or self.router_aux_loss_coef >= 0, "train.router_aux_loss_coef",
               "auto or a number >= 0", self.router_aux_loss_coef)
        _check(self.sequence_parallel > 0, "train.sequence_parallel", "a positive int", self.sequence_parallel)
        _check(self.num_workers % self.sequence_parallel == 0, "train.sequence_parallel",
               f"a divisor of train.num_workers ({self.num_workers})", self.sequence_parallel)
        # Each rank's loss sees only its shard of the row: the full loss would shift labels
        # within a shard and lose the token at every shard boundary.
        _check(self.sequence_parallel == 1 or self.loss != "full", "train.loss",
               "chunked or liger with train.sequence_parallel > 1 (their targets come from the whole row)", self.loss)
        # ZeRO-3 gathers weights in hooks on every submodule, which a compiled layer would trace;
        # a split row's all-to-alls have not been tested compiled.
        _check(not self.compile or self.zero_stage < 3, "train.compile", "false with train.zero_stage 3", self.compile)
        _check(not self.compile or self.sequence_parallel == 1, "train.compile",
               "false with train.sequence_parallel > 1", self.compile)

    def _check_elastic(self) -> None:
        """`num_workers: [min, max]` made `num_workers: max` and `elastic: [min, max]`, each checked."""
        if isinstance(self.num_workers, tuple):
            _check(not self.elastic, "train.elastic", "empty beside train.num_workers: [min, max] (which sets it)",
                   list(self.elastic))
            _check(len(self.num_workers) == 2, "train.num_workers", "an int, or [min, max]", list(self.num_workers))
            object.__setattr__(self, "elastic", self.num_workers)
            object.__setattr__(self, "num_workers", self.num_workers[1])
        _check(self.elastic_resize_interval_s >= 0, "train.elastic_resize_interval_s", "seconds, >= 0",
               self.elastic_resize_interval_s)
        if not self.elastic:
            return
        low, high = (self.elastic + (0, 0))[:2]
        shown = list(self.elastic)
        _check(len(self.elastic) == 2 and 1 <= low <= high, "train.num_workers",
               "[min, max] with 1 <= min <= max", shown)
        _check(low <= self.num_workers <= high, "train.num_workers", f"between {low} and {high} (train.elastic)",
               self.num_workers)
        # Another worker count means resharding the checkpoint's state: DCP does, and DeepSpeed's
        # universal checkpoint where it is exact (with model.dtype: raypack/train/elastic.py)
        # Ray Train may pick any count between min and max, which the group size must divide
        _check(self.sequence_parallel == 1, "train.num_workers", "a fixed int with train.sequence_parallel > 1",
               shown)

    def _check_torch_engine(self) -> None:
        """What only DeepSpeed does, refused on the torch engine (train.engine: torch)."""
        _check(self.deepspeed_preset is None, "train.deepspeed_preset", "null with train.engine torch (a DeepSpeed "
               "preset configures DeepSpeed's engine only)", self.deepspeed_preset)
        _check(self.optimizer == "torch", "train.optimizer", "torch with train.engine torch (DeepSpeed's own "
               "Adam needs its engine)", self.optimizer)
        # FSDP2's CPUOffloadPolicy offloads the shards of a sharded model: DDP has no such policy
        _check(not self.offload_optimizer or self.zero_stage > 0, "train.offload_optimizer",
               "false with train.engine torch and train.zero_stage 0 (offload is FSDP2's, zero_stage 1-3)",
               self.offload_optimizer)

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: groups of `sequence_parallel` workers, each with its own packed rows."""
        return self.num_workers // self.sequence_parallel


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases, from rank 0. The API key comes from the environment (WANDB_API_KEY, or a
    Ray runtime_env / Kubernetes Secret that sets it), never from this file."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """`online` streams to the W&B server; `offline` writes the run under <run>/wandb for `wandb sync`."""
    project: str = "raypack"
    """W&B project the run is logged to."""
    entity: str | None = None
    """Team or user; None: the API key's default entity."""
    group: str | None = None
    """Runs shown together in W&B; None: the sweep's name for a sweep trial, none for a run."""
    tags: tuple[str, ...] = ()
    """Tags shown on the run in W&B."""

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str = "raypack"
    """Run name; Ray Train resumes a run whose name already exists under the storage path."""
    storage_path: str = "~/raypack_results"
    """Where results, checkpoints and TensorBoard logs go: a local folder or any URI Ray supports."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases tracking of every step's metrics and the resolved config (off by default)."""
