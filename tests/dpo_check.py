"""DPO on packed rows against references raypack did not write: TRL's DPOTrainer itself, and each
pair run alone through a model's own (eager) attention (tests/unit/train/objectives/test_dpo.py and the Ray
tier's DPO checks use these).

    rows = packed_pair_rows(records, budget)     # raypack's tokenize + plan + pack stages, no Ray
    trl = trl_step(model, records, ...)           # TRL's loss, metrics and gradients, one batch
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from raypack.config import ASSETS, DpoConfig, PackConfig
from raypack.data.encode import Encoder, kept_rows
from raypack.data.listing import Sources, read_units
from raypack.data.pack import Router, assemble_rows, plan_routing
from raypack.data.sources import read_unit
from raypack.data.strategies import make_plan

SAMPLE = ASSETS / "sample" / "preference.jsonl"
TOKENIZER = str(ASSETS / "tokenizer")


def sample_records(n: int, start: int = 0) -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()[start:start + n]]


def encoded_pairs(path, n: int | None = None, max_length: int = 4096, tokenizer: str = TOKENIZER):
    """The tokenized rows (chosen, rejected per pair) of a preference file, in example_id order
    (`tokenizer`: a VLM's processor folder for pairs with images)."""
    unit = read_units(Sources.of((str(path),)).files)[0]
    table = read_unit({k: [v] for k, v in unit.items()}, "auto")
    assert not any(table["error"].to_pylist()), table["error"].to_pylist()
    table = table.slice(0, n) if n else table
    return kept_rows(Encoder(tokenizer, None, "auto", "truncate", max_length).encode_table(table)).sort_by("example_id")


def packed_pair_rows(path, n: int | None = None, budget: int = 400, strategy: str = "bfd", ranks: int = 1,
                     max_length: int = 4096, tokenizer: str = TOKENIZER, table=None):
    """Packed rows of whole pairs, as the pack stage writes them (plan, route, assemble), per rank;
    pairs over `max_length` truncated (tokenize.overlength: truncate; image pairs are dropped).
    `table`: the file's `encoded_pairs` already made with these arguments."""
    table = encoded_pairs(path, n, max_length, tokenizer) if table is None else table
    plan = make_plan(table["length"].to_numpy(), PackConfig(strategy=strategy, budget=budget), ranks, pairs=True)
    rows = assemble_rows(Router(plan_routing(plan, table["example_id"].to_numpy()))(table), plan.reset_positions)
    rows = rows.to_pylist()
    return [[r for r in rows if r["rank"] == k] for k in range(ranks)]


def perturb(models, scale: float = 0.02, seed: int = 1) -> None:
    """Move every weight of each model the same random way: a policy away from its reference."""
    g = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(v.shape, generator=g) * scale for k, v in models[0].named_parameters()}
    with torch.no_grad():
        for model in models:
            for k, p in model.named_parameters():
                if k in noise:
                    p.add_(noise[k])


def trl_step(model, records: list[dict], dpo: DpoConfig, tmp_path, after_reference=None,
             loss_type=None, loss_weights=None) -> dict:
    """TRL's DPOTrainer on `records` as one batch, reference precomputed: its loss, its metrics
    and every gradient. `after_reference(trainer.model)` runs between the precompute and the step."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig as TrlConfig
    from trl import DPOTrainer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    args = TrlConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], bf16=False, use_cpu=True,
                     beta=dpo.beta, loss_type=loss_type or [dpo.loss], loss_weights=loss_weights,
                     precompute_ref_log_probs=True, per_device_train_batch_size=len(records), seed=0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)
    if after_reference is not None:
        after_reference(trainer.model)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads}


def sequence_logps(model, ids: list[int], prompt: int, **inputs) -> torch.Tensor:
    """Σ log p of a sequence's tokens after its first `prompt`, the sequence run alone (`inputs`:
    the model's other arguments for it, e.g. a VLM's pixel_values and image_grid_thw)."""
    x = torch.as_tensor(ids)[None]
    logits = model(input_ids=x, **inputs).logits
    logps = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]
    return logps[prompt - 1:].sum()


def _no_inputs(row: dict) -> dict:
    return {}


def alone_reference(ref_model, table, inputs=_no_inputs) -> dict[int, float]:
    """{example_id: Σ log p of its completion} with every sequence run alone through `ref_model`;
    `inputs(row)`: the model's other arguments for a tokenized row."""
    out = {}
    with torch.no_grad():
        for row in table.to_pylist():
            prompt = next(i for i, v in enumerate(row["labels"]) if v != -100)
            out[row["example_id"]] = sequence_logps(ref_model, row["input_ids"], prompt, **inputs(row)).item()
    return out


def pairs_alone_loss(model, reference, table, dpo: DpoConfig, inputs=_no_inputs) -> torch.Tensor:
    """The DPO loss (mean over pairs) with every sequence run alone, written from the formula;
    `reference`: a model (run alone too) or {example_id: its reference log-prob sum}; `inputs(row)`:
    the model's other arguments for a tokenized row."""
    if not isinstance(reference, dict):
        reference = alone_reference(reference, table, inputs)
    rows = table.to_pylist()
    losses, chosen_nll, chosen_tokens = [], 0.0, 0
    for c, r in zip(rows[0::2], rows[1::2]):
        prompt = next(i for i, v in enumerate(c["labels"]) if v != -100)
        s = [sequence_logps(model, x["input_ids"], prompt, **inputs(x)) for x in (c, r)]
        ref = [reference[x["example_id"]] for x in (c, r)]
        n = [len(x["input_ids"]) - prompt for x in (c, r)]
        if dpo.loss == "ipo":
            losses.append(((s[0] - ref[0]) / n[0] - (s[1] - ref[1]) / n[1] - 1 / (2 * dpo.beta)) ** 2)
        else:
            z = dpo.beta * ((s[0] - ref[0]) - (s[1] - ref[1]))
            losses.append(-(1 - dpo.label_smoothing) * F.logsigmoid(z) - dpo.label_smoothing * F.logsigmoid(-z))
        chosen_nll, chosen_tokens = chosen_nll - s[0], chosen_tokens + n[0]
    return torch.stack(losses).mean() + dpo.sft_weight * chosen_nll / chosen_tokens


def grad_errors(model, grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's gradient error relative to the reference's largest entry (at least 1e-3 of
    the largest of any: a gradient zero in exact arithmetic is rounding noise in both)."""
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values())
    errors = {}
    for name, p in model.named_parameters():
        if name not in grads and p.grad is None:
            continue
        if name not in grads or p.grad is None:
            errors[name] = 1.0
            continue
        errors[name] = (p.grad - grads[name]).abs().max().item() / max(grads[name].abs().max().item(), floor)
    return errors
