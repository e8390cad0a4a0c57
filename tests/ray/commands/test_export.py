"""`raypack export`, then `raypack chat` on what it wrote, on real runs of 4 steps each with a
checkpoint every 2, shared by the tests: a ZeRO-3 fine-tune and a ZeRO-3 LoRA run of the tiny
model built from its config, the same LoRA run on the torch engine's FSDP2 (its losses equal the
ZeRO-3 run's step by step: one base and one adapter init under every engine and stage), and a
ZeRO-2 LoRA run from a saved bf16 folder, as users train a published checkpoint; and a ZeRO-3
LoRA run of each other model kind from its saved folder (the MoE here, each hybrid mixer under
`-m slow`), exported and chatted with.

The references are independent of the export's code: the middle checkpoint against the output of
the `zero_to_fp32.py` script DeepSpeed saved into that checkpoint, the last against the final
`model/` the training loop wrote itself, and the step a checkpoint holds from its step log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from raypack.cli import main
from raypack.config import load

from answers import greedy
from paths import REPO

pytestmark = pytest.mark.ray

IDS = torch.tensor([[5, 9, 33, 7, 100, 4, 61, 200]])


def train(storage: Path, *overrides: str) -> Path:
    from raypack.train import trainer

    cfg = load(REPO / "jobs" / "configs" / "tiny_cpu.yaml", [
        # one cache: the second run reuses the first one's tokenized and packed data (seconds on 2 cores)
        f"run.storage_path={storage}", f"data.cache_path={storage.parent / 'cache'}",
        f"run.name=r-{uuid.uuid4().hex[:6]}", "pack.budget=256", "train.grad_accum=1",
        "train.zero_stage=3", "train.max_steps=4", "train.checkpoint_every_steps=2", "train.eval_every_steps=2",
        "train.report_every_steps=2", "data.eval_fraction=0.2", *overrides,
    ])  # fmt: skip
    return Path(trainer.start(cfg).root)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export") / "runs"


@pytest.fixture(scope="module")
def full_run(ray_local, runs_dir) -> Path:
    return train(runs_dir)


LORA = ("model.peft.method=lora", "model.peft.r=4", "train.lr=1e-2")


@pytest.fixture(scope="module")
def lora_run(ray_local, runs_dir) -> Path:
    return train(runs_dir, *LORA)


@pytest.fixture(scope="module")
def torch_lora_run(ray_local, runs_dir) -> Path:
    """lora_run on the torch engine (FSDP2, stage 2), with no merged model/ (model.peft.merge=false)."""
    return train(runs_dir, *LORA, "train.engine=torch", "train.zero_stage=2", "model.peft.merge=false")


@pytest.fixture(scope="module")
def saved_lora_run(ray_local, runs_dir) -> Path:
    """A published checkpoint's LoRA run: the base a saved bf16 folder, as users load theirs."""
    from checkpoints import saved
    from transformers import AutoTokenizer

    from raypack.config import ASSETS

    base = saved("tiny-llama", vocab_size=len(AutoTokenizer.from_pretrained(ASSETS / "tokenizer")))
    return train(runs_dir, *LORA, f"model.name={base}", "model.dtype=bfloat16", "train.zero_stage=2")


def checkpoints(run: Path) -> dict[int, Path]:
    """Each kept checkpoint by the last step of its own step log (not by what the export reads)."""
    from raypack.train.checkpoint import read_steps_log

    return {read_steps_log(c / "steps_rank0.npz")[-1][0]: c for c in run.glob("checkpoint_*") if c.is_dir()}


