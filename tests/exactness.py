"""Packed against unpacked: one packed forward/backward of a model against every example run
alone through a reference model with the same weights (used by the model tests, CPU and GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raypack.data.collate import collate_packed

LENGTHS = ([21, 6], [13, 1, 9])
"""Two rows; one example of a single token; examples longer than the tests' windows and chunks (8)."""


def make_rows(lengths=LENGTHS, seed=0, vocab=1024):
    """Packed rows (as the pack stage writes them) and the same examples as (ids, labels) pairs.
    The first example's first third carries no loss, like a prompt."""
    g = torch.Generator().manual_seed(seed)
    rows, examples = [], []
    for row in lengths:
        exs = [torch.randint(3, vocab, (n,), generator=g) for n in row]
        labels = [e.clone() for e in exs]
        labels[0][: len(labels[0]) // 3] = -100
        examples += list(zip(exs, labels))
        rows.append({
            "input_ids": torch.cat(exs).tolist(),
            "labels": torch.cat(labels).tolist(),
            "position_ids": [p for n in row for p in range(n)],
            "example_ids": list(range(len(row))), "pack": 0, "rank": 0, "step": 0, "num_tokens": sum(row),
        })  # fmt: skip
    return rows, examples


def summed_loss(logits, labels):
    return F.cross_entropy(
        logits[..., :-1, :].flatten(0, -2).float(), labels[..., 1:].flatten(), reduction="sum", ignore_index=-100
    )


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, so tiny entries don't dominate."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def packed_vs_alone(model, ref, lengths=LENGTHS, seed=0, device="cpu") -> dict[str, float]:
    """Relative errors of the packed model against `ref` run on each example alone: logits, the
    summed loss, and every parameter's gradient (`grad:<name>`; 1.0 where only one has a grad)."""
    vocab = model.get_input_embeddings().num_embeddings
    rows, examples = make_rows(lengths, seed, vocab=min(vocab, 1024))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collate_packed(rows).items()}
    labels = batch.pop("labels")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    logits = model(**batch).logits
    loss = summed_loss(logits, labels)
    loss.backward()

    ref_logits, ref_loss = [], 0.0
    for ids, lab in examples:
        out = ref(input_ids=ids[None].to(device)).logits
        ref_logits.append(out[0])
        ref_loss = ref_loss + summed_loss(out, lab[None].to(device))
    ref_loss.backward()

    errors = {"logits": rel_err(logits[0], torch.cat(ref_logits)), "loss": rel_err(loss, ref_loss)}
    ref_params = dict(ref.named_parameters())
    # A gradient that is zero in exact arithmetic (a key bias without RoPE: softmax ignores a
    # shift shared by all keys) is rounding noise in both runs; relative to itself it means
    # nothing. So each gradient's scale is at least 1e-3 of the model's largest gradient.
    floor = 1e-3 * max(q.grad.abs().max().item() for q in ref_params.values() if q.grad is not None)
    for name, p in model.named_parameters():
        q = ref_params[name]
        if p.grad is None and q.grad is None:
            continue
        if (p.grad is None) != (q.grad is None):
            errors[f"grad:{name}"] = 1.0
        else:
            scale = max(q.grad.abs().max().item(), floor)
            errors[f"grad:{name}"] = (p.grad - q.grad).abs().max().item() / scale
    return errors


def random_lora_b(model, seed: int = 1, scale: float = 0.1):
    """`model` with every LoRA B matrix drawn at random: peft starts B at zero, where every lora_A
    gradient is zero, which any path would match."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = (torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype)
    return model


def float64_copy(model):
    """`model` in float64, its gradients cleared (experts run eagerly: grouped_mm has no float64):
    the exact value that fp32 runs round, where a gradient is too ill-conditioned to compare two
    fp32 runs with each other."""
    import copy

    exact = copy.deepcopy(model).double()
    for m in exact.modules():
        if getattr(m, "config", None) is not None:
            m.config._experts_implementation = "eager"
    exact.zero_grad(set_to_none=True)
    return exact


AS_CLOSE = 4.0
"""Where fp32 rounding alone exceeds a row's tolerance, the packed run must be within this many
times the examples-alone fp32 run's distance from the float64 value (seen: 0.96 to 2.5)."""


def off_float64(model, ref, lengths=LENGTHS, seed=0) -> tuple[float, float]:
    """After packed_vs_alone(model, ref, lengths, seed): the largest gradient error of the packed
    run (model's) and of the examples alone in fp32 (ref's) against the examples alone in float64,
    the value both round (dpo_check.grad_errors). For a gradient fp32 computes ill-conditioned,
    whatever the packing."""
    from dpo_check import grad_errors

    exact = float64_copy(ref)
    vocab = model.get_input_embeddings().num_embeddings
    _, examples = make_rows(lengths, seed, vocab=min(vocab, 1024))
    sum(summed_loss(exact(input_ids=ids[None]).logits, lab[None]) for ids, lab in examples).backward()
    exact_grads = {n: q.grad for n, q in exact.named_parameters() if q.grad is not None}
    return max(grad_errors(model, exact_grads).values()), max(grad_errors(ref, exact_grads).values())
