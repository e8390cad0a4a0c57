"""DPO on packed rows is exact (raypack/train/objectives/dpo.py): the loss, every gradient and the metrics of
a packed step equal TRL's DPOTrainer on the same pairs (unpacked, padded, one batch, reference
precomputed), in fp32 on a tiny Llama, to 1e-5 relative; and for every model family that packs
exactly, equal each pair run alone through the model's own eager attention.

TRL's step runs after its reference pass, with the policy then moved off the reference (the same
random step on both models), so that rewards, margins and accuracies are not all zero. The
rows are made by raypack's own stages (tokenize, plan pairs, route, assemble) from the bundled
preference sample, several pairs a row, in micro-batches of one row, the loss in chunks of 7
tokens: every pair's loss is summed per micro-batch and divided by the step's pair count.
"""

from __future__ import annotations

import json

import pytest
import torch
from dpo_check import (SAMPLE, alone_reference, encoded_pairs, grad_errors, packed_pair_rows, pairs_alone_loss, perturb,
                       sample_records, trl_step)
from exactness import AS_CLOSE, float64_copy
from families import FAMILIES, exact

from raypack.config import ASSETS, DpoConfig
from raypack.model.build import load_model
from raypack.train.objectives.dpo import METRICS, DPOLoss
from raypack.train.objectives.dpo_reference import rows_logps
from raypack.train.objectives.loss import UnsupportedLossError, make_loss
from raypack.train.step import train_step
from raypack.train.stepvalues import HostCounts

PAIRS = 8
TOLERANCE = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


class OneRankEngine:
    """What the optimizer step (raypack/train/step.py) asks of DeepSpeed's engine on one rank, without an optimizer: the
    forward, a backward scaled down by the accumulation steps as DeepSpeed's is, and no update
    (the gradients are compared after the step)."""

    def __init__(self, model, micro_batches: int):
        self.module, self.device, self.micro_batches = model, torch.device("cpu"), micro_batches

    def __call__(self, **batch):
        return self.module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.micro_batches).backward()

    def step(self) -> None:
        pass

    def grad_norm(self):
        return None


def raypack_step(model, rows: list[dict], dpo: DpoConfig, kind: str = "chunked", after_reference=None,
                 padded: bool = False, collate=None, logps: dict | None = None, on_the_fly: bool = False):
    """raypack's packed step, as the training loop runs it (step.train_step, its values read
    through stepvalues.Pending): the reference pass over `rows`, then each row a micro-batch;
    returns (loss, metrics) with the gradients in `model`. `collate`: a VLM's VisionRows;
    `logps`, when given, receives the reference pass's sums ("reference") and the moved policy's
    ("policy"), by example id. `on_the_fly`: a LoRA model's reference taken in the step, with the
    adapters off (dpo.reference: on_the_fly), not precomputed."""
    loss = DPOLoss(make_loss(model, kind, chunk_tokens=7, padded=padded), dpo, gather=None, collate=collate)
    if on_the_fly:
        with model.disable_adapter():  # what the step takes: only read here, for `logps`
            reference = rows_logps(loss, model, rows, padded, 2, "cpu")
    else:
        reference = rows_logps(loss, model, rows, padded, 2, "cpu")
    if after_reference is not None:
        after_reference(model)
    if logps is not None:
        logps["reference"], logps["policy"] = reference, rows_logps(loss, model, rows, padded, 2, "cpu")
    if on_the_fly:
        loss = DPOLoss(loss.base, dpo, gather=None, adapters_off=model.disable_adapter, collate=collate)
    else:
        loss = DPOLoss(loss.base, dpo, gather=None, reference=reference, collate=collate)
    step = loss.prepare_step(rows, padded=padded, pad_token_id=2)
    values = train_step(OneRankEngine(model, len(step.batches)), step, loss, HostCounts(1), 1).resolve()
    assert values["pairs"] == step.pairs and values["skipped_steps"] == 0.0
    return values["loss"], {name: values[name] for name in METRICS}


def _models(vocab: int = 768):
    torch.manual_seed(0)
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32", vocab_size=vocab)
    ref = load_model("tiny-llama", attention="eager", dtype="float32", vocab_size=vocab)
    ref.load_state_dict(model.state_dict())
    return model, ref


