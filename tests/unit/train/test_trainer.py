"""Starting a run, the parts that need no Ray: when a run is already complete."""

from __future__ import annotations

import json
import types

from raypack.config import load
from raypack.runs import RESULT
from raypack.train.trainer import _finished


def test_a_finished_run_is_known_by_its_steps(tmp_path):
    cfg = load(None, ["train.grad_accum=2", "train.epochs=1"])
    prepared = types.SimpleNamespace(total_steps=lambda accum, epochs, max_steps: 10 // accum * epochs)

    def checked(cfg, prepared=prepared):
        return types.SimpleNamespace(cfg=cfg, prepared=prepared)

    assert _finished(str(tmp_path), checked(cfg)) is None  # never finished
    (tmp_path / RESULT).write_text(json.dumps({"step": 5, "metrics": {}}))
    assert _finished(str(tmp_path), checked(cfg))["step"] == 5
    more = load(None, ["train.grad_accum=2", "train.epochs=2"])  # asks for 10 steps: train on
    assert _finished(str(tmp_path), checked(more)) is None
    assert _finished(str(tmp_path), checked(cfg, None)) is None  # data not packed yet
