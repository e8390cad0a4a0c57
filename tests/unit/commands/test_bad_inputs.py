"""`raypack train` on bad input: one line naming the field, file or row, exit code 2, before Ray
starts (ray.init is replaced by a function that fails the test), and no run folder left behind.

One test per class of bad input. One class needs the tokenized data, and so Ray: chats without
an assistant turn (tests/ray/commands/test_train.py). Rows of data too large to check before Ray
starts (over 16 MiB, or remote) are checked by the Ray read, with the same messages
(tests/ray/data/test_sources.py, test_tokenize.py).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from raypack.cli import main
from raypack.config import ASSETS

from hugeimage import huge_png
from paths import REPO

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray fails the test, even in a session where another test's Ray is up (then
    raypack would join it: `ray.is_initialized` is made to say no)."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started before the bad input was found")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def jsonl(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def train(tmp_path, capsys, *overrides, command="train") -> str:
    """Run the command; return its stderr after checking exit code 2, a single line, and that
    nothing was written under the storage path."""
    runs = tmp_path / "runs"
    code = main([command, f"run.storage_path={runs}", "run.name=r", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("raypack: ") and err.count("\n") == 1, err
    assert not runs.exists(), "a failed start left files behind"
    return err


def test_malformed_json(tmp_path, capsys, no_ray):
    path = jsonl(tmp_path / "chat.jsonl", GOOD, "{oops", GOOD)
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert f"{path} line 2: malformed JSON" in err


def test_missing_field(tmp_path, capsys, no_ray):
    path = jsonl(tmp_path / "inst.jsonl", {"instruction": "add", "output": "3"}, {"instruction": "add 2"})
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert f"{path} line 2: missing field `output` (instruction format)" in err


def test_unknown_role(tmp_path, capsys, no_ray):
    path = jsonl(tmp_path / "chat.jsonl", GOOD, {"messages": [{"role": "robot", "content": "beep"}]})
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert f"{path} line 2: messages[0]: unknown role 'robot'" in err


def test_non_string_content(tmp_path, capsys, no_ray):
    path = jsonl(tmp_path / "chat.jsonl", {"messages": [{"role": "user", "content": 3}]}, GOOD)
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert f"{path} line 1: messages[0].content must be a string or a list of content parts, got int" in err


@pytest.mark.parametrize("kind", ["conversation", "file"])
def test_empty_conversation_or_file(tmp_path, capsys, no_ray, kind):
    path = jsonl(tmp_path / "chat.jsonl", GOOD, {"messages": []}) if kind == "conversation" else tmp_path / "chat.jsonl"
    if kind == "file":
        path.write_text("")
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert (f"{path} line 2: empty conversation" if kind == "conversation" else f"{path}: empty file") in err


def test_mixed_formats_in_one_file(tmp_path, capsys, no_ray):
    path = jsonl(tmp_path / "data.jsonl", GOOD, {"prompt": "2+2=", "completion": "4"})
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert (f"{path} line 2: a completion row, but the file's first row is a chat row; one format per file: "
            "split the file, or set data.format\n") in err
    # an instruction row first, then mostly chats: the mix is named, and so is what skipping would keep
    inst = {"instruction": "add", "output": "3"}
    path = jsonl(tmp_path / "data.jsonl", inst, GOOD, GOOD, inst, *[GOOD] * 9, inst, inst)
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert err.endswith(f"{path} line 2: a chat row, but the file's first row is an instruction row; one format per "
                        "file: split the file, or set data.format (10 more rows of another format; "
                        "data.on_bad_rows=skip would keep 4 of 15 rows)\n")


def test_missing_path(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, f"data.paths=[{tmp_path / 'typo.jsonl'}]")
    assert f"data.paths: {tmp_path / 'typo.jsonl'}: no such file or folder" in err


def test_empty_folder(tmp_path, capsys, no_ray):
    (tmp_path / "data").mkdir()
    err = train(tmp_path, capsys, f"data.paths=[{tmp_path / 'data'}]")
    assert f"data.paths: {tmp_path / 'data'}: folder holds no .jsonl" in err


def test_unreachable_uri(tmp_path, capsys, no_ray, monkeypatch):
    # An S3 endpoint that refuses connections: what a wrong region, endpoint or network gives,
    # without leaving the machine.
    for key, value in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
                       "AWS_SECRET_ACCESS_KEY": "y", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    err = train(tmp_path, capsys, "data.paths=[s3://raypack-no-such-bucket/chat.jsonl]")
    assert "data.paths: s3://raypack-no-such-bucket/chat.jsonl: can't read it (" in err


def test_unknown_strategy(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, "pack.strategy=bogus")
    # refused when the config loads (one strategy registry, raypack.data.strategies), naming the choices
    assert err.startswith("raypack: config error: ") and "pack.strategy: unknown packing strategy 'bogus'" in err
    assert "expected one of pad, " in err and err.count("\n") == 1


def test_config_is_a_folder(tmp_path, capsys, no_ray):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny_cpu.yaml").write_text("")
    err = train(tmp_path, capsys, "--config", str(tmp_path / "configs"))
    assert err == f"raypack: config error: {tmp_path / 'configs'}: is a folder, not a config file; its YAML files: tiny_cpu.yaml\n"


def test_infinite_lr(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, "train.lr=inf")
    assert "train.lr: expected a finite number, got inf" in err


def test_unknown_model(tmp_path, capsys, no_ray, monkeypatch):
    import huggingface_hub.constants

    # Offline, as this machine is: the hub is not asked (it retries for ~30 s without a network).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = train(tmp_path, capsys, "model.name=no-such-org/no-such-model")
    assert ("model.name 'no-such-org/no-such-model': not a local folder, not in the Hugging Face cache (" in err
            and err.endswith("and HF_HUB_OFFLINE is set, so the hub is not asked\n"))
    err = train(tmp_path, capsys, "model.name=tiny-nope")
    assert "model.name 'tiny-nope': unknown tiny model family 'nope'" in err


def test_token_id_above_the_vocabulary(tmp_path, capsys, no_ray):
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 5, 9], [1, 767, 768, 4]]}), path)  # the bundled tokenizer has 768
    err = train(tmp_path, capsys, f"data.paths=[{path}]")
    assert f"{path} row 1 (0-based): input_ids[2] = 768 is outside the model's vocabulary (ids 0..767)" in err


def test_changed_sources_under_an_existing_run(tmp_path, capsys, no_ray):
    """The packed data's manifest, as prepare writes it, records the sources; one edited since
    is refused. (tests/ray/data/test_prepare.py makes the manifest with a real prepare.)"""
    from raypack.config import load
    from raypack.data.cache import packed_key
    from raypack.data.listing import Sources
    from raypack.runs import absolute_paths

    path = jsonl(tmp_path / "chat.jsonl", GOOD, GOOD)
    overrides = [f"run.storage_path={tmp_path / 'runs'}", "run.name=r", f"data.paths=[{path}]"]
    cfg = absolute_paths(load(None, overrides))  # what preflight keys the run's data by
    packed = tmp_path / "runs" / "r" / "packed"
    packed.mkdir(parents=True)
    manifest = {"fingerprint": packed_key(cfg, cfg.train.num_workers), "sources": Sources.of(cfg.data.paths).fingerprint,
                "prepared": {}}
    (packed / "manifest.json").write_text(json.dumps(manifest))
    jsonl(path, GOOD, GOOD, GOOD)  # edited in place
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data.paths changed since this run's data was prepared in {packed}: {path}: content changed" in err
    assert "run.name=NEW_NAME" in err and "--reprepare" in err
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir()) == ["packed"], "the run was touched"


def test_debug_prints_the_traceback(tmp_path, capsys, no_ray):
    assert main(["train", "--debug", f"run.storage_path={tmp_path}", f"data.paths=[{tmp_path / 'typo.jsonl'}]"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1].startswith("raypack: error: data.paths: ")


def test_sample_data_passes(tmp_path, capsys, no_ray):
    """Guard the guards: good input gets past every check, to the first Ray call."""
    with pytest.raises(AssertionError, match="Ray was started"):
        main(["train", f"run.storage_path={tmp_path}", f"data.paths=[{ASSETS / 'sample' / 'chat.jsonl'}]"])


# --- what would be accepted and silently do something else (issue 36, part 3) ------------------


def test_a_config_file_that_holds_no_mapping_of_sections(tmp_path, capsys, no_ray):
    """Empty (or only comments), or a list or scalar at the top: not the defaults in silence."""
    path = tmp_path / "run.yaml"
    for text, said in (("", "the config is empty"), ("# train:\n#   lr: 1e-4\n", "the config is empty"),
                       ("- train\n", "expected a mapping of sections at the top level, got list"),
                       ("0\n", "expected a mapping of sections at the top level, got int")):
        path.write_text(text)
        err = train(tmp_path, capsys, "--config", str(path))
        assert err.startswith(f"raypack: config error: {path}: {said}"), err


def test_a_key_given_twice_in_the_yaml(tmp_path, capsys, no_ray):
    """PyYAML keeps the last of two equal keys; a section written twice would lose the first's settings."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-4\nmodel:\n  name: tiny-llama\ntrain:\n  epochs: 2\n")
    err = train(tmp_path, capsys, "--config", str(path))
    assert err == (f"raypack: config error: {path}: line 5: key 'train' given twice (first on line 1); YAML keeps "
                   "only the last, so merge the two\n")
    path.write_text("train:\n  lr: 1.0e-4\n  epochs: 2\n  lr: 3.0e-4\n")  # inside a section too
    assert "line 4: key 'lr' given twice (first on line 2)" in train(tmp_path, capsys, "--config", str(path))