CASES = {  # dpo section, TRL's loss_type and loss_weights for the same objective
    "sigmoid": (DpoConfig(beta=0.1), None, None),
    "ipo": (DpoConfig(beta=0.5, loss="ipo"), None, None),
    "sigmoid+sft": (DpoConfig(beta=0.1, sft_weight=0.7), ["sigmoid", "sft"], [1.0, 0.7]),
    # TRL 1.x has no smoothed sigmoid. -log σ(-z) = -log σ(z) + z, so conservative DPO is
    # sigmoid + eps·z, and TRL's hinge, relu(1 - z), is 1 - z wherever z < 1 (here |z| < 0.1; a
    # pair past 1 would make the losses differ, failing the test, never passing it wrongly):
    # sigmoid - eps·hinge is the same loss, less the constant eps, with the same gradients.
    "label_smoothing": (DpoConfig(beta=0.1, label_smoothing=0.2), ["sigmoid", "hinge"], [1.0, -0.2]),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_step_equals_trl(case, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # TRL caches its reference pass there
    dpo, loss_type, weights = CASES[case]
    model, ref = _models()
    move = lambda m: perturb([m])  # noqa: E731  the same random step away from the reference, both sides
    trl = trl_step(ref, sample_records(PAIRS), dpo, tmp_path, after_reference=move, loss_type=loss_type,
                   loss_weights=weights)
    rows = packed_pair_rows(SAMPLE, PAIRS, budget=400)[0]
    assert len(rows) > 1 and all(len(r["example_ids"]) >= 2 for r in rows)  # several rows, pairs packed together
    loss, metrics = raypack_step(model, rows, dpo, after_reference=move)

    expected = trl["loss"] + (dpo.label_smoothing if case == "label_smoothing" else 0.0)
    assert loss == pytest.approx(expected, rel=TOLERANCE)
    errors = grad_errors(model, trl["grads"])
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst} off by {errors[worst]:.2e}"
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl["metrics"][name], rel=1e-4, abs=1e-6), name
    assert 0 < metrics["rewards/accuracies"] < 1  # the policy really moved off the reference


