"""A lean step (issue 35 part 3), counted: on one rank raypack's step makes no collective and reads
each step's values only after the next step is enqueued; DeepSpeed's overflow check and its
synchronized throughput timer are gone. The same counter sees all of them in the step of before,
so each count can fail. Then the values themselves: a diverged step stops the run, the rank
imbalance and the report cadence."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from benchmarks.step_syncs import measure
from raypack.train.metrics import FIRST_REPORT, cadence
from raypack.train.stepvalues import DivergedError, HostCounts, Pending, StepTimer, rank_imbalance


@pytest.fixture(scope="module")
def one_rank():
    """Both sides of benchmarks/step_syncs.py on one rank (a tiny bf16 Llama under ZeRO-2)."""
    torch.set_num_threads(1)
    args = argparse.Namespace(smoke=True, tokens=128, vocab=None, steps=3, warmup=2, seed=0)
    return measure(args, "cpu", 1)


def events(side, kind=None, origin=None):
    return [e for e in side["events"] if (kind is None or e[0] == kind) and (origin is None or e[1] == origin)]


def test_one_rank_makes_no_collective_of_its_own(one_rank):
    assert not events(one_rank["after"], "collective", "raypack")
    # ...where the step of before gathered N and then the loss and times: two a step
    assert len(events(one_rank["before"], "collective", "raypack")) == 2 * 5


def test_deepspeeds_overflow_check_and_throughput_timer_are_off(one_rank):
    before, after = one_rank["before"], one_rank["after"]
    # the throughput timer synchronizes at every forward and step (from the third step on)
    assert events(before, "sync", "deepspeed") and not events(after, "sync")
    overflow = [e for e in events(before, "read", "deepspeed") if "has_overflow" in e[2]]
    assert len(overflow) == 5  # one .item() a step, after an all_reduce
    assert not [e for e in events(after) if "has_overflow" in e[2]]


def test_clipping_reads_nothing_on_the_host(one_rank):
    """Both sides clip at 1.0: DeepSpeed's ZeRO-2 clipping asks whether the norm is invalid on the
    host once per parameter group (two here); raypack's engine swaps in the device-side answer."""
    invalid = lambda side: [e for e in events(side, "read", "deepspeed") if "is_invalid_grad_norm" in e[2]]  # noqa: E731
    assert len(invalid(one_rank["before"])) >= 2 * 5 and not invalid(one_rank["after"])


def test_a_steps_values_are_read_after_the_next_step_is_enqueued(one_rank):
    """raypack's loop step (loop.take_step) reads the device only in Pending.resolve, one read a
    step, and the read of step k's values comes after step k+1's update was enqueued; only a
    start's first step is read at once, for its start-up line (the CPU's exact attention may read
    its host cu_seqlens, which on CUDA are a varlen kernel's argument)."""
    after = one_rank["after"]["events"]
    reads = [(i, e) for i, e in enumerate(after) if e[0] == "read" and e[1] == "raypack"]
    assert {e[2] for _, e in reads} - {"exact._segments"} == {"stepvalues.resolve"}
    resolved = [i for i, e in reads if e[2] == "stepvalues.resolve"]
    marks = [i for i, e in enumerate(after) if e[0] == "mark"]  # marks[k - 1]: step k enqueued and returned
    assert len(resolved) == len(marks) == 5
    assert resolved[0] < marks[0], "the first step is read at once"
    for k in range(2, len(marks)):  # step k's values, read in step k + 1's take_step after its update
        update = max(i for i in range(marks[k - 1], marks[k]) if after[i][1] == "deepspeed")
        assert update < resolved[k - 1] < marks[k], f"step {k} was read before step {k + 1} was enqueued"
    assert resolved[-1] > marks[-1]  # the last step is read after the loop: there is no next one


def pending(loss_sum: float, grad_norm, tokens: float = 4.0) -> Pending:
    timer = StepTimer(torch.device("cpu"))
    host = {"label_tokens": tokens, "tokens": 8.0, "data_wait_s": 0.0, "world_size": 1, "skipped_steps": 0.0}
    return Pending.enqueued(3, host, torch.tensor(loss_sum), grad_norm, timer)


def test_values_are_the_steps_and_a_diverged_step_stops_the_run():
    values = pending(2.0, torch.tensor(0.25)).resolve()
    assert values["loss"] == 0.5 and values["grad_norm"] == 0.25 and values["step_time_s"] >= 0
    assert "grad_norm" not in pending(2.0, None).resolve()  # ZeRO-0 without clipping keeps none
    with pytest.raises(DivergedError, match="step 3: the loss is nan"):
        pending(float("nan"), torch.tensor(1.0)).resolve()
    # DeepSpeed masks an inf or NaN norm to -1; after its own overflow it holds float inf
    with pytest.raises(DivergedError, match="step 3: a gradient is inf or NaN"):
        pending(2.0, torch.tensor(-1.0)).resolve()
    with pytest.raises(DivergedError, match="a gradient is inf or NaN"):
        pending(2.0, math.inf).resolve()


def test_named_sums_are_means_over_the_steps_own_count():
    """DPO's step: the loss and its metrics' sums, each divided by the step's pairs, and the
    gradient norm after them."""
    host = {"pairs": 4.0, "label_tokens": 40.0, "tokens": 80.0, "data_wait_s": 0.0, "world_size": 1,
            "skipped_steps": 0.0}
    p = Pending.enqueued(2, host, torch.tensor(2.0), torch.tensor(0.5), StepTimer(torch.device("cpu")),
                         extra=torch.tensor([4.0, 1.0], dtype=torch.float64), names=("a", "b"), per="pairs")
    values = p.resolve()
    assert (values["loss"], values["a"], values["b"], values["grad_norm"]) == (0.5, 1.0, 0.25, 0.5)


def test_host_counts_on_one_rank_are_the_values():
    counts = HostCounts(world=1)
    assert counts.sums(3, 5.0) == [3.0, 5.0]
    assert counts.gather([1.0, 2.0]).tolist() == [[1.0, 2.0]]


def test_rank_imbalance_is_the_worst_steps_slowest_rank_over_the_mean():
    busy = np.array([[1.0, 2.0], [1.0, 1.0]])  # step 2: 2 s against a mean of 1.5
    assert rank_imbalance(busy) == pytest.approx(2.0 / 1.5)
    assert rank_imbalance(busy[:1]) == 1.0


def test_cadence_keeps_reports_under_one_percent():
    # a 0.07 s report over 0.4 s steps: 18 steps (0.97%), not 17 (1.03%)
    assert cadence(0.07, 0.4) == 18 and 0.07 / (18 * 0.4) <= 0.01 < 0.07 / (17 * 0.4)
    assert cadence(0.0, 0.4) == 1 and cadence(0.1, 0.0) == FIRST_REPORT
