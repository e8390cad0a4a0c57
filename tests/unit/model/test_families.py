"""Every model family raypack is tried on: exact on packed rows, or refused before training.

For each row a tiny model (hidden 64, 2-6 layers) is built from a config, in the layer layout of
the family's published checkpoints (raypack/model/family_table.py gives each layout's source).
Rows raypack accepts must give, through its exact CPU path (`attention='sdpa_varlen'`) on two
packed rows, the same logits, summed loss and every parameter gradient as each example run alone
under transformers' own `eager` attention with the same weights, within 1e-5 relative in fp32
(the packed and unpacked sums run in different orders), or a row's own bound where rounding is
shown to be the cause (the gated delta rule's A_log: tests/families.py's comments).
Families with a trait raypack can't keep exact must raise UnsupportedModelError naming it, on
the driver's meta-device check and in load_model; for those, the same comparison with the check
bypassed shows the trait really mixes examples, so no refusal here is spurious.

Windows (8) and chunks (8) are shorter than the examples (up to 21 tokens). Models run in eval
mode: MoE routers with jitter or sampling in training mode draw per token, which no two runs
share. Routers pick experts per token here (no capacity, no token dropping), so packing can't
change routing; the router loss is checked per family in tests/unit/train/objectives/test_router_loss.py.

The rows are the supported-models table's (raypack/model/family_table.py, imported through
tests/families.py), which docs/reference/models.md shows; to check a family a newer transformers
adds, add a row there.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import saved_config
from exactness import AS_CLOSE, off_float64, packed_vs_alone, random_lora_b
from families import FAMILIES, HYBRID
from transformers import AutoModelForCausalLM

from raypack.config import PeftConfig
from raypack.model.adapters import apply_adapters
from raypack.model import mixers
from raypack.model.attention import NAMES, attn_implementation_name
from raypack.model.build import UnsupportedModelError, check_model, load_model, meta_model
from raypack.model.traits import decoder


pytestmark = pytest.mark.usefixtures("one_thread")


def _packed_model(config):
    """The family under raypack's exact path with no check: what a packed run would compute
    (the mixers raypack knows installed, as load_model installs them)."""
    attn_implementation_name("sdpa_varlen")  # registers it
    # built with eager and renamed after: transformers refuses a registered name at build for
    # classes that don't declare `_supports_attention_backend` (most hybrids)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    model.config._attn_implementation = NAMES["sdpa_varlen"]
    mixers.install(decoder(model))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_or_refused(family):
    spec = FAMILIES[family]
    config = spec.build_config(family)
    torch.manual_seed(0)
    if spec.refused:
        with pytest.raises(UnsupportedModelError, match=spec.refused):
            check_model(config, attention="auto", device_type="cpu")
        with pytest.raises(UnsupportedModelError, match=r"\(pad or pad_sorted\)"):
            load_model(config, attention="sdpa_varlen", dtype="float32")
        if spec.mixes:
            model = _packed_model(config)
            ref = load_model(config, attention="eager", dtype="float32").eval()
            ref.load_state_dict(model.state_dict())
            assert packed_vs_alone(model, ref)["logits"] > 1e-3, "refused, yet packing looks exact"
        return

    source = config
    if mixers.find(decoder(meta_model(config))):
        # a hybrid from a saved (fp32) folder, as users load theirs: from_pretrained, which
        # kernelizes where the kernels package is installed and from_config never does
        source = str(saved_config(config, family, dtype=torch.float32))
    model = load_model(source, attention="sdpa_varlen", dtype="float32").eval()
    assert model.config._attn_implementation == NAMES["sdpa_varlen"]
    ref = load_model(source, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    if errors[worst] >= spec.tolerance and worst.startswith("grad:"):
        # fp32 rounding alone can exceed the row's bound on another CPU's kernels (DiffLlama's
        # lambdas: 1.7e-5 on an AVX-512 EPYC, under 1e-5 elsewhere): then the packed row must be
        # as close to the examples' float64 value as they are alone in fp32 (exactness.AS_CLOSE)
        packed, alone = off_float64(model, ref)
        assert packed < AS_CLOSE * max(alone, spec.tolerance), f"{family}: {worst} off by {errors[worst]:.2e}, " \
            f"{packed:.2e} off float64 where the examples alone are {alone:.2e} (all: {errors})"
    else:
        assert errors[worst] < spec.tolerance, f"{family}: {worst} off by {errors[worst]:.2e} (all: {errors})"
    assert any(k.startswith("grad:") for k in errors)


def test_the_docs_count_the_families_checked_here(monkeypatch):
    """docs/concepts/exactness.md says how many rows and families this file checks, and the README
    how many attention families: kept true as rows are added. exactness.md counts the lock's
    transformers (a row's verdict may change with the version: `mamba2`), checked on that one."""
    root = Path(__file__).parents[3]
    attention = {spec.module_name(key) for key, spec in FAMILIES.items()
                 if not spec.refused and spec.split_refused != HYBRID["split_refused"]}  # fmt: skip
    assert f"| attention, dense and MoE | {len(attention)} families: " in (root / "README.md").read_text()
    monkeypatch.syspath_prepend(str(root / "docker"))
    from check_image import pins  # the lock's pins, as the image build reads them

    lock = pins()["transformers"]
    if transformers.__version__ != lock:
        pytest.skip(f"exactness.md counts the rows on the lock's transformers {lock}, not {transformers.__version__}")
    text = " ".join((root / "docs/concepts/exactness.md").read_text().split())
    refused = sum(1 for spec in FAMILIES.values() if spec.refused)
    families = {spec.module_name(key) for key, spec in FAMILIES.items()}
    claim = (f"checks {len(FAMILIES)} layouts of {len(families)} families of transformers {lock}, the lock's "
             f"({len(FAMILIES) - refused} exact, {refused} refused")
    assert claim in text


LORA = PeftConfig(method="lora", r=4, alpha=8, target_modules=("all-linear",))


def _with_random_adapters(model):
    """`model` with LoRA on every linear layer but the head, B random: peft starts B at zero, and
    with B = 0 every lora_A gradient is zero, which any path would match."""
    return random_lora_b(apply_adapters(model, LORA))


@pytest.mark.parametrize("family", [f for f, spec in FAMILIES.items() if not spec.refused])
def test_family_with_lora_is_exact(family):
    """LoRA on attention and MLP projections: every adapter gradient packed equals the gradient of
    the same examples run alone, and the base weights get none."""
    spec = FAMILIES[family]
    config = spec.build_config(family)
    torch.manual_seed(0)
    model = _with_random_adapters(load_model(config, attention="sdpa_varlen", dtype="float32")).eval()
    ref = apply_adapters(load_model(config, attention="eager", dtype="float32"), LORA).eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < spec.tolerance, f"{family} + LoRA: {worst} off by {errors[worst]:.2e}"
    graded = {k.removeprefix("grad:") for k in errors if k.startswith("grad:")}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    # every adapter the examples alone reach (Zamba 2's shared blocks keep a slot per hybrid
    # layer; a block's copy in another layer never calls it), and nothing else
    reached = {n for n, p in ref.named_parameters() if p.grad is not None}
    assert graded == reached <= adapters and any("lora_A" in n for n in graded), f"{family}: gradients reached {graded - adapters}"
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