def logits(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=IDS).logits


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_middle_checkpoint_is_deepspeeds_own_consolidation_of_it(full_run, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    code, out, err = export(capsys, full_run, "--checkpoint", 2)
    assert code == 0, err
    folder = full_run / "export" / "step_2" / "model"
    assert f"[raypack] exported step 2 (float32) to {full_run}/export/step_2" in out
    assert f'AutoModelForCausalLM.from_pretrained("{folder}")' in out and f"raypack chat {folder}" in out
    info = json.loads((full_run / "export" / "step_2" / "raypack_export.json").read_text())
    ckpts = checkpoints(full_run)
    assert sorted(ckpts) == [2, 4] and info["checkpoint"] == ckpts[2].name and info["step"] == 2

    # DeepSpeed's own script, run as its docs say, on the checkpoint's ZeRO-3 shards
    script = subprocess.run([sys.executable, ckpts[2] / "zero_to_fp32.py", ckpts[2], tmp_path / "ref", "--tag", "ds",
                             "--safe_serialization"], capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr[-2000:]
    final = ckpts[4] / "model"  # written by the training loop: the run's model config and tokenizer
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(final))
    from safetensors.torch import load_file

    reference.load_state_dict(load_file(tmp_path / "ref" / "model.safetensors"), strict=True)
    with torch.no_grad():
        expected = reference.eval()(input_ids=IDS).logits
    middle = logits(folder)
    assert torch.equal(middle, expected)
    assert not torch.allclose(middle, logits(final)), "the middle checkpoint's model is the last one's"
    exported, trained = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(final)
    assert exported.chat_template and exported.chat_template == trained.chat_template
    assert exported.get_vocab() == trained.get_vocab()


def test_the_last_checkpoint_is_the_final_model_bit_for_bit(full_run, capsys):
    from safetensors.torch import load_file

    code, out, err = export(capsys, full_run, "--out", full_run / "last")  # the default: the last checkpoint
    assert code == 0, err
    ours = load_file(full_run / "last" / "model" / "model.safetensors")
    final = load_file(checkpoints(full_run)[4] / "model" / "model.safetensors")
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in ours)
    assert json.loads((full_run / "last" / "model" / "config.json").read_text())["use_cache"] is True
    umask = os.umask(0)
    os.umask(umask)
    for path in (full_run / "last").rglob("*"):  # safetensors writes its file 0600 through a temporary one
        assert path.stat().st_mode & 0o777 == (0o777 if path.is_dir() else 0o666) & ~umask, path

    code, _, err = export(capsys, full_run, "--out", full_run / "last-bf16", "--dtype", "bfloat16")
    assert code == 0, err
    half = load_file(full_run / "last-bf16" / "model" / "model.safetensors")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], final[k].bfloat16()) for k in final)


def test_best_eval_loss_picks_the_lowest_reported(full_run, tmp_path, capsys):
    """On a copy of the run whose record says step 2 evaluated best (the real run improves every step)."""
    copy = tmp_path / full_run.name
    shutil.copytree(full_run, copy, ignore=shutil.ignore_patterns("packed", "tensorboard", "export", "last*"))
    snapshot = json.loads((copy / "checkpoint_manager_snapshot.json").read_text())
    losses = {r["metrics"]["step"]: r["metrics"]["eval_loss"] for r in snapshot["checkpoint_results"]}
    assert losses[4] < losses[2]
    code, _, err = export(capsys, copy, "--best", "eval_loss", "--out", tmp_path / "best")
    assert code == 0 and json.loads((tmp_path / "best" / "raypack_export.json").read_text())["step"] == 4, err

    for result in snapshot["checkpoint_results"]:
        result["metrics"]["eval_loss"] = {2: 1.0, 4: 2.0}[result["metrics"]["step"]]
    (copy / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    code, out, err = export(capsys, copy, "--best", "eval_loss", "--out", tmp_path / "best2")
    assert code == 0 and "[raypack] exported step 2 " in out, err

    for result in snapshot["checkpoint_results"]:
        result["metrics"].pop("eval_loss")
    (copy / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    code, _, err = export(capsys, copy, "--best", "eval_loss", "--out", tmp_path / "best3")
    assert code == 2 and err.count("\n") == 1, err
    assert f"run {copy}: no checkpoint reported eval_loss (checkpoints at steps 2, 4)" in err
    assert not (tmp_path / "best3").exists()


def test_a_step_without_a_checkpoint_is_one_line_naming_the_run_and_its_steps(full_run, tmp_path, capsys):
    code, _, err = export(capsys, full_run, "--checkpoint", 3, "--out", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1, err
    assert f"raypack: error: run {full_run} has no checkpoint at step 3; its checkpoints are at steps 2, 4" in err
    assert not (tmp_path / "x").exists()


def reseeded(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` whose saved config has another train.seed: a tiny base rebuilt from it is
    not the one the run trained on, so export must take the final checkpoint's base/."""
    import dataclasses

    from raypack import runs
    from raypack.config import dumps

    copy = tmp_path / f"{run.name}-reseeded"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("packed", "tensorboard", "export"))
    cfg = runs.saved_config(str(copy))
    (copy / runs.SAVED_CONFIG).write_text(dumps(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1))))
    return copy


def test_a_uri_run_is_downloaded_and_needs_out(full_run, lora_run, tmp_path, capsys):
    """`file://` stands for object storage: the same pyarrow filesystem calls reach S3 or GCS."""
    from safetensors.torch import load_file

    from raypack.train.export import export as export_here

    code, _, err = export(capsys, f"file://{full_run}", "--checkpoint", 2)
    assert code == 2 and "name a local folder for the export with --out" in err, err
    for run in (full_run, reseeded(lora_run, tmp_path)):  # LoRA: the base weights from the final base/, downloaded
        code, out, err = export(capsys, f"file://{run}", "--checkpoint", 2, "--out", tmp_path / run.name / "uri")
        assert code == 0, err
        assert run == full_run or "/base: their checksums match" in out, out
        export_here(str(run), step=2, out=str(tmp_path / run.name / "local"), log=lambda line: None)
        ours = load_file(tmp_path / run.name / "uri" / "model" / "model.safetensors")
        local = load_file(tmp_path / run.name / "local" / "model" / "model.safetensors")
        assert ours.keys() == local.keys() and all(torch.equal(ours[k], local[k]) for k in local)


def test_lora_middle_checkpoint_exports_adapter_merged_model_and_base_that_agree(lora_run, capsys):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    code, out, err = export(capsys, lora_run, "--checkpoint", 2)
    assert code == 0, err
    folder = lora_run / "export" / "step_2"
    assert {p.name for p in folder.iterdir()} == {"adapter", "model", "base", "raypack_export.json"}
    # the base rebuilt from train.seed (ZeRO-3 builds a tiny model as every engine and stage does),
    # checked against the checkpoint's checksums
    assert "base weights from tiny-llama initialized with train.seed=0: their checksums match" in out
    base = f'AutoModelForCausalLM.from_pretrained("{folder}/base")'
    assert f'PeftModel.from_pretrained({base}, "{folder}/adapter")' in out

    merged = logits(folder / "model")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base"), folder / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(input_ids=IDS).logits, merged, rtol=1e-4, atol=1e-5)

    # independently: the checkpoint's adapters by DeepSpeed's consolidation, on the run's final base/
    ckpts = checkpoints(lora_run)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpts[4] / "base"), ckpts[4] / "adapter")
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpts[2]), tag="ds", exclude_frozen_parameters=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=IDS).logits, merged, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(merged, logits(ckpts[4] / "model")), "the middle checkpoint's adapters are the last's"


