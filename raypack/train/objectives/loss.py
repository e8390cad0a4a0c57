"""The training loss, Σ cross-entropy over label tokens, computed from the final hidden states so
that the [T, V] logits never exist at once.

    loss = make_loss(engine, cfg.train, padded=data.padded)   # once at setup; probes the model
    loss_sum = loss(engine, batch)                           # batch: model kwargs + labels

`full` (the reference) takes the model's logits for every position, upcasts them to fp32 and
slices them: at 16k tokens and a 128k vocabulary that is 4 GB of bf16 logits, 8 GB of fp32 ones and
their gradients, more than a 1B model's weights and optimizer state together. `chunked` (the
default) asks the model for no logits at all:

    hidden [T, H] ──keep label positions──> [N, H] ──per chunk of C rows──> logits [C, V]
        ──> the model's own output transforms ──> fp32 cross-entropy ──> loss, dL/dhidden, dL/dW

Each chunk's gradients are taken at once, inside the forward, and held until backward scales them
(raypack/train/objectives/chunked_ce.py): no chunk's logits outlive it and nothing is recomputed, so the loss
costs O(C x V) memory and the same FLOPs as `full`.

Precision: the head's matmuls run in the engine's compute dtype, whatever dtype its weights are
kept in, as they would inside the model's forward: DeepSpeed's bf16 model is bf16 already, FSDP2
gathers its weights in bf16 (MixedPrecisionPolicy), and DDP's fp32 weights (precision mixed)
are cast once a call, as autocast casts them for the layers inside the forward. The
cross-entropy's log-softmax and its sums alone run in fp32 (chunked_ce.py says why).

How it reaches the hidden states: during the model's own forward its output-embeddings module is
swapped for a capture that records its input and returns empty logits; the loss then calls the
real head module once, with the chunked computation as its forward. Calling the module (not its
weight) is what lets DeepSpeed ZeRO-3 gather the partitioned weight for forward and backward and
reduce its gradient as for any layer; tied embeddings are one parameter, so their two gradients
add up as usual.

Exact, or refused: the transforms a model applies after its head are detected from its config
(Gemma 2/3 `final_logit_softcapping`, Granite `logits_scaling`, Cohere `logit_scale`) and applied
per chunk in the model's own dtype and order. `make_loss` then probes the model once: its own
logits on a few tokens against what the chunked path computes. Any other difference (a model
whose logits are not head(hidden) plus those transforms) stops the run before training, naming
`train.loss: full` as the way out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raypack.data.collate import collate_packed
from raypack.data.formats import IGNORE_INDEX
from raypack.errors import InputError
from raypack.model.adapters import adapted_head
from raypack.train.objectives.chunked_ce import Transform, cast, chunked_cross_entropy
# the chunk size is a memory budget: its home is the (torch-free) memory estimate
from raypack.train.memory.estimate import CHUNK_BYTES, CHUNK_TOKENS, default_chunk  # noqa: F401

LOSSES = ("chunked", "full", "liger")
TARGET_KEYS = ("loss_positions", "loss_targets")
"""Batch keys `label_targets` fills on the host; the loss pops them before the model's forward."""


class UnsupportedLossError(InputError):
    """The chunked loss cannot reproduce this model's logits; `train.loss: full` still works."""


# --- targets ------------------------------------------------------------------------------------


