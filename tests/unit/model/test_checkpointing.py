"""raypack/model/checkpointing.py: model.gradient_checkpointing's modes are exact (packed rows
against each example alone, every family that packs; with LoRA) and recompute what they say:
selective no matmul and no attention, full all of them, none nothing."""

from __future__ import annotations

import pytest
import torch
from exactness import packed_vs_alone, random_lora_b
from families import FAMILIES, exact
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from raypack.config import PeftConfig, load
from raypack.errors import ConfigError
from raypack.model import checkpointing
from raypack.model.adapters import apply_adapters
from raypack.model.build import load_model
from raypack.model.kernels import decoder_layers
from raypack.model.traits import UnsupportedModelError
from raypack.train.objectives.loss import probe_batch


pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpointed(model):
    """`model` in eval mode (no dropout, no router jitter: two runs must compute one function)
    with its decoder layers alone in training mode, which is when transformers checkpoints them."""
    model.eval()
    for layer in decoder_layers(model, "test"):
        layer.training = True
    return model


PACKED = exact()
WRITES_INTO_KEPT = {"gemma3n", "llama4"}
"""Families (by model type) that add or multiply in place into a matmul's output (checkpointing.survey)."""


def _probe(config) -> dict:
    return {k: v for k, v in probe_batch(config.vocab_size, padded=False).items() if k != "labels"}


@pytest.mark.parametrize("family", PACKED)
def test_selective_checkpointing_is_exact_or_replaced(family):
    """Every family that packs: exact under selective, or found at setup writing into a kept
    output, refused when selective was asked for and run under full when auto chose it."""
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    model = _checkpointed(load_model(config, attention="sdpa_varlen", dtype="float32", gradient_checkpointing="selective"))
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    if family.split("-")[0] in WRITES_INTO_KEPT:
        with pytest.raises(UnsupportedModelError, match="selective is not exact.*writes in place.*set it to full"):
            checkpointing.check_selective(model, _probe(config), "selective")
        assert checkpointing.check_selective(model, _probe(config), "auto")[0] == "full"
        _checkpointed(model)
    assert checkpointing.check_selective(model, _probe(config), "auto") == (checkpointing.active_mode(model), None)
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < FAMILIES[family].tolerance, f"{family} {checkpointing.active_mode(model)}: {worst} off by {errors[worst]:.2e}"


def test_a_write_into_a_kept_output_really_breaks_selective():
    """Gemma 3n's AltUp adds in place into a matmul's output: run selective anyway, and the
    gradients are wrong, so refusing it is not overcautious."""
    config = FAMILIES["gemma3n"].build_config("gemma3n")
    torch.manual_seed(0)
    model = _checkpointed(load_model(config, attention="sdpa_varlen", dtype="float32", gradient_checkpointing="selective"))
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    assert max(packed_vs_alone(model, ref).values()) > 1e-2


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "qwen3_5", "nemotron_h", "lfm2"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_with_lora_is_exact(family, mode):
    """Exact with LoRA, selective as the setup enables it (check_selective: the adapters' folds
    into the weights recomputed, which peft 0.22 scales in place), never refused."""
    lora = PeftConfig(method="lora", r=4, alpha=8)
    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    model = random_lora_b(apply_adapters(load_model(config, attention="sdpa_varlen", dtype="float32",
                                                    gradient_checkpointing=mode), lora))  # fmt: skip
    assert checkpointing.check_selective(model, _probe(config), mode) == (mode, None)
    _checkpointed(model)
    ref = apply_adapters(load_model(config, attention="eager", dtype="float32"), lora).eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < FAMILIES[family].tolerance, f"{family} + LoRA, {mode}: {worst} off by {errors[worst]:.2e}"
    assert any("lora_A" in k for k in errors)