def test_lora_without_its_base_weights_is_refused_and_adapter_only_still_exports(lora_run, tmp_path, capsys):
    """A ZeRO-3 run whose base was built from a config, with another train.seed in its saved config
    (what model.name names is not what it trained on): the base comes from the run's final base/,
    whose checksums match; without base/ (the run unfinished) the merged model can't be made
    exactly, and is refused; the adapter alone can be exported, and chat says it has no base."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    copy = reseeded(lora_run, tmp_path)
    code, out, err = export(capsys, copy, "--checkpoint", 2, "--out", tmp_path / "from-base")
    assert code == 0, err
    assert "initialized with train.seed=1" not in out and "/base: their checksums match the checkpoint's" in out
    code, _, err = export(capsys, lora_run, "--checkpoint", 2, "--out", tmp_path / "from-seed")
    assert code == 0, err
    ours, theirs = (load_file(tmp_path / f / "model" / "model.safetensors") for f in ("from-base", "from-seed"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)

    for base in copy.glob("checkpoint_*/base"):
        shutil.rmtree(base)
    code, _, err = export(capsys, copy, "--checkpoint", 2, "--out", tmp_path / "merged")
    assert code == 2 and err.count("\n") == 1, err
    assert "were trained on other base weights than" in err and "--adapter-only" in err
    assert not (tmp_path / "merged").exists()

    code, out, err = export(capsys, copy, "--checkpoint", 2, "--out", tmp_path / "alone", "--adapter-only")
    assert code == 0, err
    assert {p.name for p in (tmp_path / "alone").iterdir()} == {"adapter", "raypack_export.json"}
    assert "raypack chat" not in out  # no base to chat with: built from a config, not saved with it
    alone = load_file(tmp_path / "alone" / "adapter" / "adapter_model.safetensors")
    trained = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints(copy)[2]), tag="ds",
                                                       exclude_frozen_parameters=True)
    # peft's files drop the adapter's name ("default") from the keys
    assert alone.keys() == {k.replace(".default", "") for k in trained}
    assert all(torch.equal(alone[k.replace(".default", "")], v) for k, v in trained.items())
    assert main(["chat", str(tmp_path / "alone"), "--prompt", "hi"]) == 2
    assert "names no base model (base_model_name_or_path) and no base/ is beside it" in capsys.readouterr().err


def chat(capsys, target: Path) -> tuple[str, str]:
    """`raypack chat TARGET --prompt hello --temperature 0`: its answer (stdout) and status lines."""
    assert main(["chat", str(target), "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def adapted(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype="auto"), adapter)


def test_torch_engine_lora_exports_and_trains_the_losses_of_zero3(lora_run, torch_lora_run, capsys):
    """FSDP2's LoRA checkpoint exports (its frozen weights' checksums are of each rank's shard, as
    export rebuilds them), as adapter/ beside base/ (merge: false), which chat loads; the run's
    losses are the ZeRO-3 run's step by step, and so are its adapters."""
    from trackfiles import tensorboard_scalars

    ours, theirs = (tensorboard_scalars(run / "tensorboard") for run in (torch_lora_run, lora_run))
    losses = sorted(tag for tag in theirs if tag.endswith("loss"))
    assert losses and all(sorted(ours[tag]) == sorted(theirs[tag]) for tag in losses), (ours.keys(), losses)
    for tag in losses:
        for step, value in theirs[tag].items():
            assert ours[tag][step] == pytest.approx(value, rel=1e-5), (tag, step)

    code, out, err = export(capsys, torch_lora_run, "--checkpoint", 2)
    assert code == 0, err
    folder = torch_lora_run / "export" / "step_2"
    assert {p.name for p in folder.iterdir()} == {"adapter", "base", "raypack_export.json"}
    assert "base weights from tiny-llama initialized with train.seed=0: their checksums match" in out
    assert f"chat:         raypack chat {folder}/adapter" in out
    model = adapted(folder / "base", folder / "adapter")
    code, _, err = export(capsys, lora_run, "--checkpoint", 2, "--out", folder.parent / "zero3")
    assert code == 0, err
    with torch.no_grad():  # the two engines' adapters of step 2, each on its own export's base
        torch.testing.assert_close(model(input_ids=IDS).logits, logits(folder.parent / "zero3" / "model"),
                                   rtol=1e-4, atol=1e-5)
    for target in (folder, folder / "adapter"):
        answer, status = chat(capsys, target)
        assert answer == greedy(model, folder / "adapter") + "\n"
        assert f"loading the peft adapter {folder}/adapter onto {folder}/base" in status