def label_targets(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Which hidden states carry loss, and their targets: position t predicts labels[t + 1].

    Returns flat indices into the [B * L] positions and the target ids, both int64. Call it on
    the host batch (the prefetcher does): on the device, finding them is a host sync."""
    labels = labels if labels.dim() == 2 else labels.reshape(1, -1)
    rows, cols = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    return {"loss_positions": rows * labels.shape[1] + cols, "loss_targets": labels[rows, cols + 1]}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The `full` loss: Σ cross-entropy over label tokens, predicting token t+1 from position t."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# --- the model's output head ------------------------------------------------------------------------

def output_transforms(config: Any) -> list[tuple[str, Transform]]:
    """What the model does to head(hidden) before returning logits, from its config, in the order
    transformers applies it (written as the model code writes it, so the rounding is the same)."""
    found: list[tuple[str, Transform]] = []
    if (divisor := getattr(config, "logits_scaling", None)) not in (None, 1, 1.0):  # Granite divides
        found.append((f"logits / {divisor} (logits_scaling)", lambda z: z / divisor))
    if (factor := getattr(config, "logit_scale", None)) not in (None, 1, 1.0):  # Cohere multiplies
        found.append((f"logits * {factor} (logit_scale)", lambda z: z * factor))
    if cap := getattr(config, "final_logit_softcapping", None):  # Gemma 2/3

        def softcap(z: torch.Tensor) -> torch.Tensor:
            return torch.tanh(z / cap) * cap

        found.append((f"tanh(logits / {cap}) * {cap} (final_logit_softcapping)", softcap))
    return found


def _compose(transforms: list[tuple[str, Transform]]) -> Transform:
    def apply(z: torch.Tensor) -> torch.Tensor:
        for _, fn in transforms:
            z = fn(z)
        return z

    return apply


class _Capture(nn.Module):
    """Stands in for the output head during the model's forward: keeps its input, computes nothing.
    It shows the head's `weight` and `bias` (not as its own parameters), which some forwards read
    around the call: Mamba2ForCausalLM casts the hidden states to `lm_head.weight.dtype`."""

    def __init__(self, head: nn.Module, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.inputs: list[torch.Tensor] = []
        self.__dict__["head"] = head  # not a submodule: the head's parameters stay the head's alone

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.head, "bias", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.inputs.append(hidden)
        # Empty logits of the right rank and vocabulary, so any post-processing the model does runs on nothing.
        return hidden.new_empty((*hidden.shape[:-2], 0, self.vocab))


def _find_parent(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, sub in module.named_children():
            if sub is child:
                return module, name
    raise UnsupportedLossError(f"{type(model).__name__}: its output embeddings are not a submodule")


@contextlib.contextmanager
def _forward_as(module: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Run `fn` as `module`'s forward: module hooks (DeepSpeed's gathers) still fire around it."""
    module.forward = fn
    try:
        yield
    finally:
        del module.forward


# --- the loss object ----------------------------------------------------------------------------


class CausalLMLoss:
    """Σ token cross-entropy of a batch, `chunked` (default) or `full`; see the module docstring.

    Built on the unwrapped model (`engine.module`) and called with whatever runs the forward (the
    DeepSpeed engine, or the model itself). `dtype` is the engine's compute dtype: the head's
    matmuls run in it whatever the weights' dtype (the torch engine's precision mixed keeps them
    in fp32 and runs the model's forward under autocast, which a head called after that forward
    is outside of); None: the head weight's own."""

    def __init__(self, model: nn.Module, kind: str = "chunked", chunk_tokens: int = 0,
                 dtype: torch.dtype | None = None) -> None:
        if kind not in LOSSES:
            raise ValueError(f"train.loss: expected one of {', '.join(LOSSES)}, got {kind!r}")
        self.kind = kind
        self.dtype = dtype
        self.model_name = type(model).__name__
        if kind == "full":
            return
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if adapted_head(model):
            # The chunked loss multiplies by the head's own weight; an adapter (or a trained copy
            # from modules_to_save) on the head would be left out of every logit.
            raise UnsupportedLossError(
                f"train.loss=chunked: model.peft puts an adapter on {self.model_name}'s output head "
                "(model.peft.target_modules or modules_to_save reaches it), and the chunked "
                "loss computes logits with the head's base weight only; set train.loss: full, or leave the head out"
            )
        if not isinstance(head, nn.Linear):
            raise UnsupportedLossError(
                f"train.loss=chunked: {self.model_name}'s output embeddings are "
                f"{type(head).__name__ if head is not None else 'missing'}, not a torch Linear layer, so the chunked "
                "loss cannot apply them piecewise; set train.loss: full"
            )
        self.head = head
        self.dtype = dtype or head.weight.dtype
        self.parent, self.attr = _find_parent(model, head)
        self.vocab = head.out_features
        self.transforms = output_transforms(model.config)
        self.transform = _compose(self.transforms)
        self.chunk = chunk_tokens or default_chunk(self.vocab)
        if kind == "liger":
            self.fused = _liger_loss(model.config, self.transforms, self.model_name)

    def __call__(self, forward: Callable[..., Any], batch: dict[str, Any]) -> torch.Tensor:
        """Σ cross-entropy (fp32 scalar) over the label tokens of `batch`, a collated batch with
        `labels` (and optionally `label_targets`' keys, found here otherwise)."""
        batch = dict(batch)
        labels = batch.pop("labels")
        targets = {k: batch.pop(k) for k in TARGET_KEYS if k in batch}
        if self.kind == "full":
            return token_loss_sum(forward(**batch).logits, labels)
        hidden = self.hidden_states(forward, batch)
        if hidden.shape[:-1] != labels.shape:
            raise UnsupportedLossError(
                f"train.loss=chunked: {self.model_name}'s output head saw hidden states of shape "
                f"{tuple(hidden.shape)} for labels of shape {tuple(labels.shape)}; set train.loss: full"
            )
        if len(targets) != len(TARGET_KEYS):
            targets = label_targets(labels)  # finds the positions on the device: a host sync
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets["loss_positions"])
        return self._call_head(selected, targets["loss_targets"])

    # --- as an optimizer step's objective (raypack/train/step.py): the mean over label tokens ------

    names: tuple[str, ...] = ()
    per = "label_tokens"

    def counts(self, step: Any) -> list[float]:
        return [step.label_tokens, step.tokens]

    def host(self, sums: list[float]) -> tuple[dict[str, float], None]:
        return {"label_tokens": sums[0], "tokens": sums[1]}, None

    def micro(self, forward: Callable[..., Any], batch: dict[str, Any], context: None, stats: list) -> torch.Tensor:
        return self(forward, batch)

    def hidden_states(self, forward: Callable[..., Any], batch: dict[str, Any]) -> torch.Tensor:
        """Run the model with its output head captured: the head's input, no logits computed."""
        capture = _Capture(self.head, self.vocab)
        setattr(self.parent, self.attr, capture)
        try:
            forward(**batch)
        finally:
            setattr(self.parent, self.attr, self.head)
        if len(capture.inputs) != 1:
            raise UnsupportedLossError(
                f"train.loss=chunked: {self.model_name} called its output head {len(capture.inputs)} times in one "
                "forward (expected once); set train.loss: full"
            )
        return capture.inputs[0]

    def through_head(self, hidden: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn(hidden), run as the head module's forward, so that its hooks (DeepSpeed ZeRO-3's
        gathers) fire around it as for any layer (another objective's loss: raypack/train/objectives/dpo.py)."""
        with _forward_as(self.head, fn):
            return self.head(hidden)

    def _call_head(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        def chunked(h: torch.Tensor) -> torch.Tensor:
            if self.kind == "liger":
                return self.fused(cast(self.head.weight, self.dtype), cast(h, self.dtype), targets,
                                  cast(self.head.bias, self.dtype)).float()
            return chunked_cross_entropy(h, self.head.weight, self.head.bias, targets, self.chunk, self.transform,
                                         self.dtype)

        with _forward_as(self.head, chunked):
            return self.head(hidden)

    def logits(self, forward: Callable[..., Any], batch: dict[str, Any]) -> torch.Tensor:
        """The logits the chunked path trains on, all of them (for the probe; small batches only)."""
        batch = {k: v for k, v in batch.items() if k != "labels" and k not in TARGET_KEYS}

        def head(h: torch.Tensor) -> torch.Tensor:
            return F.linear(cast(h, self.dtype), cast(self.head.weight, self.dtype), cast(self.head.bias, self.dtype))

        return self.transform(self.through_head(self.hidden_states(forward, batch), head))

    def describe(self) -> str:
        if self.kind == "full":
            return "full logits"
        if self.kind == "liger":
            return "Liger's fused linear cross-entropy"
        extra = "; then " + ", ".join(name for name, _ in self.transforms) if self.transforms else ""
        return f"chunked, {self.chunk} label tokens a chunk{extra}"


def _liger_loss(config: Any, transforms: list[tuple[str, Transform]], model_name: str):
    """Liger-Kernel's fused linear cross-entropy (sum over the targets), with the one output
    transform it implements, Gemma's softcapping; a model with another is refused."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    cap = getattr(config, "final_logit_softcapping", None)
    others = [name for name, _ in transforms if "final_logit_softcapping" not in name]
    if others:
        raise UnsupportedLossError(
            f"train.loss=liger: {model_name} applies {', '.join(others)} to its logits, which Liger's fused "
            "linear cross-entropy does not; set train.loss: chunked"
        )
    return LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=cap)


# --- setup ---------------------------------------------------------------------------------------


def probe_batch(vocab: int, padded: bool, seed: int = 0) -> dict[str, Any]:
    """Two short examples of random ids, collated like training batches (packed or padded)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (7, 5):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(n))})
    return collate_packed(rows, padded=padded, pad_token_id=0)


