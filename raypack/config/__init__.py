"""Typed run configuration: one frozen dataclass per component, loaded from YAML.

The sections are declared in `sections.py` (data, tokenize, pack, model and its adapters, train,
run) and `sweep.py` (tune); this module assembles them into `Config` and reads and writes YAML.

    cfg = load("jobs/configs/tiny_cpu.yaml", ["train.lr=2e-5", "pack.strategy=bfd"])
    cfg = loads(dumps(cfg))                 # a run saves its config as YAML and resumes from it

Every field has a type and a docstring. `load` checks the YAML against the dataclasses
(raypack/typed.py), so an unknown key, a wrong type or an out-of-range value fails before any Ray
work starts, with an error that names the key, the expected form and the file. `to_dict()` turns
a config into plain data, each value in its field's type, so that it can be saved, hashed, travel
as Ray Train's `train_loop_config` and be logged, and reload to an equal config.

What needs another module's registry is checked there, on the loaded config: strategy names and
traits by `raypack.data.strategies.check_strategies` (the command line runs it right after
`load`, and preflight before every run). This package imports nothing from raypack but the errors
and the typed loader, so every module can import it.

Paths: a local path is relative to the working folder, except `raypack/assets/...`, which names
the bundled assets wherever raypack is installed. A run saves its config with every path made
absolute (raypack/runs.py), so resuming it does not depend on where you stand.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raypack.errors import ConfigError
from raypack.typed import build, check as _check, plain, unused
from raypack.config.sections import (
    ASSETS, ASSETS_PREFIX, DataConfig, ModelConfig, PackConfig, PeftConfig, RunConfig, SourceConfig, TokenizeConfig,
    TrainConfig, WandbConfig,
)
from raypack.config.dpo import DpoConfig, check_objective
from raypack.config.sweep import AshaConfig, TuneConfig

__all__ = [
    "ASSETS", "ASSETS_PREFIX", "AshaConfig", "Config", "DataConfig", "DpoConfig", "ModelConfig", "PackConfig", "PeftConfig",
    "RunConfig", "SourceConfig", "TokenizeConfig", "TrainConfig", "TuneConfig", "WandbConfig", "dumps", "load", "loads",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Where the examples come from, their format, bad rows and the eval split."""
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    """Tokenizer, chat template, which tokens carry loss, and what happens to over-long examples."""
    pack: PackConfig = field(default_factory=PackConfig)
    """How examples share packed rows: the strategy, the row budget in tokens, the plan's seed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model, its attention backend, dtype, recompute, kernels and adapters."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Ray Train and DeepSpeed: workers, ZeRO stage, optimizer, loss, schedule, checkpoints, reports."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run's name, where its results go, and Weights & Biases."""
    tune: TuneConfig = field(default_factory=TuneConfig)
    """`raypack sweep` only: what a Ray Tune sweep searches, and how it ranks and stops trials."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """`train.objective: dpo` only: preference tuning's loss and its reference model."""

    def __post_init__(self) -> None:
        check_objective(self)  # train.objective: dpo and what it needs of the other sections
        # What one section can't check alone. QLoRA's 4-bit weights are bitsandbytes CUDA tensors,
        # and ZeRO-3 would partition them as if they were ordinary weights.
        if self.model.peft.method == "qlora":
            _check(self.train.use_gpu, "model.peft.method", "lora or none without train.use_gpu (qlora's 4-bit "
                   "weights need CUDA)", "qlora")
            _check(self.train.zero_stage < 3, "model.peft.method", "lora or none with train.zero_stage 3 (qlora "
                   "runs under ZeRO 0-2: its frozen 4-bit weights are not partitioned)", "qlora")
            # FSDP2 would shard bitsandbytes' packed 4-bit weights as if they were plain tensors
            _check(self.train.engine == "deepspeed" or self.train.zero_stage == 0, "model.peft.method",
                   "lora or none with train.engine torch and train.zero_stage 1-3 (qlora's 4-bit weights can't "
                   "be FSDP2-sharded; use zero_stage 0, DDP, or train.engine deepspeed)", "qlora")
        # Selective checkpointing replays its cache in the recompute by the order of the ops, and ZeRO-3's
        # gathers in the recompute are not the forward's (seen: "_allgather_base_ ... not found in storage").
        # FSDP2's gathers happen outside the layer's ops, so the torch engine takes it at zero_stage 3
        # (tests/ray/train/test_loop.py, torch3-llama-selective).
        _check(self.model.gradient_checkpointing != "selective" or self.train.zero_stage < 3
               or self.train.engine == "torch", "model.gradient_checkpointing",
               "full, none or auto with train.engine deepspeed and train.zero_stage 3", "selective")

        # DeepSpeed without ZeRO steps bf16 weights through its fp16 optimizer (FP16_UnfusedOptimizer,
        # a dynamic loss scale), not ZeRO's fp32 master copy: from the same bf16 folder and batches its
        # first update came out smaller than ZeRO 1-3's and the torch engine's (step 2's loss 4.386
        # against 4.338: tests/ray/train/test_matrix.py). Refused until that is understood.
        bf16_compute = self.model.dtype == "bfloat16" or (self.model.dtype == "auto" and self.train.use_gpu)
        _check(self.train.engine != "deepspeed" or self.train.zero_stage > 0 or not bf16_compute,
               "train.zero_stage", "1-3 with train.engine deepspeed and bf16 compute (model.dtype bfloat16, or auto "
               "on GPUs): DeepSpeed's ZeRO-0 steps bf16 weights through its fp16 optimizer, whose updates differ from "
               "ZeRO 1-3's; zero_stage 1 keeps the weights replicated and shards only the optimizer state, or use "
               "train.engine torch (DDP at zero_stage 0)", 0)
        # train.precision bf16 keeps the weights in bf16: a float32 or float16 model can't.
        _check(self.train.precision != "bf16" or self.model.dtype in ("auto", "bfloat16"), "model.dtype",
               "auto or bfloat16 with train.precision: bf16", self.model.dtype)

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
        return _build({}, overrides, "<defaults>")
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file{_yaml_files_in(Path(path))}") from None
    # An unreadable or binary file is a wrong path like a missing one: one line, not a traceback.
    except UnicodeDecodeError as e:
        byte = f"byte {e.object[e.start]:#04x} at offset {e.start}"
        raise ConfigError(f"{path}: not a text file ({byte} is not UTF-8)") from None
    except OSError as e:
        raise ConfigError(f"{path}: can't read the config file ({e.strerror or e})") from None
    return loads(text, overrides, str(path))