def test_a_saved_bf16_base_exports_adapter_and_merged_model_that_chat_loads(saved_lora_run, capsys):
    """A run from a saved bf16 folder (model.name a folder, as a published checkpoint): export
    takes the base from that folder (its checksums match), writes bf16, and chat answers through
    the merged model/, through adapter/ on the folder it names, and through an --adapter-only export."""
    from transformers import AutoModelForCausalLM

    base = runs_config(saved_lora_run).model.name
    code, out, err = export(capsys, saved_lora_run)
    assert code == 0, err
    folder = saved_lora_run / "export" / "step_4"
    assert {p.name for p in folder.iterdir()} == {"adapter", "model", "raypack_export.json"}
    assert f"base weights from {base}: their checksums match" in out and "(bfloat16)" in out
    merged = AutoModelForCausalLM.from_pretrained(folder / "model", dtype="auto")
    assert merged.dtype == torch.bfloat16
    answer, status = chat(capsys, folder)
    assert answer == greedy(merged, folder / "model") + "\n" and f"loading {folder}/model" in status
    model = adapted(base, folder / "adapter")
    expected = greedy(model, folder / "adapter") + "\n"
    answer, status = chat(capsys, folder / "adapter")
    assert answer == expected and f"onto {base}" in status

    code, out, err = export(capsys, saved_lora_run, "--adapter-only", "--out", folder.parent / "alone")
    assert code == 0, err
    assert f"chat:         raypack chat {folder.parent}/alone/adapter" in out
    answer, _ = chat(capsys, folder.parent / "alone")
    assert answer == expected


def runs_config(run: Path):
    from raypack import runs

    return runs.saved_config(str(run))


def test_chat_on_an_unfinished_run_exports_its_last_checkpoint_first(full_run, tmp_path, capsys):
    copy = tmp_path / full_run.name
    shutil.copytree(full_run, copy, ignore=shutil.ignore_patterns("packed", "tensorboard", "export", "last*",
                                                                 "raypack_result.json"))
    args = ["--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8"]
    assert main(["chat", str(copy), *args]) == 0
    unfinished = capsys.readouterr()
    assert "has no final model here: exporting its last checkpoint" in unfinished.err
    assert main(["chat", str(full_run), *args]) == 0  # finished: its final model/, as it is
    finished = capsys.readouterr()
    assert f"[raypack] loading {checkpoints(full_run)[4]}/model" in finished.err
    assert unfinished.out == finished.out and unfinished.out.strip()