def probe(loss: CausalLMLoss, forward: Callable[..., Any], module: nn.Module, batch: dict[str, Any]) -> float:
    """Compare the model's own logits with the chunked path's on `batch`; raise if they differ.
    Returns the largest difference relative to the largest logit."""
    was_training = module.training
    module.eval()  # no dropout: both forwards must see the same function
    try:
        with torch.no_grad():
            kwargs = {k: v for k, v in batch.items() if k != "labels"}
            own = forward(**kwargs).logits.float()
            ours = loss.logits(forward, kwargs).float()
    finally:
        module.train(was_training)
    if own.shape != ours.shape:
        raise UnsupportedLossError(
            f"train.loss=chunked: {loss.model_name}'s logits have shape {tuple(own.shape)}, but its output head "
            f"gives {tuple(ours.shape)}; set train.loss: full"
        )
    diff = ((own - ours).abs().max() / own.abs().max().clamp_min(1e-6)).item()
    # Same ops in the same dtype; only kernel choice may differ. The tolerance follows the dtype the
    # head computes in (the engine's compute dtype, not the weights'): 16-bit, a few ulps of bf16.
    tol = 1e-4 if loss.dtype == torch.float32 else 2e-2
    if not diff <= tol:
        applied = ", ".join(name for name, _ in loss.transforms) or "none"
        raise UnsupportedLossError(
            f"train.loss=chunked: {loss.model_name}'s logits are not its output head applied to its last hidden "
            f"states (with the transforms raypack knows from its config: {applied}); they differ by {diff:.2e} of "
            f"the largest logit on a probe batch (tolerance {tol:.0e}). Set train.loss: full for this model."
        )
    return diff


def make_loss(engine: Any, kind: str = "chunked", chunk_tokens: int = 0, padded: bool = False) -> CausalLMLoss:
    """The loss for `engine` (a DeepSpeed engine or a plain model), probed once when chunked.

    Every rank must call it (under ZeRO-3 the probe's forward gathers parameters collectively)."""
    module = getattr(engine, "module", engine)
    loss = CausalLMLoss(module, kind, chunk_tokens, getattr(engine, "compute_dtype", None))
    if kind != "full":
        device = getattr(engine, "device", None) or next(module.parameters()).device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in probe_batch(loss.vocab, padded).items()}
        probe(loss, engine, module, batch)
    return loss
