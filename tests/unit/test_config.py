"""Config loading: errors name the key, the expected form and the file; overrides round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raypack.config import Config, dumps, load, loads
from raypack.errors import ConfigError


def write(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_load():
    cfg = load()
    assert cfg.pack.budget == 1024 and cfg.data.on_bad_rows == "error"


def test_unknown_key_names_key_choices_and_file(tmp_path):
    path = write(tmp_path, {"tokenize": {"max_lenght": 10}})
    with pytest.raises(ConfigError) as e:
        load(path)
    msg = str(e.value)
    assert path in msg and "tokenize.max_lenght" in msg and "unknown key" in msg and "max_length" in msg


def test_unknown_section(tmp_path):
    path = write(tmp_path, {"tokenise": {}})
    with pytest.raises(ConfigError, match=r"tokenise: unknown key; did you mean tokenize\? expected one of .*tokenize"):
        load(path)


@pytest.mark.parametrize(
    "section,key,value,expected",
    [
        ("pack", "budget", "big", "an integer"),
        ("pack", "budget", True, "an integer"),
        ("train", "lr", "fast", "a number"),
        ("model", "trust_remote_code", "yes", "true or false"),
        ("data", "on_bad_rows", "ignore", "one of 'error', 'skip'"),
        ("tokenize", "max_length", "long", "an integer or null"),
        ("data", "paths", {"a": 1}, "a list of strings"),
    ],
)
def test_wrong_type_names_key_expected_form_and_file(tmp_path, section, key, value, expected):
    path = write(tmp_path, {section: {key: value}})
    with pytest.raises(ConfigError) as e:
        load(path)
    msg = str(e.value)
    assert path in msg and f"{section}.{key}" in msg and expected in msg and repr(value) in msg


@pytest.mark.parametrize(
    "section,key,value,expected",
    [
        ("pack", "budget", 0, "a positive int"),
        ("tokenize", "num_cpus", -1, "a positive float"),
        ("tokenize", "max_length", 0, "a positive int or null"),
        ("data", "eval_fraction", 1.0, "a float in [0, 1)"),
        ("train", "min_lr_ratio", 2, "a float in [0, 1]"),
    ],
)
def test_out_of_range_names_key_expected_range_and_file(tmp_path, section, key, value, expected):
    path = write(tmp_path, {section: {key: value}})
    with pytest.raises(ConfigError) as e:
        load(path)
    msg = str(e.value)
    assert path in msg and f"{section}.{key}" in msg and expected in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pack: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


def test_a_folder_a_binary_or_an_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text("")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"is a folder, not a config file; its YAML files: tiny\.yaml$"):
        load(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"pack:\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"model\.bin: not a text file \(byte 0xff at offset 6 is not UTF-8\)"):
        load(binary)

    def denied(self, *args, **kwargs):  # chmod 000 doesn't stop root, which tests may run as
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError, match=r"tiny\.yaml: can't read the config file \(Permission denied\)"):
        load(tmp_path / "tiny.yaml")


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load(None, ["budget=3"])


def test_override_round_trip(tmp_path):
    path = write(tmp_path, {"pack": {"budget": 512}, "data": {"paths": ["a.jsonl", "b.parquet"]}})
    cfg = load(path, ["train.lr=2e-5", "pack.strategy=bfd", "tokenize.max_length=null", "tune.budgets=[256, 512]", "data.on_bad_rows=skip"])
    assert cfg.train.lr == 2e-5 and isinstance(cfg.train.lr, float)
    assert cfg.pack.strategy == "bfd" and cfg.pack.budget == 512
    assert cfg.tokenize.max_length is None and cfg.tune.budgets == (256, 512) and cfg.data.on_bad_rows == "skip"
    assert cfg.data.paths == ("a.jsonl", "b.parquet")
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg
    # and through YAML, as a logged config would be reloaded
    path2 = tmp_path / "dumped.yaml"
    path2.write_text(yaml.safe_dump(yaml.safe_load(yaml.safe_dump(_lists(cfg.to_dict())))))
    assert load(path2) == cfg


def test_an_error_names_the_override_that_holds_the_bad_value_else_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^override pack.budget=-3: pack.budget: expected a positive int, got -3$"):
        load(None, ["train.lr=1e-4", "pack.budget=-3"])
    with pytest.raises(ConfigError, match=r"^override data.paths=\[a, 3\]: data.paths\[1\]: expected a string"):
        load(None, ["data.paths=[a, 3]"])
    path = tmp_path / "run.yaml"
    path.write_text("pack:\n  budget: -3\n")
    with pytest.raises(ConfigError, match=rf"^{path} \(with overrides\): pack.budget: expected a positive int"):
        load(path, ["train.lr=1e-4"])  # the file holds it; the override is fine
    path.write_text("pack:\n  budget: 8\n")
    with pytest.raises(ConfigError, match=r"^override pack.budget=0: pack.budget: expected a positive int, got 0$"):
        load(path, ["pack.budget=0"])  # the override replaced the file's good value


def _lists(d):
    if isinstance(d, dict):
        return {k: _lists(v) for k, v in d.items()}
    return list(d) if isinstance(d, tuple) else d


def test_loads_and_dumps_round_trip():
    cfg = load(None, ["tune.strategies=[pad, bfd]", "train.lr=2e-5", "data.paths=[a.jsonl]"])
    assert loads(dumps(cfg)) == cfg
    assert loads("{}") == load()  # an empty file is refused (test_empty_or_non_mapping_config_is_refused)


def test_loads_names_its_source():
    with pytest.raises(ConfigError, match=r"^saved\.yaml: train\.lr: expected a number"):
        loads("train:\n  lr: fast\n", source="saved.yaml")
    with pytest.raises(ConfigError, match=r"^saved\.yaml: not valid YAML"):
        loads("train: [", source="saved.yaml")


def test_a_saved_config_reloads_to_exactly_the_config_saved():
    """Field for field and type for type: a float field given an int (pack.batch_size defaults to
    8.0; an override may say 8) saves and reloads as the same float, so keys hashed from it agree."""
    cfg = load(None, ["pack.batch_size=8", "tune.lrs=[1, 2]", "tune.target_eval_loss=2"])
    assert type(cfg.pack.batch_size) is float and cfg.tune.lrs == (1.0, 2.0)
    direct = Config()  # built in code, not through the YAML loader
    assert type(direct.to_dict()["pack"]["batch_size"]) is float
    for c in (cfg, direct, load()):
        text = dumps(c)
        assert dumps(loads(text)) == text
        assert json.dumps(loads(text).to_dict(), sort_keys=True) == json.dumps(c.to_dict(), sort_keys=True)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan", "1e999"])
def test_non_finite_floats_are_refused(tmp_path, value):
    """inf passes `lr > 0`; nan any check written as a negation. Neither is a usable value."""
    with pytest.raises(ConfigError, match=r"train\.lr: expected a finite number"):
        load(None, [f"train.lr={value}"])
    with pytest.raises(ConfigError, match=r"train\.weight_decay: expected a finite number"):
        load(None, [f"train.weight_decay={value}"])


def test_peft_section_loads_from_dotted_overrides_and_round_trips():
    cfg = load(None, ["model.peft.method=lora", "model.peft.r=8", "model.peft.target_modules=[q_proj, v_proj]"])
    assert cfg.model.peft.method == "lora" and cfg.model.peft.r == 8 and cfg.model.peft.target_modules == ("q_proj", "v_proj")
    assert loads(dumps(cfg)) == cfg
    assert load(None, ["model.peft.target_modules=all-linear"]).model.peft.target_modules == ("all-linear",)
    with pytest.raises(ConfigError, match=r"model.peft.r: expected a positive int"):
        load(None, ["model.peft.r=0"])
    with pytest.raises(ConfigError, match=r"model.peft.method: expected one of 'none', 'lora', 'qlora'"):
        load(None, ["model.peft.method=ia3"])


@pytest.mark.parametrize("overrides,why", [
    ([], "without train.use_gpu"),
    (["train.use_gpu=true", "train.zero_stage=3"], "with train.zero_stage 3"),
])  # fmt: skip
def test_qlora_is_refused_at_load_where_it_cannot_run(overrides, why):
    with pytest.raises(ConfigError, match=f"model.peft.method: expected lora or none {why}"):
        load(None, ["model.peft.method=qlora", *overrides])
    assert load(None, ["model.peft.method=qlora", "train.use_gpu=true", "train.zero_stage=2"]).model.peft.method == "qlora"


@pytest.mark.parametrize("overrides", [["model.dtype=bfloat16"], ["train.use_gpu=true"]])
def test_deepspeed_without_zero_is_refused_with_bf16_compute(overrides):
    """tests/ray/train/test_matrix.py measured its first update off every other engine and stage's."""
    with pytest.raises(ConfigError, match=r"^override train\.zero_stage=0: train\.zero_stage: expected 1-3 with train\.engine deepspeed and bf16 "
                                                        r"compute .* got 0"):
        load(None, ["train.zero_stage=0", *overrides])
    for fine in (["train.zero_stage=1"], ["train.engine=torch", "train.zero_stage=0"], ["model.dtype=float32"]):
        assert load(None, ["train.zero_stage=0", *overrides, *fine])  # ZeRO-1, DDP, or fp32 compute
    assert load(None, ["train.zero_stage=0"]).train.zero_stage == 0  # auto on the CPU: fp32


