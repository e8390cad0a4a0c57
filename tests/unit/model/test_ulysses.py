"""Sequence parallelism is exact: for every family that packs exactly (tests/families.py), N = 2
and N = 4 ranks (N = 4 on a few families unless `-m slow`) sharing rows whose examples cross the
shard boundaries give the loss and every gradient of one rank running the whole rows, within fp32
tolerance, with and without LoRA; gloo processes on the CPU (tests/ulysses_check.py). And the pieces: the all-to-all round trip, and
the shards of a row."""

from __future__ import annotations

import re

import pytest
import torch
import ulysses_check
from families import FAMILIES, TOLERANCE, exact

from raypack.data.collate import collate_packed, shard_batch
from raypack.data.formats import IGNORE_INDEX
from raypack.train.objectives.loss import label_targets

EXACT = exact()


def _check(results: dict[str, dict]) -> None:
    for key in list(results):
        refused = FAMILIES[key.split("/")[0]].split_refused
        if refused:  # refused by the trait its row names, never silently wrong
            error = results.pop(key).get("error", "")
            assert error.startswith("UnsupportedModelError") and re.search(refused, error), (key, error)
    failed = {key: errs["error"] for key, errs in results.items() if "error" in errs}
    assert not failed, failed
    worst = {key: max(errs.items(), key=lambda kv: kv[1]) for key, errs in results.items()}
    off = {key: w for key, w in worst.items() if not w[1] < TOLERANCE}
    assert not off, off
    assert all(any(k.startswith("grad:") for k in errs) for errs in results.values())


FOUR_RANKS = ["llama", "gemma2", "gpt_oss", "deepseek_v3", "qwen3_moe", "qwen3_5"]
"""N = 4 in the default suite: a row's examples crossing three shard boundaries, on each kind of
attention the families split (plain, sliding window and softcap, sinks, latent, experts) and a
hybrid's refusal. Every family at N = 4 is `pytest -m slow`'s: four gloo processes on two cores
doubled this test's time (123 s) for what N = 2 already checks of each family."""


def test_every_family_is_exact_split_over_2_ranks():
    results = ulysses_check.run(world=2, sizes=(2,), families=EXACT)
    assert set(results) == {f"{f}/2" for f in EXACT}
    _check(results)


@pytest.mark.parametrize("families", [pytest.param(FOUR_RANKS, id="some"),
                                      pytest.param(EXACT, id="every", marks=pytest.mark.slow)])
def test_families_are_exact_split_over_4_ranks(families):
    results = ulysses_check.run(world=4, sizes=(4,), families=families)
    assert set(results) == {f"{f}/4" for f in families}
    _check(results)


def test_lora_split_over_ranks_is_exact():
    """Adapters on every linear layer: their gradients (and only theirs) agree."""
    families = ["llama", "qwen3", "gemma2", "gpt_oss", "deepseek_v3", "gpt2"]
    _check(ulysses_check.run(world=2, sizes=(2,), families=families, lora=True))


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointed_layers_split_over_ranks_are_exact(checkpointing):
    """The all-to-alls inside checkpointed layers: recomputed in backward (every rank recomputes
    the same layers in the same order), the kept matmul outputs under selective."""
    _check(ulysses_check.run(world=2, sizes=(2,), families=["llama", "gemma2"], checkpointing=checkpointing))


def test_shards_cover_the_row_and_its_targets_once():
    rows = [{"input_ids": list(range(10, 17)), "labels": [-100, 11, 12, 13, -100, 15, 16],
             "position_ids": [0, 1, 2, 3, 4, 0, 1]}]
    batch = collate_packed(rows)
    batch.update(label_targets(batch["labels"]))
    shards = shard_batch(batch, 4, pad_token_id=0)
    ids = torch.cat([s["input_ids"] for s in shards], 1)[0].tolist()
    assert ids == [10, 11, 12, 13, 14, 15, 16, 0]  # padded to a multiple of 4
    assert torch.cat([s["position_ids"] for s in shards], 1)[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    assert all(s["cu_seq_lens_q"].tolist() == [0, 5, 7, 8] and s["max_length_q"] == 5 for s in shards)
    # every target once, at its own position: the whole row's (position, target) pairs
    found = sorted((2 * k + int(p), int(t)) for k, s in enumerate(shards)
                   for p, t in zip(s["loss_positions"], s["loss_targets"]))
    whole = sorted(zip(batch["loss_positions"].tolist(), batch["loss_targets"].tolist()))
    assert found == whole == [(0, 11), (1, 12), (2, 13), (5, 16)]
    assert shards[3]["labels"][0, -1] == IGNORE_INDEX  # the pad carries no loss


@pytest.mark.parametrize("n", [1, 3])
def test_shards_of_a_row_that_divides_evenly_need_no_pad(n):
    rows = [{"input_ids": list(range(6)), "labels": list(range(6)), "position_ids": list(range(6))}]
    batch = collate_packed(rows)
    batch.update(label_targets(batch["labels"]))
    shards = shard_batch(batch, n)
    assert [s["input_ids"].shape[1] for s in shards] == [6 // n] * n
    assert shards[0]["cu_seq_lens_q"].tolist() == [0, 6]
