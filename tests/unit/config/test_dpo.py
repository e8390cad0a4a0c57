"""The dpo: section and train.objective: dpo's checks, at config load (raypack/config/dpo.py)."""

from __future__ import annotations

import pytest

from raypack.config import dumps, load, loads
from raypack.errors import ConfigError

DPO = ["train.objective=dpo", "data.paths=[raypack/assets/sample/preference.jsonl]"]


def test_dpo_section_loads_and_round_trips():
    cfg = load(None, [*DPO, "dpo.beta=0.5", "dpo.loss=ipo", "dpo.sft_weight=0.2"])
    assert (cfg.train.objective, cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.sft_weight) == ("dpo", 0.5, "ipo", 0.2)
    assert loads(dumps(cfg)) == cfg
    assert load(None).dpo.reference == "auto" and load(None).train.objective == "sft"


@pytest.mark.parametrize("overrides, message", [
    (["train.num_workers=2", "train.sequence_parallel=2"], "train.sequence_parallel: expected 1 with train.objective: dpo"),
    (["train.loss=liger"], "train.loss: expected chunked or full with train.objective: dpo"),
    (["tokenize.overlength=split"], "tokenize.overlength: expected drop or truncate"),
    (["tokenize.label_mask=all"], "tokenize.label_mask: expected auto or completion"),
    (["pack.repack_each_epoch=true", "pack.strategy=random"], "pack.repack_each_epoch: expected false"),
    (["dpo.reference=on_the_fly"], "dpo.reference: expected precomputed or auto without model.peft"),
    (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing: expected 0 with dpo.loss: ipo"),
    (["dpo.beta=0"], "dpo.beta: expected a positive float"),
    (["dpo.label_smoothing=0.5"], r"dpo.label_smoothing: expected a float in \[0, 0.5\)"),
    (["data.format=chat"], "data.format: expected auto or preference with train.objective: dpo"),
])
def test_what_dpo_cannot_do_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [*DPO, *overrides])


def test_preference_data_needs_the_dpo_objective():
    with pytest.raises(ConfigError, match="data.format: expected not preference with train.objective: sft"):
        load(None, ["data.format=preference"])
    load(None, [*DPO, "model.peft.method=lora", "dpo.reference=on_the_fly"])  # LoRA's base: on the fly works


def test_preflight_matches_the_files_to_the_objective(tmp_path):
    from raypack.errors import SourceError
    from raypack.train.preflight import check_data

    with pytest.raises(SourceError, match="preference.jsonl: holds preference rows .* train.objective: dpo"):
        check_data(load(None, ["data.paths=[raypack/assets/sample/preference.jsonl]"]), rows=False)
    with pytest.raises(SourceError, match="chat.jsonl: holds chat data, but train.objective: dpo trains on preference"):
        check_data(load(None, ["train.objective=dpo", "data.paths=[raypack/assets/sample/chat.jsonl]"]), rows=False)
    check_data(load(None, DPO), rows=False)
