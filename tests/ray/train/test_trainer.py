"""End-to-end fine-tunes of the tiny model on a local Ray cluster: 2 CPU workers, ZeRO-2.

- a worker killed mid-run is restarted from the last checkpoint, and the steps the final model
  took cover every training example exactly once;
- a run stopped early resumes (same name) and finishes, with metrics, TensorBoard events and a
  Hugging Face model and its tokenizer in the final checkpoint;
- bad input found in a worker (an InputError) ends the run at once: it is not retried.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray.train

from raypack.config import load
from raypack.train import loop

from paths import REPO

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
            *overrides,
        ],
    )


def trained_ids(checkpoint_dir: Path) -> tuple[list[int], list[int]]:
    """Example ids and optimizer steps the final model took, from every rank's step log."""
    from raypack.train.loop import read_steps_log

    ids, steps = [], []
    for log in sorted(checkpoint_dir.glob("steps_rank*.npz")):
        entries = read_steps_log(log)
        steps.append([step for step, _, _ in entries])
        ids += [i for _, _, example_ids in entries for i in example_ids]
    return ids, steps


def planned_train_ids(cfg) -> list[int]:
    """Every example the data pipeline kept for training, read back independently of the run."""
    from raypack.data.prepare import is_eval
    from raypack.data.tokenize import lengths_and_ids, tokenize_dataset
    from raypack.runtime import absolute_paths

    ds, _ = tokenize_dataset(absolute_paths(cfg))
    _, ids = lengths_and_ids(ds)
    return sorted(ids[~is_eval(ids, cfg.data.eval_fraction, cfg.pack.seed)].tolist())


def loop_killed_once(config: dict) -> None:
    """The production loop, but worker `rank` exits right after logging optimizer step `step`,
    once (a marker file remembers it), so the run must recover from its last checkpoint. Ray
    Train runs this in its own worker processes, so the patched step hook dies with them."""
    fault = config["fault"]
    rank = ray.train.get_context().get_world_rank()
    log_step = loop.Reporter.log_step

    def log_step_then_die(self, step: int, values: dict) -> None:
        log_step(self, step, values)
        if rank == fault["rank"] and step == fault["step"] and not os.path.exists(fault["marker"]):
            Path(fault["marker"]).touch()
            os._exit(1)

    loop.Reporter.log_step = log_step_then_die
    loop.train_loop_per_worker(config)


def test_worker_killed_midrun_resumes_from_checkpoint_exactly_once(ray_local, tmp_path):
    from raypack.train.trainer import fit

    cfg = tiny_cfg(tmp_path, "train.max_failures=1")
    marker = tmp_path / "fault-fired"
    result = fit(cfg, loop=loop_killed_once, extra_loop_config={"fault": {"rank": 1, "step": 3, "marker": str(marker)}})

    assert marker.exists(), "the injected worker failure never fired"
    assert result.error is None
    ids, steps = trained_ids(Path(result.checkpoint.path))
    total = result.metrics["step"]
    # Step 3 was lost with the failure and redone after restoring step 2: each step appears once.
    assert steps == [list(range(1, total + 1))] * cfg.train.num_workers
    assert len(ids) == len(set(ids)), "an example was trained twice"
    assert sorted(ids) == planned_train_ids(cfg), "an example was skipped"


def test_stopped_run_resumes_and_finishes(ray_local, tmp_path):
    from transformers import AutoModelForCausalLM

    from raypack.train.trainer import fit

    cfg = tiny_cfg(tmp_path, "train.max_steps=3", "data.eval_fraction=0.2")
    first = fit(cfg)
    assert first.metrics["step"] == 3
    for key in ("loss", "eval_loss", "tokens_per_s", "packing_efficiency", "padding_fraction",
                "peak_memory_gb", "step_time_s", "data_wait_s", "rank_imbalance"):
        assert first.metrics[key] is not None, key
    assert 0.5 < first.metrics["packing_efficiency"] <= 1.0

    # Same name and storage path: Ray Train restores the run's last checkpoint (what --resume does).
    resumed = fit(tiny_cfg(tmp_path, "data.eval_fraction=0.2", name=cfg.run.name))
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


def loop_with_bad_input(config: dict) -> None:
    """Every attempt of every rank leaves a file, then fails as a deterministic error would."""
    from raypack.model.build import UnsupportedModelError

    rank = ray.train.get_context().get_world_rank()
    Path(config["attempts"], f"rank{rank}-{uuid.uuid4().hex[:6]}").touch()
    raise UnsupportedModelError("model.name 'x' can't train on packed rows")


def test_input_error_in_a_worker_is_not_retried(ray_local, tmp_path):
    from raypack.model.build import UnsupportedModelError
    from raypack.train.trainer import fit

    cfg = tiny_cfg(tmp_path, "train.max_failures=2")
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    with pytest.raises(UnsupportedModelError, match="can't train on packed rows"):
        fit(cfg, loop=loop_with_bad_input, extra_loop_config={"attempts": str(attempts)})
    # one attempt per rank: no restart of the worker group (max_failures=2 would make it 3 each)
    assert sorted(p.name[:5] for p in attempts.iterdir()) == ["rank0", "rank1"]
