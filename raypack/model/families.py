"""The supported-models table: every model family raypack's tests try, each at tiny sizes in the
layer layouts its published checkpoints use, exact on packed rows or refused naming the trait.

One table, three readers:

    tests/unit/model/test_families.py    and every test parametrized by family (LoRA, DPO,
                                         checkpointing, the router loss, sequence parallelism):
                                         each row packed against each example run alone
    tools/docs_hooks.py                  docs/reference/models.md, generated at `make docs`:
                                         every row, its verdict as raypack prints it, the modes
                                         those tests check, the CUDA kernels it would use
    raypack plan                         which rows a configured model's class has (`rows_for`)

A row is a transformers config class and what it needs beyond the shared tiny sizes (`COMMON`):
its layout (which layers are attention, a recurrence, an MLP or an MoE, shared experts, dense
first layers, tied embeddings) and where that layout comes from. The rows are in
raypack/model/family_table.py; to check a family a newer transformers adds, add one there.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import transformers

TOLERANCE = 1e-5
"""The largest relative error accepted between a packed row and its examples alone (fp32)."""

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    initializer_range=0.1, use_cache=False,
)  # fmt: skip
"""Sizes every family gets; a family's row overrides them (None drops a key its config lacks)."""


@dataclass(frozen=True)
class Family:
    config: str
    """The transformers config class."""
    overrides: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    """None: must be exact. Else a regex the refusal must match (the trait it names)."""
    mixes: bool = True
    """For a refused family: show, with the check bypassed, that packing really is wrong."""
    module: str | None = None
    """transformers.models.<module>, when it isn't the row's id before any `-<layout>`."""
    split_refused: str | None = None
    """For a family that packs exactly: a regex the refusal of train.sequence_parallel > 1 must match."""
    tolerance: float = TOLERANCE
    """The largest relative error accepted; above TOLERANCE only where rounding is shown to be the cause."""
    layout: str = ""
    """The layer layout the row builds, in words (the supported-models page's)."""
    source: str = ""
    """Where that layout comes from: the config class's defaults (which transformers documents as a
    checkpoint's), a model card, or why the row is no published layout."""

    def module_name(self, key: str) -> str:
        return self.module or key.split("-")[0]

    def build_config(self, key: str):
        module = importlib.import_module(f"transformers.models.{self.module_name(key)}")
        cls = getattr(transformers, self.config, None) or getattr(module, self.config)
        kwargs = {**COMMON, **self.overrides}
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def table() -> dict[str, Family]:
    from raypack.model.family_table import FAMILIES

    return FAMILIES


def exact() -> list[str]:
    """Rows that must pack exactly: every mode below runs on them."""
    return [key for key, spec in table().items() if not spec.refused]


def with_routers() -> list[str]:
    """Exact rows whose model builds MoE routers: the router loss is checked on them
    (tests/unit/train/test_router_loss.py, tests/unit/model/test_routers.py)."""
    from raypack.model.build import meta_model
    from raypack.model.routers import builds_routers

    return [key for key in exact() if builds_routers(meta_model(table()[key].build_config(key)))]


def modes(key: str, routers: bool) -> list[str]:
    """What the tests check on row `key` (routers: whether its model builds MoE routers)."""
    spec = table()[key]
    if spec.refused:
        return ["refused on the driver and on the worker"] + (["the leak shown with the check bypassed"]
                                                               if spec.mixes else [])  # fmt: skip
    out = ["packed", "LoRA", "checkpointing", "DPO"] + (["router loss"] if routers else [])
    return out + ["sequence parallel refused" if spec.split_refused else "sequence parallel (2, 4 ranks)"]


def rows_for(config) -> list[str]:
    """The rows built from `config`'s class (its text config's, for a vision-language model)."""
    names = {type(config).__name__}
    text = getattr(config, "get_text_config", lambda: config)()
    names.add(type(text).__name__)
    return [key for key, spec in table().items() if spec.config in names]