class _Count(TorchDispatchMode):
    """Counts the ops in SAVED (matmuls, attention) that run, by name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in checkpointing.SAVED:
            self.counts[func.name()] = self.counts.get(func.name(), 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = _checkpointed(load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", vocab_size=256,
                                     gradient_checkpointing=mode))  # fmt: skip
    ids = torch.randint(3, 256, (1, 24))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    out = model(input_ids=ids, position_ids=torch.cat([torch.arange(10), torch.arange(14)])[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    with _Count() as count:
        out.logits.sum().backward()
    return count.counts


def test_each_mode_recomputes_what_it_says():
    """In backward, each linear runs two matmuls (its input's and its weight's gradient) and the
    attention its backward op; a recomputed forward adds one matmul per linear and one attention
    per layer, less the last linear (down_proj): the recompute stops once everything the
    backward needs is back (torch's early stop), and no backward needs down_proj's output.
    Selective keeps those outputs, so its backward runs what none's does."""
    none, selective, full = (_backward_ops(mode) for mode in ("none", "selective", "full"))
    layers, linears = 2, 7  # tiny-llama: q, k, v, o, gate, up, down a layer
    assert selective == none
    assert full["raypack::exact_varlen"] - none.get("raypack::exact_varlen", 0) == layers
    matmuls = sum(n for op, n in full.items() if "mm" in op) - sum(n for op, n in none.items() if "mm" in op)
    assert matmuls == layers * (linears - 1)


class _Kept(TorchDispatchMode):
    """The bytes of the outputs `checkpointing.policy` keeps, given `products`."""

    def __init__(self, products):
        super().__init__()
        self.products, self.bytes = products, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if checkpointing.policy(self.products, None, func, *args) == CheckpointPolicy.MUST_SAVE:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.bytes += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out


def test_selective_keeps_no_fold_of_an_adapter_into_the_experts():
    """peft's LoRA on an MoE's experts folds each adapter into its expert stack every forward (a
    baddbmm the size of the stack). Selective as the setup enables it recomputes those folds:
    what it keeps is the activations alone, twice as much for twice the tokens, where keeping
    the folds too adds a second copy of every layer's experts."""
    config = FAMILIES["qwen3_moe"].build_config("qwen3_moe")
    torch.manual_seed(0)
    model = apply_adapters(load_model(config, attention="sdpa_varlen", dtype="float32"),
                           PeftConfig(method="lora", r=4, alpha=8)).eval()  # fmt: skip
    found = checkpointing.survey(model, _probe(config))
    assert found.hazard is None and {op for op, _ in found.weight_products} >= {"aten::baddbmm"}
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n)

    def kept(products, tokens: int) -> int:
        ids = torch.randint(3, config.vocab_size, (1, tokens))
        cu = torch.tensor([0, tokens], dtype=torch.int32)
        with torch.no_grad(), _Kept(products) as mode:
            model(input_ids=ids, position_ids=torch.arange(tokens)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=tokens, max_length_k=tokens)  # fmt: skip
        return mode.bytes

    assert kept(found.weight_products, 32) == 2 * kept(found.weight_products, 16)
    folds = kept(frozenset(), 16) - kept(found.weight_products, 16)
    assert experts and folds >= experts and kept(frozenset(), 32) - kept(found.weight_products, 32) == folds


def test_the_setting_accepts_the_former_booleans_and_refuses_what_it_cannot_do():
    assert load(None, []).model.gradient_checkpointing == "auto"
    assert load(None, ["model.gradient_checkpointing=true"]).model.gradient_checkpointing == "full"
    assert load(None, ["model.gradient_checkpointing=false"]).model.gradient_checkpointing == "none"
    with pytest.raises(ConfigError, match="expected one of 'auto', 'full', 'selective', 'none' or true or false"):
        load(None, ["model.gradient_checkpointing=some"])
    with pytest.raises(ConfigError, match="model.offload_checkpoints: expected false unless .* is full"):
        load(None, ["model.offload_checkpoints=true", "model.gradient_checkpointing=selective"])
    with pytest.raises(ConfigError, match="model.gradient_checkpointing: expected full, none or auto with "
                                          "model.tiled_mlp_tokens"):  # fmt: skip
        load(None, ["model.tiled_mlp_tokens=64", "model.gradient_checkpointing=selective"])
    assert load(None, ["model.offload_checkpoints=true", "model.gradient_checkpointing=true"]).model.offload_checkpoints
    # DeepSpeed ZeRO-3's gathers differ between forward and recompute, which selective's cache
    # replays by order; FSDP2's happen outside the layer's ops (the torch engine takes it)
    with pytest.raises(ConfigError, match="model.gradient_checkpointing: expected full, none or auto with "
                                          "train.engine deepspeed and train.zero_stage 3"):
        load(None, ["train.zero_stage=3", "model.gradient_checkpointing=selective"])
    assert load(None, ["train.engine=torch", "train.zero_stage=3", "model.gradient_checkpointing=selective"])