def test_settings_of_a_section_that_is_switched_off(tmp_path, capsys, no_ray):
    """Found from the config dataclasses (a section whose `enabled` property is False, or whose
    SWITCHED_ON_BY field holds another value), so every such section is covered: adapter settings
    without an adapter method, W&B names with W&B off, DPO's with the SFT objective, ASHA's without
    the ASHA scheduler."""
    err = train(tmp_path, capsys, "model.peft.r=8")
    assert err == ("raypack: config error: override model.peft.r=8: model.peft.r: set to 8, which does nothing while "
                   "model.peft.method is none; set model.peft.method to lora or qlora, or remove it\n")
    for override, said in (("dpo.beta=0.2", "dpo.beta: set to 0.2, which does nothing while train.objective is sft; "
                                            "set train.objective to dpo, or remove it"),
                           ("tune.asha.grace_period=5", "tune.asha.grace_period: set to 5, which does nothing while "
                                                        "tune.scheduler is none; set tune.scheduler to asha")):
        assert train(tmp_path, capsys, override).startswith(f"raypack: config error: override {override}: {said}")
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  wandb:\n    project: my-sft\n")
    err = train(tmp_path, capsys, "--config", str(path))
    assert err.startswith(f"raypack: config error: {path} (with overrides): run.wandb.project: set to 'my-sft', which does nothing "
                          "while run.wandb.mode is disabled; set run.wandb.mode to online or offline"), err


