"""End-to-end fine-tunes of the tiny model on a local Ray cluster: 2 CPU workers, ZeRO-2.

- a worker killed mid-run is restarted from the last checkpoint, and the steps the final model
  took cover every training example exactly once (on DeepSpeed and on the torch engine);
- a run stopped early resumes (same name) and finishes, with metrics, TensorBoard events and a
  Hugging Face model and its tokenizer in the final checkpoint;
- bad input found in a worker (an InputError) ends the run at once: it is not retried;
- a mixture of three sources trains, through a resume, exactly what its weights drew; another
  weight on the same run is refused.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray.train
import torch

from raypack.config import load
from raypack.train import loop, trainer

from checkpoints import as_user
from paths import REPO
from trained import planned_train_ids, trained_ids

pytestmark = pytest.mark.ray

CONFIG = REPO / "jobs" / "configs" / "tiny_cpu.yaml"


def tiny_cfg(tmp_path: Path, *overrides: str, name: str | None = None):
    return load(
        CONFIG,
        [
            f"run.storage_path={tmp_path}",
            f"run.name={name or 't-' + uuid.uuid4().hex[:8]}",
            "pack.budget=256",
            "train.grad_accum=1",
            "train.report_every_steps=2",
            "train.checkpoint_every_steps=2",
            *as_user(),  # tiny-llama's saved bf16 folder, as users name a published model
            *overrides,
        ],
    )


def with_worker_loop(monkeypatch, fn, **kwargs) -> None:
    """Run `fn(config, **kwargs)` in the workers instead of the production loop: the trainer
    hands Ray Train its module's `worker_loop`, which Ray pickles by reference (this module is
    importable in the workers, tests/conftest.py puts it on their path)."""
    monkeypatch.setattr(trainer, "worker_loop", functools.partial(fn, **kwargs))


def loop_killed_once(config: dict, fault: dict) -> None:
    """The production loop, but worker `rank` exits right after logging optimizer step `step`,
    once (a marker file remembers it), so the run must recover from its last checkpoint. Ray
    Train runs this in its own worker processes, so the patched step hook dies with them."""
    rank = ray.train.get_context().get_world_rank()
    log_step = loop.Reporter.log_step

    def log_step_then_die(self, step: int, values: dict) -> None:
        log_step(self, step, values)
        if rank == fault["rank"] and step == fault["step"] and not os.path.exists(fault["marker"]):
            Path(fault["marker"]).touch()
            os._exit(1)

    loop.Reporter.log_step = log_step_then_die
    loop.train_loop_per_worker(config)


@pytest.mark.parametrize("engine", [(), ("train.engine=torch", "train.zero_stage=3")], ids=["deepspeed", "torch-fsdp3"])
def test_worker_killed_midrun_resumes_from_checkpoint_exactly_once(ray_local, tmp_path, monkeypatch, engine):
    """On either engine (the torch engine's FSDP2 resharding: torch.distributed.checkpoint's shards)."""
    cfg = tiny_cfg(tmp_path, "train.max_failures=1", *engine)
    marker = tmp_path / "fault-fired"
    with_worker_loop(monkeypatch, loop_killed_once, fault={"rank": 1, "step": 3, "marker": str(marker)})
    result = trainer.start(cfg).result

    assert marker.exists(), "the injected worker failure never fired"
    assert result.error is None
    ids, steps = trained_ids(Path(result.checkpoint.path))
    total = result.metrics["step"]
    # Step 3 was lost with the failure and redone after restoring step 2: each step appears once.
    assert steps == [list(range(1, total + 1))] * cfg.train.num_workers
    assert len(ids) == len(set(ids)), "an example was trained twice"
    assert sorted(ids) == planned_train_ids(cfg), "an example was skipped"


@pytest.mark.slow
def test_stopped_run_resumes_and_finishes(ray_local, tmp_path):
    """Slow (54 s): a run cut by train.max_steps and resumed to its end, as tests/ray/commands/test_train.py's
    runs stopped and resumed through `raypack train` (their every example once, their checkpoints'
    model/ loaded); the result's metrics are checked in the epoch-two restart below."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg(tmp_path, "train.max_steps=3", "data.eval_fraction=0.2")
    first = trainer.start(cfg).result
    assert first.metrics["step"] == 3
    for key in ("loss", "eval_loss", "tokens_per_s", "packing_efficiency", "padding_fraction",
                "peak_memory_gb", "step_time_s", "data_wait_s", "rank_imbalance", "token_imbalance",
                "attention_imbalance", "token_imbalance_worst", "attention_imbalance_worst"):
        assert first.metrics[key] is not None, key
    assert 0.5 < first.metrics["packing_efficiency"] <= 1.0

    # The run's saved config, without max_steps: it continues from its last checkpoint (what
    # `raypack train --resume RUN train.max_steps=null` does).
    from raypack.runs import run_dir, saved_config

    resumed = trainer.start(saved_config(run_dir(cfg), ["train.max_steps=null"]), resume=True).result
    assert resumed.error is None
    assert resumed.metrics["loss"] < first.metrics["loss"], "the loss did not fall"
    ids, steps = trained_ids(Path(resumed.checkpoint.path))
    total = resumed.metrics["step"]
    assert total > 3
    assert steps == [list(range(1, total + 1))] * cfg.train.num_workers
    assert len(ids) == len(set(ids)) and sorted(ids) == planned_train_ids(cfg)
    assert np.isfinite(resumed.metrics["eval_loss"])

    run = Path(resumed.path)
    assert list((run / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    model = AutoModelForCausalLM.from_pretrained(Path(resumed.checkpoint.path) / "model")
    assert model.config.vocab_size > 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(resumed.checkpoint.path) / "model")
    assert len(tokenizer) == model.config.vocab_size and tokenizer.chat_template


def test_bf16_precision_restarts_from_its_checkpoint_exactly(ray_local, tmp_path, monkeypatch):
    """train.precision bf16 (bf16 master weights, moments and Kahan compensation) in the mode users
    run: a worker killed after step 3 restarts from step 2's checkpoint, and the final weights equal
    those of the same run never killed, bit for bit (the optimizer state came back whole)."""
    from safetensors.torch import load_file

    common = ("train.precision=bf16", "train.max_steps=4", "data.eval_fraction=0", "train.max_failures=1")
    whole = trainer.start(tiny_cfg(tmp_path, *common)).result
    marker = tmp_path / "fault-fired"
    with_worker_loop(monkeypatch, loop_killed_once, fault={"rank": 1, "step": 3, "marker": str(marker)})
    restarted = trainer.start(tiny_cfg(tmp_path, *common)).result

    assert marker.exists(), "the injected worker failure never fired"
    assert whole.metrics["step"] == restarted.metrics["step"] == 4
    a = load_file(Path(whole.checkpoint.path) / "model" / "model.safetensors")
    b = load_file(Path(restarted.checkpoint.path) / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(t.dtype == torch.bfloat16 for t in a.values())
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert whole.metrics["loss"] == restarted.metrics["loss"]


def test_a_failed_preparation_stops_the_workers_that_started_beside_it(ray_local, tmp_path, monkeypatch):
    """train.overlap_start: the worker group starts while the driver prepares the data; a
    preparation that fails hands its error over, the workers stop at once (never retried), the
    driver raises the preparation's own error, and no run folder is left."""
    from raypack.errors import SourceError

    def failing_prepare(*args, **kwargs):
        raise SourceError("chat.jsonl line 3: not valid JSON")

    monkeypatch.setattr(trainer, "prepare", failing_prepare)
    cfg = tiny_cfg(tmp_path, "train.max_failures=2", "train.overlap_start=true")
    with pytest.raises(SourceError, match="chat.jsonl line 3"):
        trainer.start(cfg)
    assert not (tmp_path / cfg.run.name).exists()


def loop_killed_in_epoch_two(config: dict, fault: dict) -> None:
    """The production loop, but worker `rank` dies once when asked for the rows of its eleventh
    optimizer step of the second epoch (after checkpoints inside that epoch: the prefetcher reads
    up to three steps ahead of the one training, and Ray registers a reported checkpoint
    asynchronously, so the margin is several checkpoints), and the restarted
    run records whether it resumed from the middle of that epoch."""
    rank = ray.train.get_context().get_world_rank()
    read = loop.iter_epoch_packs

    def read_then_die(data, r, epoch, start_step=0):
        if epoch == 1 and start_step > 0:
            Path(fault["resumed"]).write_text(str(start_step))
        for i, row in enumerate(read(data, r, epoch, start_step), start=start_step):
            if epoch == 1 and rank == fault["rank"] and i == 10 * data.grad_accum and not os.path.exists(fault["marker"]):
                Path(fault["marker"]).touch()
                os._exit(1)
            yield row

    loop.iter_epoch_packs = read_then_die
    loop.train_loop_per_worker(config)


def test_killed_in_epoch_two_resumes_mid_epoch_each_example_once_per_epoch_new_order(ray_local, tmp_path, monkeypatch):
    from raypack.train.checkpoint import read_steps_log

    cfg = tiny_cfg(tmp_path, "train.max_failures=1", "train.epochs=2", "pack.budget=512", "data.eval_fraction=0.2")
    fault = {"rank": 0, "marker": str(tmp_path / "fault-fired"), "resumed": str(tmp_path / "resumed-at")}
    with_worker_loop(monkeypatch, loop_killed_in_epoch_two, fault=fault)
    result = trainer.start(cfg).result

    assert Path(fault["marker"]).exists(), "the injected worker failure never fired"
    assert result.error is None
    for key in ("loss", "eval_loss", "tokens_per_s", "packing_efficiency", "padding_fraction",
                "peak_memory_gb", "step_time_s", "data_wait_s", "rank_imbalance", "token_imbalance",
                "attention_imbalance", "token_imbalance_worst", "attention_imbalance_worst"):
        assert result.metrics[key] is not None, key
    assert 0.5 < result.metrics["packing_efficiency"] <= 1.0 and np.isfinite(result.metrics["eval_loss"])
    assert list((Path(result.path) / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert int(Path(fault["resumed"]).read_text()) > 0, "the restart did not resume inside epoch 2"
    planned = planned_train_ids(cfg)
    orders = {}
    for log in sorted(Path(result.checkpoint.path).glob("steps_rank*.npz")):
        entries = read_steps_log(log)
        assert [s for s, _, _ in entries] == list(range(1, result.metrics["step"] + 1))  # each step once
        for epoch in (0, 1):
            orders.setdefault(epoch, []).append([tuple(ids) for _, e, ids in entries if e == epoch])
    for epoch in (0, 1):
        ids = [i for rank_steps in orders[epoch] for step in rank_steps for i in step]
        assert sorted(ids) == planned, f"epoch {epoch + 1} did not train every example exactly once"
    for first, second in zip(orders[0], orders[1]):
        assert sorted(first) == sorted(second)  # the same packs of this rank ...
        assert first != second  # ... in a different step order


def loop_with_bad_input(config: dict, attempts: str) -> None:
    """Every attempt of every rank leaves a file, then fails as a deterministic error would."""
    from raypack.model.build import UnsupportedModelError

    rank = ray.train.get_context().get_world_rank()
    Path(attempts, f"rank{rank}-{uuid.uuid4().hex[:6]}").touch()
    raise UnsupportedModelError("model.name 'x' can't train on packed rows")


def test_input_error_in_a_worker_is_not_retried(ray_local, tmp_path, monkeypatch):
    from ray._private.state import actors

    from raypack.model.build import UnsupportedModelError

    cfg = tiny_cfg(tmp_path, "train.max_failures=2")
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    with_worker_loop(monkeypatch, loop_with_bad_input, attempts=str(attempts))
    began = time.time() * 1000
    with pytest.raises(UnsupportedModelError, match="can't train on packed rows"):
        trainer.start(cfg)
    # one attempt per rank: no restart of the worker group (max_failures=2 would make it 3 each)
    assert sorted(p.name[:5] for p in attempts.iterdir()) == ["rank0", "rank1"]
    # On the local instance, the run started the controller and its workers, none of the helper
    # actors RunTrainer leaves out (the GCS's actor table: the tests' instance has no dashboard)
    started = {a["ActorClassName"] for a in actors().values() if a["StartTime"] >= began}
    assert {"TrainController", "RayTrainWorker"} <= started, started
    assert not started & {"PlacementGroupCleaner", "DatasetManager", "PreemptionWatcher",
                          "_AutoscalingCoordinatorActor"}, started


@pytest.mark.parametrize("local", [True, False])
def test_run_trainer_leaves_out_only_what_a_run_has_no_use_for(ray_local, tmp_path, local):
    """Ray Train's own trainer has both callbacks (so the check below can fail); RunTrainer drops
    the DatasetManager's everywhere and the placement-group cleaner's on a local instance only."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    kwargs = dict(scaling_config=ray.train.ScalingConfig(num_workers=1),
                  run_config=ray.train.RunConfig(storage_path=str(tmp_path)))
    ray_default = {type(c) for c in TorchTrainer(lambda: None, **kwargs)._create_default_callbacks()}
    ours = {type(c) for c in trainer.RunTrainer(lambda: None, local=local, **kwargs)._create_default_callbacks()}
    assert {DatasetsCallback, PlacementGroupCleanerCallback} <= ray_default
    assert ours == ray_default - {DatasetsCallback, *([PlacementGroupCleanerCallback] if local else [])}


@pytest.mark.parametrize("local", [True, False])
def test_run_trainer_asks_no_autoscaler_on_a_local_instance(tmp_path, monkeypatch, local):
    """The scaling policy the controller gets: Ray Train's own on a cluster (it tells the
    autoscaler what the workers need), one that sends no request on a local instance."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    from raypack import raycompat

    given = {}
    monkeypatch.setattr(TorchTrainer, "_initialize_and_run_controller", lambda self, **kw: given.update(kw))
    run = trainer.RunTrainer(lambda: None, local=local, scaling_config=ray.train.ScalingConfig(num_workers=2),
                             run_config=ray.train.RunConfig(storage_path=str(tmp_path)))
    run._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(run.scaling_config))
    policy = given["scaling_policy"]
    assert isinstance(policy, FixedScalingPolicy)
    assert isinstance(policy, raycompat.LocalScalingPolicy) == local
    if local:  # no coordinator is reached (no request sent or cancelled), and the decision is Ray Train's fixed size
        reached = []  # Ray 2.55 names no `_coordinator_client`: what both reach for is this property
        monkeypatch.setattr(FixedScalingPolicy, "_autoscaling_coordinator", property(lambda self: reached.append(self)),
                            raising=False)  # fmt: skip
        policy.after_controller_start(None)
        policy.before_controller_abort()
        assert reached == [] and getattr(policy, "_coordinator_client", None) is None
        assert policy.make_decision_for_non_running_worker_group().num_workers == 2


LOAD_AND_COMPARE = """
import sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
ckpt = sys.argv[1]
ids = torch.tensor([[5, 9, 33, 7, 100, 4, 61]])
expected = torch.load(sys.argv[2])
merged = AutoModelForCausalLM.from_pretrained(ckpt + "/model").eval()
adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt + "/base"), ckpt + "/adapter").eval()
with torch.no_grad():
    for name, model in (("merged", merged), ("adapter", adapted)):
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5, msg=name)
print("ok")
"""


def test_lora_zero3_checkpointing_recovers_resumes_and_loads_in_a_fresh_process(ray_local, tmp_path, monkeypatch):
    """LoRA under ZeRO-3 with gradient checkpointing: a worker killed mid-run restarts from the
    last checkpoint, a stopped run resumes, every example trains once, the checkpoints hold no
    copy of the base weights, and a fresh process loads adapter/ (onto base/) and the merged
    model/, both giving the trained model's logits."""
    import subprocess
    import sys

    import torch

    from raypack.runs import run_dir, saved_config

    # a base built from a config, whose checkpoints carry it as base/ (what this test loads adapter/
    # onto), in fp32 for fp32's tolerances; a saved folder's LoRA run: tests/ray/commands/test_export.py
    lora = ["model.peft.method=lora", "model.peft.r=4", "train.zero_stage=3", "model.gradient_checkpointing=true",
            "train.lr=1e-2", "train.max_failures=1", "model.name=tiny-llama", "model.dtype=float32"]
    cfg = tiny_cfg(tmp_path, *lora, "train.max_steps=4")
    marker = tmp_path / "fault-fired"
    with_worker_loop(monkeypatch, loop_killed_once, fault={"rank": 0, "step": 3, "marker": str(marker)})
    first = trainer.start(cfg).result
    assert marker.exists() and first.error is None and first.metrics["step"] == 4
    mid = Path(first.checkpoint.path)
    # The DeepSpeed state holds the adapters and their optimizer state, not the base weights.
    saved = sum(f.stat().st_size for f in mid.rglob("*.pt"))
    assert saved < 0.5 * sum(f.stat().st_size for f in (mid / "base").glob("*.safetensors"))

    monkeypatch.undo()
    resumed = trainer.start(saved_config(run_dir(cfg), ["train.max_steps=null"]), resume=True).result
    assert resumed.error is None and resumed.metrics["loss"] < first.metrics["loss"]
    ckpt = Path(resumed.checkpoint.path)
    ids, steps = trained_ids(ckpt)
    assert steps == [list(range(1, resumed.metrics["step"] + 1))] * cfg.train.num_workers
    assert len(ids) == len(set(ids)) and sorted(ids) == planned_train_ids(cfg)

    # The trained model's logits, from the run's own DeepSpeed state (not from the folders under test).
    from raypack.config import PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model

    model = apply_adapters(load_model(str(ckpt / "base"), attention="sdpa", dtype="float32"), PeftConfig(method="lora", r=4))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="ds", exclude_frozen_parameters=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    with torch.no_grad():
        torch.save(model.eval()(input_ids=torch.tensor([[5, 9, 33, 7, 100, 4, 61]])).logits, tmp_path / "expected.pt")
    out = subprocess.run([sys.executable, "-c", LOAD_AND_COMPARE, str(ckpt), str(tmp_path / "expected.pt")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("overrides,asked", [
    (["train.num_workers=64"], r"train.num_workers x train.cpus_per_worker: 64 workers need 64 CPUs, but this local "
                               r"Ray instance has 8 and can't grow"),
    (["train.use_gpu=true"], r"train.use_gpu \(one GPU per worker\): 2 workers need 2 GPUs, but this local Ray "
                             r"instance has 0"),
])  # fmt: skip
def test_a_request_the_local_instance_can_never_meet_fails_in_seconds(ray_local, tmp_path, overrides, asked):
    """Ray Train would wait for these workers for ever; the local instance can't grow, so the run
    stops before preparing any data, and leaves no run folder."""
    import time

    from raypack.errors import ConfigError
    from raypack.runs import run_dir

    cfg = tiny_cfg(tmp_path, *overrides)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=asked):
        trainer.start(cfg)
    assert time.perf_counter() - t0 < 60, "preflight and the check took more than a minute"
    assert not Path(run_dir(cfg)).exists()


def test_a_mixture_trains_each_draw_once_resumes_and_a_changed_weight_is_another_run(ray_local, tmp_path, capsys):
    """Three sources in three formats, weighted 0.5 / 0.3 / 0.2: a run stopped at step 3 on 2
    workers and resumed on 1 (the epoch's rest planned again, issue 62) trains exactly the draw,
    every drawn example as often as it was drawn (the chats, fewer than their share, two or three
    times each: the rest is a difference of counts, not of sets), none of the eval examples, each
    step once; the same run with another weight is refused before Ray starts, as another mixture."""
    from collections import Counter

    from raypack.config import ASSETS
    from raypack.data.shards import iter_rank_packs
    from raypack.data.sources import locate
    from raypack.errors import ConfigError
    from raypack import runs
    from raypack.runs import run_dir, saved_config

    paths = []
    for name, rows in (("chat", 8), ("instruction", 14), ("completion", 14)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join((ASSETS / "sample" / f"{name}.jsonl").read_text().splitlines(keepends=True)[:rows]))
        paths.append(str(path))
    weights = (0.5, 0.3, 0.2)

    def mixture(*w):
        return "data.sources=[" + ", ".join(f"{{paths: [{p}], weight: {x}}}" for p, x in zip(paths, w)) + "]"

    name = f"mix-{uuid.uuid4().hex[:6]}"
    cfg = tiny_cfg(tmp_path, "data.paths=[]", mixture(*weights), "data.eval_fraction=0.2", "pack.budget=512",
                   "train.max_steps=3", name=name)
    first = trainer.start(cfg).result
    assert first.metrics["step"] == 3
    resumed = trainer.start(saved_config(run_dir(cfg), ["train.max_steps=null", "train.num_workers=1"]),
                            resume=True).result
    assert resumed.error is None and np.isfinite(resumed.metrics["eval_loss"])
    # each source's own eval loss beside the whole's, which is their label-token-weighted mean
    # (the draw holds out 4 chats, no instruction and 3 completions at this seed)
    assert "eval_instruction_loss" not in resumed.metrics
    per = [resumed.metrics[f"eval_{n}_loss"] for n in ("chat", "completion")]
    assert all(np.isfinite(per)) and min(per) <= resumed.metrics["eval_loss"] <= max(per), per

    out = capsys.readouterr().out  # each start says what each source gives, the resume from the packed data's record
    # ... and the result file holds each source's eval loss beside the whole's (the workers' eval
    # lines, which show them too, are not this process's output: tests/unit/commands/test_train.py)
    assert [runs.read_result(run_dir(cfg))["metrics"][f"eval_{n}_loss"] for n in ("chat", "completion")] == per
    assert out.count("[raypack] mixture of 3 sources: ") == 2 and out.count("[raypack]   chat         weight 0.5, ") == 2
    assert "[raypack] epoch 1: " in out and " examples trained by step 3; the other " in out, out[-3000:]
    ids, steps = trained_ids(Path(resumed.checkpoint.path))
    # one rank's log now, holding both old ranks' steps 1-3 and its own after: each step once a rank
    assert steps == [[1, 2, 3] * 2 + list(range(4, resumed.metrics["step"] + 1))], steps
    packed = Path(run_dir(cfg)) / "packed"  # the whole epoch's draw, planned for the 1 rank the run ended on
    drawn = Counter(i for row in iter_rank_packs(str(packed / "train"), 0) for i in row["example_ids"])
    held = {i for row in iter_rank_packs(str(packed / "eval"), 0) for i in row["example_ids"]}
    trained = Counter(ids)
    assert trained == drawn and not held & set(trained)
    per_source = [Counter({i: n for i, n in trained.items() if locate(i)[0] == k}) for k in range(3)]
    total = sum(trained.values())
    for k, (w, counts) in enumerate(zip(weights, per_source)):
        assert abs(sum(counts.values()) - w * total) < 1, (k, sum(counts.values()), total)
        assert max(counts.values()) - min(counts.values()) <= 1  # repeats spread evenly
    assert max(per_source[0].values()) >= 2 and max(per_source[2].values()) == 1  # chats repeated, completions not

    with pytest.raises(ConfigError, match=r"was started with another mixture \(data.sources\[1\].weight: 0.3 there, "
                                          r"0.4 here\): a changed weight or source draws other examples, so it is a "
                                          r"different run"):
        trainer.start(tiny_cfg(tmp_path, "data.paths=[]", mixture(0.5, 0.4, 0.2), "data.eval_fraction=0.2",
                               "pack.budget=512", "train.max_steps=3", name=name))
