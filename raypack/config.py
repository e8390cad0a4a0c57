"""Typed run configuration: one frozen dataclass per component, loaded from YAML.

    cfg = load("jobs/configs/tiny_cpu.yaml", ["train.lr=2e-5", "pack.strategy=bfd"])
    cfg = loads(dumps(cfg))                 # a run saves its config as YAML and resumes from it

Every field has a type and a docstring. `load` checks the YAML against the dataclasses
(raypack/typed.py), so an unknown key, a wrong type or an out-of-range value fails before any Ray
work starts, with an error that names the key, the expected form and the file. `to_dict()` turns
a config into plain data, each value in its field's type, so that it can be saved, hashed, travel
as Ray Train's `train_loop_config` and be logged, and reload to an equal config.

What needs another module's registry is checked there, on the loaded config: strategy names and
traits by `raypack.data.strategies.check_strategies` (the command line runs it right after
`load`, and preflight before every run). This module imports nothing from raypack but the errors
and the typed loader, so every module can import it.

Paths: a local path is relative to the working folder, except `raypack/assets/...`, which names
the bundled assets wherever raypack is installed. A run saves its config with every path made
absolute (raypack/runs.py), so resuming it does not depend on where you stand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from raypack.errors import ConfigError
from raypack.typed import build, check as _check, plain

ASSETS = Path(__file__).parent / "assets"
"""Bundled tiny tokenizer and sample data: the embedded default needs nothing from a hub."""
ASSETS_PREFIX = "raypack/assets/"
"""A config path that starts with this names a file under ASSETS, wherever raypack is installed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    paths: tuple[str, ...] = (str(ASSETS / "sample" / "chat.jsonl"),)
    """JSONL, Parquet or `save_to_disk` folders; local paths or any URI Ray Data reads."""
    format: Literal["auto", "chat", "instruction", "completion", "tokenized"] = "auto"
    """Example format; `auto` detects it from the columns of each source."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """`error` stops at the first bad row naming its file and line; `skip` counts and reports them."""
    eval_fraction: float = 0.1
    """Share of examples held out for eval loss, chosen by a seeded hash of `example_id`."""
    cache_path: str | None = None
    """Folder or URI that keeps the tokenized examples and the packed rows, each under a key of
    everything that shaped it, so runs and sweep trials with the same data and tokenize config
    tokenize once (and with the same pack config, pack once). None: tokenize in memory and pack
    under the run dir. `raypack sweep` sets it to `<experiment>/cache` for its trials."""

    def __post_init__(self) -> None:
        _check(len(self.paths) > 0, "data.paths", "at least one path", self.paths)
        _check(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", "a float in [0, 1)", self.eval_fraction)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = str(ASSETS / "tokenizer")
    """Hugging Face tokenizer name or local path."""
    chat_template: str | None = None
    """Jinja chat template that replaces (or supplies) the tokenizer's own."""
    label_mask: Literal["auto", "assistant", "completion", "all"] = "auto"
    """Which tokens carry loss. `auto`: assistant turns for chat, the output/completion otherwise."""
    overlength: Literal["drop", "truncate", "split"] = "truncate"
    """What happens to an example longer than `max_length` (default: the pack budget)."""
    no_labels: Literal["drop", "error"] = "drop"
    """An example no token of which carries loss (a chat without an assistant turn, a prompt that
    truncate cut before its answer) is dropped and counted, or is an error naming it."""
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
class ModelConfig:
    name: str = "tiny-llama"
    """Hugging Face model name or path, or `tiny-<family>` for a small random model built from a config."""
    attention: Literal["auto", "flash_attn", "torch_varlen", "sdpa_varlen", "sdpa"] = "auto"
    """Attention backend for packed rows; `auto` picks flash-attn, then torch varlen on CUDA, then exact SDPA."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; `auto` is bfloat16 on CUDA and float32 on the CPU."""
    trust_remote_code: bool = False
    """Allow model code from the hub; off unless you trust the source."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_workers: int = 2
    """Ray Train workers, one data-parallel rank each."""
    use_gpu: bool = False
    """One GPU per worker when true; gloo on the CPU otherwise."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """How workers spread over nodes; SPREAD puts ranks on different nodes where it can."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage."""
    deepspeed_preset: str | None = None
    """A DeepSpeed JSON preset by name (raypack/configs/deepspeed/<name>.json) or a path, overlaid by this config."""
    offload_optimizer: bool = False
    """ZeRO optimizer state offload to CPU."""
    offload_params: bool = False
    """ZeRO-3 parameter offload to CPU."""
    optimizer: Literal["torch", "deepspeed"] = "torch"
    """`torch` passes torch AdamW (fused on CUDA) and skips DeepSpeed's JIT op builds."""
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
    report_every_steps: int = 10
    """Optimizer steps between `ray.train.report` calls (it blocks, so never every step)."""
    eval_every_steps: int = 0
    """Optimizer steps between evals; 0 evaluates only at the end."""
    checkpoint_every_steps: int = 0
    """Optimizer steps between checkpoints; 0 checkpoints only at the end."""
    max_failures: int = 1
    """Worker-group restarts from the last checkpoint before the run fails."""
    loss: Literal["chunked", "full"] = "chunked"
    """`chunked` computes the loss from the final hidden states a chunk of label tokens at a time and
    never holds the [tokens, vocab] logits (raypack/train/loss.py; a model it can't reproduce exactly
    is refused at setup); `full` takes the model's own logits, for any model."""
    loss_chunk_tokens: int = 0
    """Label tokens per chunk of the chunked loss; 0: 2048, fewer where one chunk's fp32 logits would pass 1 GiB."""
    tensorboard: bool = True
    """Write per-step TensorBoard events into <run>/tensorboard (local storage paths only)."""
    mlflow: bool = False
    """Also log to MLflow (local file store under the storage path unless MLFLOW_TRACKING_URI is set)."""

    def __post_init__(self) -> None:
        for name in ("num_workers", "grad_accum", "epochs", "report_every_steps"):
            _check(getattr(self, name) > 0, f"train.{name}", "a positive int", getattr(self, name))
        for name in ("warmup_steps", "eval_every_steps", "checkpoint_every_steps", "max_failures", "loss_chunk_tokens"):
            _check(getattr(self, name) >= 0, f"train.{name}", "an int >= 0", getattr(self, name))
        _check(self.max_steps is None or self.max_steps > 0, "train.max_steps", "a positive int or null", self.max_steps)
        _check(self.lr > 0, "train.lr", "a positive float", self.lr)
        _check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "a float in [0, 1]", self.min_lr_ratio)
        _check(self.cpus_per_worker > 0, "train.cpus_per_worker", "a positive float", self.cpus_per_worker)
        _check(not self.offload_params or self.zero_stage == 3, "train.offload_params", "zero_stage 3", self.zero_stage)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str = "raypack"
    """Run name; Ray Train resumes a run whose name already exists under the storage path."""
    storage_path: str = "~/raypack_results"
    """Where results, checkpoints and TensorBoard logs go: a local folder or any URI Ray supports."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AshaConfig:
    time_attr: Literal["step", "tokens_seen", "training_iteration"] = "step"
    """What ASHA measures progress in: optimizer steps, real tokens trained, or Tune reports."""
    grace_period: int = 10
    """Progress (in `time_attr` units) every trial makes before it can be stopped."""
    reduction_factor: float = 2.0
    """At each rung a trial goes on only if it is in the best 1/reduction_factor so far."""
    max_t: int | None = None
    """Progress at which every trial stops; None: the sweep's longest planned trial."""
    brackets: int = 1
    """ASHA brackets; 1 is plain asynchronous successive halving."""

    def __post_init__(self) -> None:
        _check(self.grace_period > 0, "tune.asha.grace_period", "a positive int", self.grace_period)
        _check(self.reduction_factor > 1, "tune.asha.reduction_factor", "a number > 1", self.reduction_factor)
        _check(self.max_t is None or self.max_t > self.grace_period, "tune.asha.max_t",
               f"null or an int > grace_period ({self.grace_period})", self.max_t)
        _check(self.brackets > 0, "tune.asha.brackets", "a positive int", self.brackets)


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneConfig:
    strategies: tuple[str, ...] = ("pad", "flatten", "bfd", "balanced")
    """Packing strategies to sweep (names of raypack.data.strategies.STRATEGIES)."""
    strategy_space: Literal["grid", "choice"] = "grid"
    """`grid`: every strategy, once per sample; `choice`: each sample draws one."""
    budgets: tuple[int, ...] = ()
    """Pack budgets to sweep; empty keeps `pack.budget`."""
    budget_space: Literal["grid", "choice"] = "grid"
    """`grid` or `choice` over `budgets`, as for strategies."""
    lrs: tuple[float, ...] = ()
    """Learning rates: the values for `grid` / `choice`, or [low, high] for `loguniform`; empty keeps `train.lr`."""
    lr_space: Literal["grid", "choice", "loguniform"] = "grid"
    """How `lrs` is searched; `loguniform` draws from [low, high] on a log scale."""
    num_samples: int = 1
    """Tune's num_samples: the grid runs this many times, and random dimensions are drawn this many
    times. Repeats of one grid point give the run-to-run spread (median and range in the table)."""
    metric: str = "loss"
    """Reported metric that the scheduler and search algorithm rank trials by (e.g. loss, eval_loss)."""
    mode: Literal["min", "max"] = "min"
    """Whether lower or higher `metric` is better."""
    scheduler: Literal["none", "asha"] = "none"
    """`asha` stops weak trials early (asynchronous successive halving, options under `asha`)."""
    asha: AshaConfig = field(default_factory=AshaConfig)
    """Options of `scheduler: asha`."""
    search_alg: Literal["basic", "optuna"] = "basic"
    """`basic`: grid plus seeded random draws (Ray's BasicVariantGenerator); `optuna`: Optuna's TPE
    (pip install 'raypack[optuna]'; every swept dimension must then be `choice` or `loguniform`)."""
    seed: int = 0
    """Seed of the random draws, so a sweep (and its resume) draws the same trials."""
    equal_work: Literal["tokens_per_step", "none"] = "tokens_per_step"
    """`tokens_per_step`: pad / pad_sorted / flatten take budget / mean example length examples per
    micro-batch, so every trial's optimizer step holds about budget x ranks x grad_accum real
    tokens and the trials take about as many steps; `none`: `pack.batch_size` as configured."""
    target_eval_loss: float | None = None
    """Eval loss that "time to target" counts to; None: the worst final eval loss of the trials that ran to the end."""
    max_concurrent_trials: int = 1
    """Trials run at once; each is a full Ray Train run."""

    def __post_init__(self) -> None:
        _check(len(self.strategies) > 0, "tune.strategies", "at least one strategy", self.strategies)
        _check(self.max_concurrent_trials > 0, "tune.max_concurrent_trials", "a positive int", self.max_concurrent_trials)
        _check(self.num_samples > 0, "tune.num_samples", "a positive int", self.num_samples)
        _check(all(b > 0 for b in self.budgets), "tune.budgets", "positive ints", self.budgets)
        _check(all(lr > 0 for lr in self.lrs), "tune.lrs", "positive numbers", self.lrs)
        if self.lr_space == "loguniform":
            _check(len(self.lrs) == 2 and self.lrs[0] < self.lrs[1], "tune.lrs",
                   "[low, high] with low < high for lr_space: loguniform", self.lrs)
        _check(self.target_eval_loss is None or self.target_eval_loss > 0, "tune.target_eval_loss",
               "null or a positive number", self.target_eval_loss)
        if self.search_alg == "optuna":
            # Optuna samples every dimension itself; Tune's grid_search is not one it can take.
            for name, values, space in (("strategy", self.strategies, self.strategy_space),
                                        ("budget", self.budgets, self.budget_space), ("lr", self.lrs, self.lr_space)):
                _check(len(values) <= 1 or space != "grid", f"tune.{name}_space",
                       "choice (or loguniform for lr) with search_alg: optuna, which cannot search a grid", space)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    @property
    def max_length(self) -> int:
        """Longest example, in tokens, that tokenize keeps whole: `tokenize.max_length` or `pack.budget`."""
        return self.tokenize.max_length or self.pack.budget

    def to_dict(self) -> dict[str, Any]:
        """Plain data, every value in its field's type: what is saved, hashed and sent to workers."""
        return plain(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> Config:
        try:
            return build(cls, raw, "")
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file (or the defaults when `path` is None) and apply `a.b=value` overrides."""
    if not path:
        return loads("", overrides, "<defaults>")
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    return loads(text, overrides, str(path))


def loads(text: str, overrides: Sequence[str] = (), source: str = "<string>") -> Config:
    """A config from YAML text (e.g. a run's saved raypack_config.yaml); `source` names it in errors."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. train.lr=2e-5")
        *parents, name = key.split(".")  # tune.asha.grace_period reaches a nested section
        node = raw
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {'.'.join(parents[: i + 1])}: expected a mapping")
        node[name] = yaml.safe_load(value)
        source = f"{source} (with overrides)" if "overrides" not in source else source
    return Config.from_dict(raw, source)


def dumps(cfg: Config) -> str:
    """YAML that `loads` reads back into an equal config, field for field and type for type."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
