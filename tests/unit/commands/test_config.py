"""`raypack config`: the resolved config and one field's documentation at the terminal."""

from __future__ import annotations

import re

import yaml
from paths import REPO

from raypack.cli import main
from raypack.config import load


def test_field_prints_type_default_and_docstring(capsys):
    assert main(["config", "pack.budget"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pack.budget: an integer\n  default: 1024\n")
    assert "Tokens per packed row" in out


def test_field_shows_the_configured_value_and_allowed_values(capsys):
    config = str(REPO / "jobs/configs/tiny_cpu.yaml")
    assert main(["config", "--config", config, "pack.budget=2048", "pack.budget", "model.attention"]) == 0
    out = capsys.readouterr().out
    assert "value:   2048 (from " in out
    assert "allowed: auto, flash_attn, torch_varlen, sdpa_varlen, sdpa" in out


def test_a_field_that_takes_a_literal_or_another_type_allows_both(capsys):
    """`Literal['auto'] | float` allows `auto` and any number; `Literal[...] | bool` true and false too."""
    assert main(["config", "train.router_aux_loss_coef", "model.gradient_checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "  allowed: auto, or a number\n" in out
    assert "  allowed: auto, full, selective, none, true, false\n" in out


def test_misspelt_field_suggests_the_nearest_and_exits_2(capsys):
    assert main(["config", "pack.budgt"]) == 2
    err = capsys.readouterr().err
    assert "did you mean pack.budget" in err and "Traceback" not in err


def test_no_field_prints_the_resolved_config_as_yaml_that_loads_back(capsys, tmp_path):
    config = str(REPO / "jobs/configs/tiny_cpu.yaml")
    assert main(["config", "--config", config, "train.lr=3e-4"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["train"]["lr"] == 3e-4
    saved = tmp_path / "resolved.yaml"
    saved.write_text(text)
    assert load(saved) == load(config, ["train.lr=3e-4"])


def test_section_lists_its_fields(capsys):
    assert main(["config", "model.peft"]) == 0
    out = capsys.readouterr().out
    assert "model.peft.r " in out and "model.peft.target_modules" in out


def test_unknown_key_in_a_run_points_to_the_reference(capsys):
    assert main(["config", "pack.budgt=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean pack.budget?" in err and "`raypack config pack` lists them" in err


def test_a_list_of_sections_lists_its_items_fields_and_each_items_value(capsys):
    assert main(["config", "data.sources"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("data.sources: a list of mappings\n  default: []\n") and "  each item (defaults):\n" in out
    assert re.search(r"\n  data\.sources\.weight +null ", out) and re.search(r"\n  data\.sources\.columns +\{\} ", out)
    assert main(["config", "--config", str(REPO / "jobs/configs/mixture.yaml"), "data.sources.weight"]) == 0
    assert "  value:   [0.5, 0.3, 0.2] (from " in capsys.readouterr().out