@pytest.mark.parametrize("overrides, message", [
    (["train.precision=bf16", "train.zero_stage=0"], r"train\.precision: expected mixed with train\.zero_stage 0"),
    (["train.precision=bf16", "train.offload_optimizer=true"], r"train\.precision: expected mixed with train\.offload"),
    (["train.precision=bf16", "train.optimizer=deepspeed"], r"train\.precision: expected mixed with train\.offload"),
    (["train.precision=bf16", "model.dtype=float32"], r"model\.dtype: expected auto or bfloat16 with train\.precision"),
    (["train.precision=fp8"], r"train\.precision: expected one of 'mixed', 'bf16'"),
    (["train.report_every_steps=0"], r"train\.report_every_steps: expected a positive int or null"),
])
def test_precision_and_report_cadence_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


def test_bf16_precision_and_the_chosen_report_cadence_load():
    cfg = load(None, ["train.precision=bf16", "model.dtype=bfloat16", "train.zero_stage=3"])
    assert cfg.train.precision == "bf16" and cfg.train.report_every_steps is None  # null: chosen as the run goes
    assert load(None, ["train.report_every_steps=7"]).train.report_every_steps == 7


@pytest.mark.parametrize("overrides, message", [
    (["train.router_aux_loss_coef=-0.1"], r"train\.router_aux_loss_coef: expected auto or a number >= 0, got -0\.1"),
    (["train.router_aux_loss_coef=fast"], r"train\.router_aux_loss_coef: expected one of 'auto' or a number, got 'fast'"),
    (["train.router_aux_loss=batch"], r"train\.router_aux_loss: expected one of 'example', 'micro_batch'"),
])
def test_router_aux_loss_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