def test_standard_format_and_full_loss_equal_trl(tmp_path, monkeypatch):
    """String pairs (TRL's standard format: EOS appended, tokenized whole) and `train.loss: full`."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    records = [{"prompt": r["prompt"][0]["content"], "chosen": " " + r["chosen"][0]["content"],
                "rejected": " " + r["rejected"][0]["content"]} for r in sample_records(PAIRS, start=20)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dpo = DpoConfig(beta=0.2)
    model, ref = _models()
    move = lambda m: perturb([m], seed=3)  # noqa: E731
    trl = trl_step(ref, records, dpo, tmp_path, after_reference=move)
    loss, _ = raypack_step(model, packed_pair_rows(path, budget=600)[0], dpo, kind="full", after_reference=move)
    assert loss == pytest.approx(trl["loss"], rel=TOLERANCE)
    errors = grad_errors(model, trl["grads"])
    assert max(errors.values()) < TOLERANCE


def test_padded_pairs_equal_packed(tmp_path):
    """The pad strategy's batches (one sequence a row, a pair's two adjacent) give the packed loss."""
    dpo = DpoConfig(beta=0.3, sft_weight=0.5)
    losses, grads = [], []
    for strategy in ("bfd", "pad"):
        torch.manual_seed(0)
        padded = strategy == "pad"
        model = load_model("tiny-llama", attention="sdpa" if padded else "sdpa_varlen", dtype="float32", vocab_size=768)
        rows = packed_pair_rows(SAMPLE, 6, budget=400, strategy=strategy)[0]
        loss, _ = raypack_step(model, rows, dpo, after_reference=lambda m: perturb([m]), padded=padded)
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=TOLERANCE)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-4, atol=1e-6)


EXACT = exact()


def _folded(rows, vocab: int):
    """Token ids (and labels) modulo `vocab`: a table of tokenized rows, or one packed row."""
    def fold(values):
        return [v if v == -100 else v % vocab for v in values]

    if isinstance(rows, dict):
        return {**rows, "input_ids": fold(rows["input_ids"]), "labels": fold(rows["labels"])}
    import pyarrow as pa

    columns = {name: rows[name] for name in rows.column_names}
    for name in ("input_ids", "labels"):
        columns[name] = pa.array([fold(v) for v in rows[name].to_pylist()], pa.list_(pa.int32()))
    return pa.table(columns)


@pytest.mark.parametrize("family", EXACT)
def test_family_packed_dpo_equals_each_pair_alone(family):
    """Every family that packs exactly: a packed DPO step (IPO, with the NLL term: every path of
    the objective) against each sequence of each pair run alone under transformers' eager
    attention, the loss written from its formula."""
    spec = FAMILIES[family]
    config = spec.build_config(family)
    torch.manual_seed(0)
    model = load_model(config, attention="sdpa_varlen", dtype="float32").eval()
    alone = load_model(config, attention="eager", dtype="float32").eval()
    alone.load_state_dict(model.state_dict())
    start = load_model(config, attention="eager", dtype="float32").eval()
    start.load_state_dict(model.state_dict())  # the reference: the weights before the step
    dpo = DpoConfig(beta=0.5, loss="ipo", sft_weight=0.3)
    vocab = model.get_input_embeddings().num_embeddings  # the bundled tokenizer's ids folded into it
    # pairs cut to 64 tokens (the prompt first): sums short enough that fp32 rounding stays far
    # below the tolerance (at ~300 tokens a pair one DiffLlama gradient came within 4% of it)
    table = _folded(encoded_pairs(SAMPLE, 6, max_length=64), vocab)
    rows = [_folded(row, vocab) for row in packed_pair_rows(SAMPLE, 6, budget=160, max_length=64)[0]]
    move = lambda m: perturb([m], scale=0.01)  # noqa: E731
    try:
        make_loss(model, "chunked")
        kind = "chunked"
    except UnsupportedLossError:  # refused at setup for SFT too (MiniCPM3): train.loss: full trains it
        kind = "full"
    loss, _ = raypack_step(model, rows, dpo, kind=kind, after_reference=move)
    move(alone)
    expected = pairs_alone_loss(alone, start, table, dpo)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=TOLERANCE), family
    errors = grad_errors(model, {n: p.grad for n, p in alone.named_parameters() if p.grad is not None})
    # A gated delta rule's A_log gradient sums every token's decay with cancellation and amplifies
    # rounding (tests/families.py, qwen3_5_moe): two unpacked runs that differ only in rounding differ
    # in it by 3.5e-5, so it gets that bound; dt_bias enters the same decay (softplus(a + dt_bias))
    # and sums the same way (2.7e-5 seen on this machine's CPU). Every other gradient keeps the family's.
    decay = ("A_log", "dt_bias")
    bound = {n: max(TOLERANCE, FAMILIES[family].tolerance, 5e-5 if n.endswith(decay) else 0.0) for n in errors}
    worst = max(errors, key=lambda n: errors[n] / bound[n])
    if errors[worst] >= bound[worst]:
        # three gated delta rule layers' A_log (Qwen3.5-MoE): judged against float64, as the router
        # loss is (tests/exactness.py AS_CLOSE): the packed step as close as the pairs alone in fp32
        alone64, start64 = float64_copy(alone), float64_copy(start)
        pairs_alone_loss(alone64, start64, table, dpo).backward()
        exact64 = {n: p.grad for n, p in alone64.named_parameters() if p.grad is not None}
        packed_err, alone_err = grad_errors(model, exact64), grad_errors(alone, exact64)
        assert packed_err[worst] < AS_CLOSE * max(alone_err[worst], TOLERANCE), f"{family}: {worst} off by {errors[worst]:.2e}"


def test_an_empty_pack_adds_nothing_and_still_runs_its_forward():
    """The plan's filler rows (no pair) pass through the reference pass, the loss and its backward,
    adding nothing: under ZeRO-3 every rank must run as many forwards as the others."""
    from raypack.data.pack import empty_rows

    dpo = DpoConfig(beta=0.2, sft_weight=0.3)
    rows = packed_pair_rows(SAMPLE, 4, budget=400)[0]
    empty = empty_rows(0, torch.tensor([99]).numpy(), 1).to_pylist()
    losses, grads, counts = [], [], []
    for with_empty in (False, True):
        model, _ = _models()
        forwards = []
        model.register_forward_pre_hook(lambda *a: forwards.append(1))
        loss, _ = raypack_step(model, rows + empty if with_empty else rows, dpo, after_reference=lambda m: perturb([m]))
        losses.append(loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        counts.append(len(forwards))
    assert counts[1] - counts[0] == 2  # the empty pack's, in the reference pass and in the step
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g)


def split_pairs(row: dict) -> list[dict]:
    """A packed row of pairs as rows of one pair each (the same sequences, unpacked)."""
    from raypack.data.collate import example_starts

    starts = list(example_starts(row["position_ids"])) + [len(row["input_ids"])]
    out = []
    for k in range(0, len(row["example_ids"]), 2):
        lo, hi = starts[k], starts[k + 2]
        piece = {key: row[key][lo:hi] for key in ("input_ids", "position_ids")}
        piece["labels" if "labels" in row else "loss_mask"] = row["labels" if "labels" in row else "loss_mask"][lo:hi]
        out.append({**row, **piece, "example_ids": row["example_ids"][k:k + 2], "num_tokens": hi - lo})
    return out


def test_router_loss_is_added_to_dpo_per_sequence_packed_or_not():
    """The policy's router loss (tiny Qwen3-MoE) added to DPO as TRL adds the model's aux loss:
    the step's mean over its sequences, each sequence's own (transformers' function on it alone),
    the same loss, router loss and gradients packed or one pair per micro-batch."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from raypack.config.sections import TrainConfig
    from raypack.train.objectives.router_loss import make_router_loss

    dpo = DpoConfig(beta=0.1)
    rows = packed_pair_rows(SAMPLE, 6, budget=600)[0]
    assert any(len(r["example_ids"]) >= 4 for r in rows)  # pairs share rows
    results = []
    for layout in (rows, [p for r in rows for p in split_pairs(r)]):
        torch.manual_seed(0)
        model = load_model("tiny-qwen3_moe", attention="sdpa_varlen", dtype="float32", vocab_size=768).eval()
        loss = DPOLoss(make_loss(model, "chunked", chunk_tokens=7), dpo, gather=None)
        reference = rows_logps(loss, model, rows, False, 2, "cpu")
        loss = DPOLoss(loss.base, dpo, gather=None, reference=reference)
        loss.router = make_router_loss(model, TrainConfig(router_aux_loss_coef=0.5), "tiny-qwen3_moe")
        step = loss.prepare_step(layout)
        values = train_step(OneRankEngine(model, len(step.batches)), step, loss, HostCounts(1), 1, router=loss.router).resolve()
        results.append((values, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        loss.router.routers.remove()
    (packed, grads), (alone, alone_grads) = results
    assert packed["router_units"] == alone["router_units"] == 2 * sum(len(r["example_ids"]) // 2 for r in rows)
    assert packed["loss"] == pytest.approx(alone["loss"], rel=TOLERANCE)
    assert packed["router_aux_loss"] == pytest.approx(alone["router_aux_loss"], rel=TOLERANCE)
    sequences = [ids for r in rows for ids in _sequences(r)]
    with torch.no_grad():
        own = [load_balancing_loss_func(model(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits,
                                        4, 2).item() for ids in sequences]
    assert packed["router_aux_loss"] == pytest.approx(sum(own) / len(own), rel=TOLERANCE)
    assert errors_between(grads, alone_grads) < TOLERANCE
    assert any("mlp.gate" in n for n in grads)  # the router trains on DPO's step


def test_a_reference_taken_in_the_step_adds_no_router_calls_to_the_policys():
    """LoRA on the tiny Qwen3-MoE with the router loss, the reference the base with the adapters
    off taken in the step (dpo.reference: on_the_fly): the step captures the policy's router calls
    only (the reference forward pauses the capture; with both, the router check refuses the step
    for running each router twice), and equals the step whose reference was precomputed."""
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.config.sections import TrainConfig
    from raypack.model.adapters import apply_adapters
    from raypack.train.objectives.router_loss import make_router_loss

    dpo = DpoConfig(beta=0.1)
    rows = packed_pair_rows(SAMPLE, 4, budget=600)[0]
    results = []
    for on_the_fly in (False, True):
        torch.manual_seed(0)
        model = load_model("tiny-qwen3_moe", attention="sdpa_varlen", dtype="float32", vocab_size=768).eval()
        model = random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))
        base = make_loss(model, "chunked", chunk_tokens=7)
        if on_the_fly:
            loss = DPOLoss(base, dpo, gather=None, adapters_off=model.disable_adapter)
        else:
            with model.disable_adapter():
                reference = rows_logps(DPOLoss(base, dpo, gather=None), model, rows, False, 2, "cpu")
            loss = DPOLoss(base, dpo, gather=None, reference=reference)
        loss.router = make_router_loss(model, TrainConfig(router_aux_loss_coef=0.5), "tiny-qwen3_moe")
        step = loss.prepare_step(rows)
        values = train_step(OneRankEngine(model, len(step.batches)), step, loss, HostCounts(1), 1,
                            router=loss.router).resolve()
        results.append((values, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        loss.router.routers.remove()
    (pre, pre_grads), (fly, fly_grads) = results
    assert fly["loss"] == pytest.approx(pre["loss"], rel=TOLERANCE)
    assert fly["router_aux_loss"] == pytest.approx(pre["router_aux_loss"], rel=TOLERANCE)
    assert errors_between(fly_grads, pre_grads) < TOLERANCE


def _sequences(row):
    from raypack.data.collate import example_starts

    starts = list(example_starts(row["position_ids"])) + [len(row["input_ids"])]
    return [row["input_ids"][lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]


def errors_between(a, b) -> float:
    assert a.keys() == b.keys()
    floor = 1e-3 * max(g.abs().max().item() for g in b.values())
    return max((a[n] - b[n]).abs().max().item() / max(b[n].abs().max().item(), floor) for n in a)


VLM_SAMPLE = ASSETS / "vision_sample" / "preference.jsonl"
VLM_PROCESSOR = str(ASSETS / "vlm_processor")


def _pictures(path, n: int) -> dict[int, dict]:
    """{row: the model's image inputs for that preference row} of the first `n` rows with images,
    from the picture files through the image processor (not raypack's stored bytes or its
    re-processing)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(VLM_PROCESSOR)
    out = {}
    for row, line in enumerate(path.read_text().splitlines()[:n]):
        rec = json.loads(line)
        content = rec["prompt"][0]["content"]
        names = rec.get("images") or ([p["image"] for p in content if p["type"] == "image"] if isinstance(content, list)
                                      else [])  # fmt: skip
        if names:
            pix = processor(images=[Image.open(VLM_SAMPLE.parent / n).convert("RGB") for n in names], return_tensors="pt")
            out[row] = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
    return out


def _with_text_pairs(tmp_path):
    """The first image pairs of the sample and, between them, two text-only pairs (string content)."""
    lines = VLM_SAMPLE.read_text().splitlines()[:PAIRS - 2]
    text = [json.dumps({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": c}],
                        "rejected": [{"role": "assistant", "content": r}]})
            for q, c, r in (("Say yes.", "Yes.", "No."), ("Count to two.", "One, two.", "Two, one."))]  # fmt: skip
    (tmp_path / "images").symlink_to(VLM_SAMPLE.parent / "images")  # the sample's relative image paths
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines[:3] + text[:1] + lines[3:] + text[1:]) + "\n")
    return path


@pytest.mark.parametrize("strategy", ["bfd", "pad", "bfd-with-text-pairs", "bfd-lora-on-the-fly"])
def test_vlm_packed_dpo_equals_each_pair_alone(strategy, tmp_path):
    """DPO with image prompts (raypack/data/vision_pairs.py) on the tiny Qwen2.5-VL: raypack's step
    over packed rows of several image pairs (VisionRows: each sequence's copy of its pair's pixels,
    4-row mRoPE positions from the model's own get_rope_index per sequence), or `pad`'s batches,
    or rows where text-only pairs sit beside image pairs, against every sequence run alone through
    transformers' own Qwen2.5-VL forward (eager attention, pixel_values and image_grid_thw, the
    positions it builds itself), the loss written from its formula: the loss, each sequence's
    log-probability (reference and moved policy), the log-prob metrics and every gradient (vision
    tower and projector included), 1e-5 relative. With LoRA (all-linear: adapters in both towers)
    the reference is the base with the adapters off, taken in the step (dpo.reference: on_the_fly)."""
    from exactness import random_lora_b

    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.data.sources import locate
    from raypack.train.vision_rows import VisionRows
    from raypack.model.vision import token_types

    padded = strategy == "pad"
    path = _with_text_pairs(tmp_path) if strategy.endswith("text-pairs") else VLM_SAMPLE
    torch.manual_seed(0)
    model = load_model("tiny-qwen2_5_vl", attention="sdpa" if padded else "sdpa_varlen", dtype="float32").train()
    alone, start = (load_model("tiny-qwen2_5_vl", attention="eager", dtype="float32").train() for _ in range(2))
    lora = strategy.endswith("lora-on-the-fly")
    if lora:  # B drawn at random: at peft's zero start every lora_A gradient is zero, and the policy its base
        model = random_lora_b(apply_adapters(model, PeftConfig(method="lora", r=4, alpha=8)))
        alone, start = (apply_adapters(m, PeftConfig(method="lora", r=4, alpha=8)) for m in (alone, start))
    alone.load_state_dict(model.state_dict())
    start.load_state_dict(model.state_dict())  # the reference: the weights before the step
    table = encoded_pairs(path, PAIRS, tokenizer=VLM_PROCESSOR)
    budget = 256 if path == VLM_SAMPLE else 200  # 200: bfd puts a text pair beside image pairs
    rows = packed_pair_rows(path, budget=budget, strategy=strategy.split("-")[0], table=table)[0]
    if not padded:
        assert all(len(r["example_ids"]) >= 4 for r in rows)  # several pairs a row
    images = {e: (b, g) for e, b, g in zip(*(table[c].to_pylist() for c in ("example_id", "images", "image_grid_thw")))
              if b is not None}  # fmt: skip
    pictures = _pictures(path, PAIRS)
    assert table.num_rows == 2 * PAIRS and len(images) == len(pictures)  # stored once a pair, on its chosen row
    if path != VLM_SAMPLE:  # a text pair and an image pair in one row
        assert any(len({e in images for e in r["example_ids"][0::2]}) == 2 for r in rows)

    def inputs(row: dict) -> dict:
        pix = pictures.get(locate(row["example_id"])[1])
        if pix is None:  # a text-only pair: the model's own text positions
            return {}
        ids = torch.tensor([row["input_ids"]])
        return {**pix, "mm_token_type_ids": token_types(alone.config, ids)}

    dpo = DpoConfig(beta=0.5, sft_weight=0.3)
    move = lambda m: perturb([m], scale=0.01)  # noqa: E731
    logps: dict = {}
    loss, metrics = raypack_step(model, rows, dpo, after_reference=None if lora else move, padded=padded,
                                 collate=VisionRows(model, images, VLM_PROCESSOR), logps=logps, on_the_fly=lora)
    if lora:  # the reference: the base, adapters off
        with start.disable_adapter():
            reference = alone_reference(start, table, inputs)
    else:
        reference = alone_reference(start, table, inputs)
        move(alone)
    policy = alone_reference(alone, table, inputs)
    for name, want in (("reference", reference), ("policy", policy)):
        assert logps[name].keys() == want.keys()
        for eid, value in want.items():
            assert logps[name][eid] == pytest.approx(value, rel=TOLERANCE), f"{name} log p of example {eid}"
    sums = list(policy.values())
    assert metrics["logps/chosen"] == pytest.approx(sum(sums[0::2]) / PAIRS, rel=TOLERANCE)
    assert metrics["logps/rejected"] == pytest.approx(sum(sums[1::2]) / PAIRS, rel=TOLERANCE)
    expected = pairs_alone_loss(alone, reference, table, dpo, inputs)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=TOLERANCE)
    errors = grad_errors(model, {n: p.grad for n, p in alone.named_parameters() if p.grad is not None})
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst} off by {errors[worst]:.2e}"
    towers = {part for n in errors for part in ("visual.blocks", "visual.merger") if f"model.{part}." in n}
    assert towers == {"visual.blocks", "visual.merger"}, "no vision-tower or projector gradient was compared"
    assert not lora or all("lora_" in n for n in errors)
