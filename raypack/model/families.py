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

from dataclasses import dataclass

import transformers

from raypack.model.family_table import COMMON, FAMILIES, TOLERANCE, Family  # noqa: F401 (the table's record)


def table() -> dict[str, Family]:
    return FAMILIES


def exact() -> list[str]:
    """Rows that must pack exactly: every mode below runs on them."""
    return [key for key, spec in table().items() if not spec.refused]


def with_routers() -> list[str]:
    """Exact rows whose model builds MoE routers: the router loss is checked on them
    (tests/unit/train/objectives/test_router_loss.py, tests/unit/model/test_routers.py)."""
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
    from raypack.model.facts import text_config

    names = {type(config).__name__, type(text_config(config)).__name__}
    return [key for key, spec in table().items() if spec.config in names]


PAGE = "docs/reference/models.md"
"""The supported-models page, generated from this table at `make docs` (tools/docs_hooks.py)."""


def describe(config) -> str:
    """`raypack plan`'s line for a model: the table's rows for its class, and what they say."""
    rows = rows_for(config)
    name, version = type(config).__name__, transformers.__version__
    if not rows:
        return (f"supported models: no row for {name} in raypack's table ({PAGE}): not among the families its "
                f"tests check at transformers {version}; the checks before training still apply")
    specs = [table()[key] for key in rows]
    refused = sum(1 for spec in specs if spec.refused)
    verdict = ("exact" if not refused else "refused" if refused == len(rows) else f"{len(rows) - refused} exact, "
               f"{refused} refused")  # fmt: skip
    listed = "; ".join(f"{key}{' (refused)' if spec.refused and refused < len(rows) else ''}"
                       f"{': ' + spec.layout if spec.layout else ''}" for key, spec in zip(rows, specs))  # fmt: skip
    return (f"supported models ({PAGE}): {name}, {len(rows)} row{'s' if len(rows) > 1 else ''}, {verdict} in "
            f"raypack's tests at transformers {version}: {listed}")


@dataclass(frozen=True)
class Checked:
    """A row as the supported-models page shows it, worked out from the model it builds."""

    key: str
    spec: Family
    refusal: str | None
    """None where raypack accepts it; else the refusal, as raypack prints it (its CPU check)."""
    modes: list[str]
    cuda: str
    """What it runs on CUDA: the attention kernels that keep it exact, its mixers' kernels."""


def checked() -> list[Checked]:
    """Every row, its model built on the meta device (no weights: seconds for the whole table)."""
    from raypack.errors import UnsupportedModelError
    from raypack.model import mixers
    from raypack.model.attention import candidate_backends
    from raypack.model.build import meta_model
    from raypack.model.routers import builds_routers
    from raypack.model.traits import backend_reasons, check_packable, decoder

    out = []
    for key, spec in table().items():
        model = meta_model(spec.build_config(key))
        try:  # what check_model runs on the driver for a causal LM, on this one build
            mixers.refuse_gpu_only_kernels(model, key, "cpu")
            check_packable(model, key, candidate_backends("auto", "cpu"))
            refusal = None
        except UnsupportedModelError as e:
            refusal = str(e)
        cuda = ""
        if refusal is None:
            kernels = [b for b in ("flash_attn", "torch_varlen") if not backend_reasons(model, b)]
            why = "; ".join(dict.fromkeys(r for b in ("flash_attn", "torch_varlen") for r in backend_reasons(model, b)))
            cuda = (f"attention: {' or '.join(kernels)}" if kernels else f"attention: sdpa_varlen only ({why})")
            kinds = {kind.name: kind.kernels for kind in mixers.find(decoder(model)).values()}
            cuda += "".join(f"; {name}: {kernels}" for name, kernels in kinds.items())
        out.append(Checked(key, spec, refusal, modes(key, refusal is None and builds_routers(model)), cuda))
    return out