def test_a_vlm_run_exports_with_its_image_processor_and_chats_about_a_picture(ray_local, runs_dir, tmp_path, capsys):
    """The tiny VLM quickstart, two steps: its last checkpoint's export is the final model/ bit for
    bit, with the image processor beside the tokenizer, and loads with AutoModelForImageTextToText."""
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from raypack.train import trainer

    cfg = load(REPO / "jobs" / "configs" / "vlm_quickstart.yaml", [
        f"run.storage_path={runs_dir}", f"run.name=vlm-{uuid.uuid4().hex[:6]}", "train.max_steps=2",
        "train.checkpoint_every_steps=2", "data.eval_fraction=0",
    ])  # fmt: skip
    run = Path(trainer.start(cfg).root)
    code, out, err = export(capsys, run, "--out", tmp_path / "vlm")
    assert code == 0, err
    model = tmp_path / "vlm" / "model"
    assert f'AutoModelForImageTextToText.from_pretrained("{model}")' in out and "--image" in out
    ours, final = load_file(model / "model.safetensors"), load_file(checkpoints(run)[2] / "model" / "model.safetensors")
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in ours)
    assert type(AutoModelForImageTextToText.from_pretrained(model)).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(model).merge_size == 2
    picture = REPO / "raypack" / "assets" / "vision_sample" / "images" / "000.png"
    assert main(["chat", str(model), "--image", str(picture), "--prompt", "Describe the picture.",
                 "--temperature", "0", "--max-new-tokens", "4"]) == 0


KINDS = [pytest.param("tiny-qwen3_moe", id="moe")] + [
    pytest.param(name, id=name.removeprefix("tiny-"), marks=pytest.mark.slow)
    for name in ("tiny-qwen3_5", "tiny-nemotron_h", "tiny-lfm2", "tiny-kimi_linear")]
"""The matrix's other model kinds (tests/ray/train/test_matrix.py: dense is the runs above, the VLM
the test above): the MoE in the default suite (its experts' adapters are peft's ParamWrapper, a
3-D weight each, merged by its own code), each hybrid mixer kind under `-m slow` (a run each)."""


@pytest.mark.parametrize("name", KINDS)
def test_each_model_kind_from_a_saved_folder_exports_adapter_and_merged_model_that_chat_loads(
        ray_local, runs_dir, name, capsys):
    """A LoRA run (ZeRO-3, every linear layer and the MoE's expert weights) from the kind's saved
    bf16 folder: export writes model/ and adapter/; the merged model is the base with the adapters
    (logits within bf16's rounding of peft's), every adapted weight moved by training, and chat
    answers through each as transformers' greedy generate does."""
    from checkpoints import as_user
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run = train(runs_dir, *LORA, *as_user(name))
    code, out, err = export(capsys, run)
    assert code == 0, err
    folder = run / "export" / "step_4"
    base = runs_config(run).model.name
    assert f"base weights from {base}: their checksums match" in out and "(bfloat16)" in out
    with safe_open(folder / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    if "moe" in name:  # both expert weights adapted (gate_up_proj under base_layer, down_proj outside)
        assert {k.split("mlp.experts.")[1] for k in keys if "mlp.experts." in k} >= {
            "lora_A.weight", "lora_B.weight", "base_layer.lora_A.weight", "base_layer.lora_B.weight"}, keys
    merged = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    with_adapter = adapted(base, folder / "adapter").float().eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, peft, before = (m(input_ids=IDS % merged.config.vocab_size).logits for m in (merged, with_adapter, plain))
    scale = peft.abs().max()
    assert (ours - peft).abs().max() < 2e-2 * scale, "the merged model is not the base with its adapters"
    assert (peft - before).abs().max() > 10 * (ours - peft).abs().max(), "training moved nothing the export shows"
    answer, status = chat(capsys, folder / "model")
    assert answer == greedy(AutoModelForCausalLM.from_pretrained(folder / "model", dtype="auto"), folder / "model") + "\n"
    answer, status = chat(capsys, folder / "adapter")
    assert answer == greedy(adapted(base, folder / "adapter"), folder / "adapter") + "\n" and f"onto {base}" in status