def test_the_override_not_the_file_is_named_when_it_holds_the_bad_value(tmp_path, capsys, no_ray):
    config = REPO / "jobs" / "configs" / "tiny_cpu.yaml"
    err = train(tmp_path, capsys, "pack.strategy=bogus", "--config", str(config))
    assert err.startswith("raypack: config error: override pack.strategy=bogus: pack.strategy: unknown packing "
                          "strategy 'bogus'"), err
    err = train(tmp_path, capsys, "train.lr=-1", "--config", str(config))
    assert err.startswith("raypack: config error: override train.lr=-1: train.lr: expected a positive float"), err


def test_resume_takes_only_the_overrides_a_rerun_may_change_and_no_config(tmp_path, capsys, no_ray):
    """--config and run.name= with --resume were ignored, train.lr= applied to one invocation only:
    each is refused, naming what a rerun may change; a missing folder is called missing."""
    from raypack.config import load
    from raypack.runs import save_config

    save_config(load(None, [f"run.storage_path={tmp_path / 'runs'}", "run.name=r"]))
    run = tmp_path / "runs" / "r"
    for args, said in (
        (["--config", str(REPO / "jobs" / "configs" / "tiny_cpu.yaml")],
         f"--resume {run} continues the run with the config it saved (raypack_config.yaml there), not --config"),
        (["run.name=other"], f"--resume {run}: override run.name=other: a resumed run trains the config it was "
                             "started with; a rerun may change only train.epochs, train.max_steps, "),
        (["train.lr=1e-5"], f"--resume {run}: override train.lr=1e-5: "),
    ):
        assert main(["train", "--resume", str(run), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"raypack: config error: {said}") and err.count("\n") == 1, err
    assert "run.wandb.*" in err and "run.name=NEW_NAME" in err
    assert main(["train", "--resume", str(tmp_path / "typo")]) == 2
    assert capsys.readouterr().err == f"raypack: config error: --resume {tmp_path / 'typo'}: no such folder\n"
    assert sorted(p.name for p in run.iterdir()) == ["raypack_config.yaml"], "the run was touched"


def test_a_data_file_that_is_not_json_lines(tmp_path, capsys, no_ray):
    """A binary file, a JSON array or a pretty-printed object named .json or .jsonl: told what it
    is, not that its rows lack the expected fields."""
    cases = {
        "model.jsonl": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "a binary file: byte 0x"),
        "data.json": (json.dumps([GOOD, GOOD], indent=2).encode(), "a JSON array: write one object per line"),
        "one.json": (json.dumps(GOOD, indent=2).encode(), "a JSON object over several lines"),
    }
    for name, (content, said) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        err = train(tmp_path, capsys, f"data.paths=[{path}]")
        assert err.startswith(f"raypack: error: {path}: not JSON Lines ({said}"), err
        assert err.endswith("raypack reads one JSON object per line\n"), err