def test_router_aux_loss_settings_load_and_round_trip():
    assert (load(None).train.router_aux_loss_coef, load(None).train.router_aux_loss) == ("auto", "example")
    cfg = load(None, ["train.router_aux_loss_coef=0.01", "train.router_aux_loss=micro_batch"])
    assert (cfg.train.router_aux_loss_coef, cfg.train.router_aux_loss) == (0.01, "micro_batch")
    assert loads(dumps(cfg)) == cfg
    assert load(None, ["train.router_aux_loss_coef=0"]).train.router_aux_loss_coef == 0.0


MIXTURE = """
data:
  sources:
    - paths: [chat.jsonl]
      weight: 2
    - paths: qa.parquet
      weight: 1
      format: completion
      columns: {prompt: question, completion: answer}
  examples_per_epoch: 300
"""


def test_data_sources_load_and_round_trip():
    cfg = loads(MIXTURE)
    first, second = cfg.data.sources
    assert cfg.data.paths == () and first.paths == ("chat.jsonl",) and first.weight == 2.0
    assert second.paths == ("qa.parquet",) and second.columns == {"prompt": "question", "completion": "answer"}
    assert loads(dumps(cfg)) == cfg and loads(dumps(cfg), saved=True) == cfg
    assert cfg.data.examples_per_epoch == 300 and loads(MIXTURE.replace("300", "all_exhausted")).data.examples_per_epoch \
        == "all_exhausted"


@pytest.mark.parametrize("text, message", [
    ("data: {paths: [x.jsonl], sources: [{paths: [a.jsonl]}]}",
     r"data.paths: expected no paths beside data.sources \(data.paths is the one-source form of data.sources: give one "
     r"or the other; data.paths=\[\] clears a file's\), got \['x.jsonl'\]"),
    ("data: {sources: [{paths: [a.jsonl], wieght: 2}]}",
     r"data.sources\[0\].wieght: unknown key; did you mean data.sources\[0\].weight\? .* \(data.sources\[0\] has paths: "
     r"a.jsonl\) \(`raypack config data.sources` lists them\)"),
    ("data: {sources: [{paths: [a.jsonl], weight: 1}, {paths: [b.jsonl], weight: 0}]}",
     r"data.sources\[1\] \(paths: b.jsonl\): weight: expected a number > 0 \(a share of the epoch\), got 0.0"),
    ("data: {sources: [{paths: [a.jsonl], weight: 1}, {paths: [b.jsonl]}]}",
     r"data.sources\[1\] \(paths: b.jsonl\): weight: expected a weight on every source or on none"),
    ("data: {sources: [{paths: [a.jsonl]}], examples_per_epoch: 10}",
     r"data.examples_per_epoch: expected sum without weights on data.sources"),
    ("data: {examples_per_epoch: first_exhausted}", r"data.examples_per_epoch: expected sum without weighted data.sources"),
    ("data: {sources: [{paths: [a.jsonl], weight: 1}, {paths: [b.jsonl], weight: 99}], examples_per_epoch: 50}",
     r"data.sources\[0\] \(paths: a.jsonl\): weight: expected a share of data.examples_per_epoch=50 of at least one "
     r"example .*got '1 of 100, 0.5 examples'"),
    ("data: {sources: [{paths: [a.jsonl], columns: {answer: completion}}]}",
     r"data.sources\[0\] \(paths: a.jsonl\): columns.answer: expected a field of an example format"),
    ("data: {sources: [{paths: []}]}", r"data.sources\[0\].paths: expected at least one path"),
    ("data: {sources: {paths: [a.jsonl]}}", r"data.sources: expected a list of mappings"),
])  # fmt: skip
def test_bad_sources_are_refused_naming_the_source(text, message):
    with pytest.raises(ConfigError, match=message):
        loads(text)