def _yaml_files_in(folder: Path, shown: int = 5) -> str:
    """The YAML files a folder holds, as a hint for a folder given where a config file was meant."""
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml"))
    if not names:
        return ""
    return f"; its YAML files: {', '.join(names[:shown])}{', ...' if len(names) > shown else ''}"


def loads(text: str, overrides: Sequence[str] = (), source: str = "<string>", *, saved: bool = False) -> Config:
    """A config from YAML text (e.g. a run's saved raypack_config.yaml); `source` names it in errors.
    `saved`: a config raypack wrote, every field spelled out, so a section that is off is refused
    for the settings the overrides give it only (see `unused`)."""
    try:
        raw = yaml.load(text, Loader=_UniqueKeys)
    except _DuplicateKey as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if raw is None:  # an empty file, or only comments: not a config that means the defaults
        raise ConfigError(f"{source}: the config is empty; expected a mapping of sections (data:, model:, train:, "
                          "...), or no --config for the defaults")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return _build(raw, overrides, source, saved)


def _build(raw: dict[str, Any], overrides: Sequence[str], source: str, saved: bool = False) -> Config:
    """The Config of `raw` with `overrides` applied; an error names the override that holds the
    bad value when one does, else `source` (the file)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. train.lr=2e-5")
        *parents, name = key.split(".")  # tune.asha.grace_period reaches a nested section
        node = raw
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{blame(item, overrides, source)}: {'.'.join(parents[: i + 1])}: expected a mapping")
        node[name] = yaml.safe_load(value)
    try:
        cfg = build(Config, raw, "")
        # Settings of a section that is switched off would do nothing: say so instead.
        off = [name for name in unused(cfg)
               if not saved or any(name == k or name.startswith(k + ".") for k in _keys(overrides))]
        if off:
            raise ConfigError(f"{off[0]}: {unused(cfg)[off[0]]}")
    except ConfigError as e:
        raise ConfigError(f"{blame(str(e), overrides, source)}: {e}{_see_reference(str(e))}") from None
    return cfg


def _see_reference(message: str) -> str:
    """For an unknown key, where the section's real fields are documented at the terminal."""
    key, _, rest = message.partition(":")
    if not rest.startswith(" unknown key"):
        return ""
    section = re.sub(r"\[\d+\]", "", key.rsplit(".", 1)[0]) if "." in key else ""  # data.sources[1]: a list's item
    return f" (`raypack config {section}` lists them)" if section else " (`raypack config` lists every section)"


def blame(message: str, overrides: Sequence[str], source: str) -> str:
    """Where an error about `message`'s key comes from: `override KEY=VALUE` when the last
    override of that key (or of a field inside it) set it, else `source` (the config file)."""
    lead = message.split(":", 1)[0].split("=", 1)[0]
    for item, key in reversed(list(zip(overrides, _keys(overrides)))):
        if lead == key or lead.startswith((f"{key}[", f"{key}.")):
            return f"override {item}"
    return f"{source} (with overrides)" if overrides and source != "<defaults>" else source


def _keys(overrides: Sequence[str]) -> list[str]:
    return [item.partition("=")[0] for item in overrides]


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently: a section written twice would lose the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden, as YAML says
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                continue  # PyYAML's own error says what is wrong with such a key
            if key in seen:
                raise _DuplicateKey(f"line {line}: key {key!r} given twice (first on line {seen[key]}); YAML keeps "
                                    "only the last, so merge the two")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def dumps(cfg: Config) -> str:
    """YAML that `loads` reads back into an equal config, field for field and type for type."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
