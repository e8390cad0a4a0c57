"""The sweep's driver-side pieces that need no Ray: the report's notes (its saved config: tests/unit/test_runs.py)."""

from __future__ import annotations

import pytest

from raypack.config import load
from raypack.tune.data import SweepData
from raypack.tune.sweep import report_context


def data(**kw):
    return SweepData(cache="/exp/cache", tokenizations=1, examples=300, tokenize_s=3.0, pack_s=2.0, packed_configs=4,
                     mean_length={512: 215.3}, batch_sizes={"pad/512": 2.378, "flatten/512": 2.378},
                     steps={"pad/512": 113, "bfd/512": 114}, **kw)


def test_report_context_states_the_rule_and_the_device():
    cfg = load(None, ["pack.budget=512", "train.num_workers=1", "tune.strategies=[pad, flatten, bfd, balanced]"])
    ctx = report_context(cfg, data())
    rule = ctx.notes[0]
    assert rule.startswith("Equal work per optimizer step (tune.equal_work: tokens_per_step)")
    assert "(512 x 1 x 1 for pack.budget)" in rule and "pad, flatten take" in rule and "512 / 215.3 = 2.378" in rule
    assert "Data: tokenized once (300 examples" in ctx.notes[1] and ctx.on_cpu
    off = report_context(load(None, ["tune.equal_work=none", "pack.batch_size=4"]), data())
    assert off.notes[0].startswith("No equal-work rule") and "pack.batch_size = 4" in off.notes[0]
    assert not report_context(load(None, ["train.use_gpu=true"]), data()).on_cpu
    asha = report_context(load(None, ["tune.scheduler=asha", "tune.asha.grace_period=4"]), data())
    assert "ASHA on loss (min): time_attr step, grace period 4, reduction factor 2, max_t 115" in asha.notes[2]