def test_a_tokenizer_folder_that_does_not_exist(tmp_path, capsys, no_ray):
    """A path, not a hub name: said to be missing, not a repo id the hub refuses."""
    for path in (tmp_path / "tok", "./my/tokenizer"):
        err = train(tmp_path, capsys, f"tokenize.tokenizer={path}")
        assert err == f"raypack: error: tokenize.tokenizer '{path}': no such folder, and not a hub name (org/name)\n"


@pytest.fixture
def server():
    """A local HTTP server answering every request with the status the test sets (and a socket
    that accepts connections and never answers), both on 127.0.0.1."""
    import http.server
    import socket
    import threading

    state = {"status": 200, "paths": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            state["paths"].append(self.path)
            self.send_response(state["status"])
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    state["silent"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
    yield state
    httpd.shutdown()
    silent.close()


def test_a_tracker_that_cannot_work_here(tmp_path, capsys, no_ray, monkeypatch, server):
    """Checked before Ray starts, in bounded time, never retried: its package missing, its settings
    refused by its own validation, its server not answering or refusing the key."""
    import importlib.util
    import time

    from raypack.train import tracking

    monkeypatch.setattr(tracking, "REACH_TIMEOUT_S", 1.0)
    for key in ("WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    err = train(tmp_path, capsys, "train.mlflow=true")
    assert err == ("raypack: config error: train.mlflow: true needs mlflow: pip install 'raypack[tracking]' (or set "
                   "train.mlflow=false)\n")
    err = train(tmp_path, capsys, "run.wandb.mode=offline", "run.wandb.project=team/sft")
    assert err.startswith("raypack: config error: run.wandb: Invalid project name 'team/sft': cannot contain"), err

    online = ("run.wandb.mode=online",)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: refused at once
    err = train(tmp_path, capsys, *online)
    assert err == ("raypack: error: run.wandb.mode=online: can't reach the W&B server at http://127.0.0.1:9 within 1 s "
                   "([Errno 111] Connection refused); log offline with run.wandb.mode=offline (then `wandb sync`), or "
                   "fix the network or WANDB_BASE_URL\n")
    monkeypatch.setenv("WANDB_BASE_URL", server["silent"])  # connects, never answers: the time is bounded
    t0 = time.perf_counter()
    err = train(tmp_path, capsys, *online)
    assert "within 1 s (timed out); log offline with run.wandb.mode=offline" in err
    assert time.perf_counter() - t0 < 30
    monkeypatch.setenv("WANDB_BASE_URL", server["url"])
    server["status"] = 401
    err = train(tmp_path, capsys, *online)
    assert err == (f"raypack: error: run.wandb.mode=online: the W&B server at {server['url']} refused the API key (HTTP "
                   "401); check WANDB_API_KEY or run `wandb login` again\n")
    server["status"] = 404  # something answers there, not W&B (a proxy, a typo in WANDB_BASE_URL)
    err = train(tmp_path, capsys, *online)
    assert f"run.wandb.mode=online: {server['url']} answered HTTP 404 where a W&B server answers its API" in err
    assert server["paths"] == ["/graphql"] * 2

    # as if mlflow were installed: its server
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mlflow" else find_spec(name, *a))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    err = train(tmp_path, capsys, "train.mlflow=true")
    assert err.startswith("raypack: error: train.mlflow: can't reach MLFLOW_TRACKING_URI http://127.0.0.1:9 within 1 s"), err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    server["status"], server["paths"] = 200, []
    with pytest.raises(AssertionError, match="Ray was started"):  # a server that answers: on to Ray
        main(["train", f"run.storage_path={tmp_path / 'runs'}", "run.name=r", "train.mlflow=true"])
    assert server["paths"] == ["/health"]


VLM_CONFIG = REPO / "jobs" / "configs" / "vlm_quickstart.yaml"
VLM_DPO_CONFIG = REPO / "jobs" / "configs" / "vlm_dpo_quickstart.yaml"


@pytest.mark.parametrize("rows", ["chat", "preference"])
@pytest.mark.parametrize("command", ["train", "data"])
@pytest.mark.parametrize("case", ["missing image", "placeholders", "undecodable", "huge"])
def test_bad_image_rows_name_the_file_and_line(tmp_path, capsys, no_ray, command, case, rows):
    """The four ways an image row goes bad, each one line naming the file and line, through
    `raypack train` and `raypack data` on the VLM quickstart's config (chat rows) and the VLM DPO
    quickstart's (preference pairs whose prompt has the image), before Ray starts."""
    picture = (ASSETS / "vision_sample" / "images" / "000.png").read_bytes()
    (tmp_path / "ok.png").write_bytes(picture)
    (tmp_path / "bad.png").write_bytes(picture[:40])  # a PNG header and then nothing
    (tmp_path / "huge.png").write_bytes(huge_png())  # 20000 x 20000, says its header
    question = {"role": "user", "content": "<image>What is it?"}
    if rows == "chat":
        good = {"messages": [question, {"role": "assistant", "content": "A shape."}], "images": ["ok.png"]}
    else:
        good = {"prompt": [question], "chosen": [{"role": "assistant", "content": "A shape."}],
                "rejected": [{"role": "assistant", "content": "A cat."}], "images": ["ok.png"]}  # fmt: skip
    bad = {
        "missing image": {**good, "images": ["nowhere.png"]},
        "placeholders": {**good, "images": ["ok.png", "ok.png"]},
        "undecodable": {**good, "images": ["bad.png"]},
        "huge": {**good, "images": ["huge.png"]},
    }[case]
    path = jsonl(tmp_path / "vision.jsonl", good, good, bad, good)
    config = VLM_CONFIG if rows == "chat" else VLM_DPO_CONFIG
    err = train(tmp_path, capsys, f"data.paths=[{path}]", "--config", str(config), command=command)
    assert f"{path} line 3: " in err
    assert {"missing image": f"image 'nowhere.png' can't be read: no such file '{tmp_path / 'nowhere.png'}'",
            "placeholders": "1 <image> placeholder(s) in messages but 2 image(s) in 'images'",
            "undecodable": "image 'bad.png' is not a decodable image",
            "huge": "image 'huge.png' is 20000x20000, 400,000,000 pixels, over data.max_image_pixels (178,956,970); "
                    "make it smaller, or raise data.max_image_pixels"}[case] in err  # fmt: skip


def test_freezing_a_vision_tower_a_text_model_lacks(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, "model.freeze=[vision]", "--config", str(REPO / "jobs" / "configs" / "tiny_cpu.yaml"))
    assert "model.freeze=['vision']: model.name 'tiny-llama' is not a vision-language model" in err


# What the workers' setup refused 30-50 s in, after Ray and the worker group started, refused here
# (raypack/train/preflight_setup.py; what needs a forward stays in the workers, listed there).


def test_tiled_mlps_on_layers_without_an_mlp(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, "model.name=tiny-nemotron_h", "model.tiled_mlp_tokens=8")
    assert err == ("raypack: error: model.tiled_mlp_tokens: NemotronHBlock has no MLP under a name raypack knows (mlp, "
                   "feed_forward, block_sparse_moe); set it to 0\n")


def test_a_router_loss_coefficient_on_a_model_that_builds_no_router(tmp_path, capsys, no_ray):
    """Nemotron-H's config carries expert settings, so the config check passes; its layers build none."""
    err = train(tmp_path, capsys, "model.name=tiny-nemotron_h", "train.router_aux_loss_coef=0.01")
    assert "model.name 'tiny-nemotron_h': train.router_aux_loss_coef=0.01, but it builds no mixture-of-experts layer" in err


def test_qlora_on_a_model_built_from_a_config(tmp_path, capsys, no_ray):
    err = train(tmp_path, capsys, "model.peft.method=qlora", "train.use_gpu=true")
    assert "model.peft.method=qlora: model.name 'tiny-llama' is built from a config, with no checkpoint" in err


def test_lora_on_a_convolution_a_hybrid_layer_reads_by_weight(tmp_path, capsys, no_ray):
    """A Bamba config folder (no weights): its Mamba-2 layer hands conv1d.weight to the convolution
    itself on every path, so an adapter there would never run (raypack/model/mixers.py)."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from families import FAMILIES

    config = FAMILIES["bamba"].build_config("bamba")
    config.vocab_size = 1024
    config.save_pretrained(tmp_path / "bamba")
    err = train(tmp_path, capsys, f"model.name={tmp_path / 'bamba'}", "model.peft.method=lora", "model.peft.r=96",
                "model.peft.alpha=16", "model.peft.target_modules=[in_proj,conv1d]")
    assert (f"reaches model.layers.0.mamba.conv1d, whose weight the Mamba-2 layer hands its convolution itself, never "
            "calling the module, so an adapter there would never run or train; leave it out\n") in err


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_run_folder_another_command_holds(tmp_path, capsys, no_ray, command):
    """A second `raypack train` (or `sweep`) on a folder a live command holds: one line naming the
    owner, before Ray starts, and the owner's folder as it was."""
    from lockholder import holder, let_go

    root = tmp_path / "runs" / "r"
    proc = holder(str(root), command)
    before = sorted(p.name for p in root.iterdir())
    try:
        config = ["--config", str(REPO / "jobs" / "configs" / "sweeps" / "packing_cpu.yaml")] if command == "sweep" else []
        code = main([command, *config, f"run.storage_path={tmp_path / 'runs'}", "run.name=r"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        what = "sweep" if command == "sweep" else "run"
        assert err.startswith(f"raypack: error: {what} 'r' in {root} is in use by raypack {command} (pid {proc.pid} on "
                              "host "), err
        assert sorted(p.name for p in root.iterdir()) == before
    finally:
        let_go(proc)


INSTRUCTION = {"instruction": "add 2 and 2", "output": "4"}


def sources(*items: tuple[str, str]) -> str:
    """A data.sources override: each item (path, the rest of its mapping in YAML flow)."""
    return "data.sources=[" + ", ".join(f"{{paths: [{p}]{', ' + rest if rest else ''}}}" for p, rest in items) + "]"


@pytest.mark.parametrize("case", ["unknown field", "weight 0", "a weight on one source only", "share under one example",
                                  "format not told", "missing path"])
def test_a_bad_source_of_a_mixture_is_named_by_index_and_paths(tmp_path, capsys, no_ray, case):
    chat = jsonl(tmp_path / "chat.jsonl", *[GOOD] * 50)
    inst = jsonl(tmp_path / "inst.jsonl", *[INSTRUCTION] * 5)
    where = f"data.sources[1] (paths: {inst})"
    override, expected = {
        "unknown field": (sources((chat, "weight: 1"), (inst, "wieght: 1")),
                          f"data.sources[1].wieght: unknown key; did you mean data.sources[1].weight?"),
        "weight 0": (sources((chat, "weight: 1"), (inst, "weight: 0")),
                     f"{where}: weight: expected a number > 0 (a share of the epoch), got 0.0"),
        "a weight on one source only": (sources((chat, "weight: 1"), (inst, "")),
                                        f"{where}: weight: expected a weight on every source or on none"),
        # 55 rows at most, of which 1 / 1001 is 0.055 of an example: too few whatever eval and tokenize leave
        "share under one example": (sources((chat, "weight: 1000"), (inst, "weight: 1")),
                                    f"{where}: weight 1 of 1001 names at most 0.055 of the at most 55 examples of an "
                                    "epoch (data.examples_per_epoch=sum), less than one; raise its weight"),
        "format not told": (sources((chat, ""), (jsonl(tmp_path / "odd.jsonl", {"question": "2+2?", "answer": "4"}), "")),
                            f"data.sources[1] (paths: {tmp_path / 'odd.jsonl'}): {tmp_path / 'odd.jsonl'}: can't tell "
                            "the format from the fields ['answer', 'question']"),
        "missing path": (sources((chat, ""), (tmp_path / "typo.jsonl", "")),
                         f"data.sources[1] (paths: {tmp_path / 'typo.jsonl'}): {tmp_path / 'typo.jsonl'}: no such file "
                         "or folder"),
    }[case]
    err = train(tmp_path, capsys, override)
    assert expected in err, err
    if case == "format not told":
        assert err.endswith("or set data.sources[1].format or its columns\n")


def test_the_same_mixture_fixed_passes(tmp_path, capsys, no_ray):
    """Guard the guards: each source above, made right, gets past every check to the first Ray call."""
    chat = jsonl(tmp_path / "chat.jsonl", *[GOOD] * 50)
    inst = jsonl(tmp_path / "inst.jsonl", *[INSTRUCTION] * 5)
    odd = jsonl(tmp_path / "odd.jsonl", {"question": "2+2?", "answer": "4"})
    fixed = sources((chat, "weight: 20"), (inst, "weight: 1"),
                    (odd, "weight: 1, columns: {prompt: question, completion: answer}"))
    with pytest.raises(AssertionError, match="Ray was started"):
        main(["train", f"run.storage_path={tmp_path}", fixed])


@pytest.mark.parametrize("overrides,says", [
    (["train.deepspeed_preset=zero2"], "train.deepspeed_preset: expected null with train.engine torch"),
    (["train.optimizer=deepspeed"], "train.optimizer: expected torch with train.engine torch"),
    (["train.zero_stage=0", "train.offload_optimizer=true"],
     "train.offload_optimizer: expected false with train.engine torch and train.zero_stage 0"),
    (["train.use_gpu=true", "model.peft.method=qlora"],
     "model.peft.method: expected lora or none with train.engine torch and train.zero_stage 1-3"),
])  # fmt: skip
def test_what_the_torch_engine_cant_do_is_one_line_naming_the_engine(tmp_path, capsys, no_ray, overrides, says):
    """train.engine torch (raypack/train/engines/torch_engine.py): DeepSpeed's own settings, and
    what FSDP2 can't shard, refused before Ray starts."""
    err = train(tmp_path, capsys, "train.engine=torch", *overrides)
    assert says in err, err


def test_a_saved_model_with_a_missing_shard(tmp_path, capsys, no_ray):
    """A published checkpoint's folder whose index names a shard the copy lost: the index named,
    from its headers alone (tests/unit/model/test_folder.py has every class of broken folder)."""
    import shutil

    from checkpoints import saved

    folder = tmp_path / "model"
    shutil.copytree(saved("tiny-llama", vocab_size=1024), folder)
    shard = min(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    (folder / shard).unlink()
    err = train(tmp_path, capsys, f"model.name={folder}", "model.dtype=bfloat16")
    assert err == f"raypack: error: {folder}/model.safetensors.index.json: names the shard {shard}, which is not in the folder\n"
