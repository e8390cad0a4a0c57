"""Where a run lives, and the files that say what it is: one home for run folders.

    <run.storage_path>/<run.name>/            run_dir(cfg): a local folder or a URI
        raypack_config.yaml                   the config it trains, saved once, paths absolute
        raypack_result.json                   written when training finishes (last step, metrics, start-up phases)
        raypack_wandb_id                      its W&B run's id, with run.wandb on (train/tracking.py)
        packed/, tensorboard/, checkpoint_*   prepare's rows, the event files, Ray Train's state
        export/step_<N>/                      `raypack export`'s Hugging Face folders (its default --out)
    <run.storage_path>/<sweep name>/          a sweep's experiment folder
        raypack_sweep.yaml                    the sweep's config, saved once
        runs/<trial name>/                    one run folder per trial (trial_config)

A saved config holds absolute paths and URIs only (`absolute_paths`), and `saved_config(DIR)`
points the run at DIR wherever DIR now is, so `raypack train --resume DIR` and `raypack sweep
--resume DIR` continue that run or sweep from any working folder.

Local paths in a config are relative to the working folder (the job's working directory under
`ray job submit`), except `raypack/assets/...`, which names the bundled assets of the installed
raypack. Paths that don't exist here (hub names, `tiny-llama`) and URIs are left as they are.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from raypack import storage
from raypack.config import ASSETS, ASSETS_PREFIX, Config, dumps, loads
from raypack.errors import ConfigError
from raypack.config.swept import OPTIONAL, label, set_field

SAVED_CONFIG = "raypack_config.yaml"
SWEEP_CONFIG = "raypack_sweep.yaml"
RESULT = "raypack_result.json"
"""Written when training finishes: the last step and metrics, and where the checkpoint is."""
CHECKPOINTS = "checkpoint_manager_snapshot.json"
"""Ray Train's record of a run's checkpoints: a run with it has trained and resumes from one."""


# --- paths -------------------------------------------------------------------------------------


def local_path(path: str) -> str:
    """A config path as this process finds it: bundled assets in the installed package, other
    existing local paths absolute; URIs and names that are no local path as they are."""
    if storage.is_uri(path):
        return path
    if path.startswith(ASSETS_PREFIX) or path.startswith("./" + ASSETS_PREFIX):
        return str(ASSETS / path.split(ASSETS_PREFIX, 1)[1])
    return str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with every local path absolute (data, tokenizer, a model folder, storage and cache
    paths): what a saved config holds and what Ray workers, whose working folder is not ours, get."""
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, paths=tuple(local_path(p) for p in cfg.data.paths),
            sources=tuple(dataclasses.replace(s, paths=tuple(local_path(p) for p in s.paths)) for s in cfg.data.sources),
            cache_path=storage.absolute(cfg.data.cache_path) if cfg.data.cache_path else None),
        tokenize=dataclasses.replace(cfg.tokenize, tokenizer=local_path(cfg.tokenize.tokenizer)),
        model=dataclasses.replace(cfg.model, name=local_path(cfg.model.name)),
        run=dataclasses.replace(cfg.run, storage_path=storage.absolute(cfg.run.storage_path)),
    )


def storage_path(cfg: Config) -> str:
    """`run.storage_path`, absolute when local (Ray Train requires it), a URI left as it is."""
    return storage.absolute(cfg.run.storage_path)


def run_dir(cfg: Config) -> str:
    """Where one run's (or sweep's) files go: <run.storage_path>/<run.name>."""
    return f"{storage_path(cfg)}/{cfg.run.name}"


def sweep_of(root: str) -> tuple[str, ...]:
    """The sweep folder a trial's run folder `root` (<sweep>/runs/<trial>) lies in, if it does: (folder,), else ()."""
    parent, _, _ = root.rpartition("/")
    sweep, _, runs = parent.rpartition("/")
    return (sweep,) if runs == "runs" and sweep and storage.exists(f"{sweep}/{SWEEP_CONFIG}") else ()


def at(cfg: Config, folder: str) -> Config:
    """`cfg` with its run placed at `folder` (storage_path = its parent, name = its last part)."""
    parent, _, name = storage.absolute(folder).rpartition("/")
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, storage_path=parent, name=name))


# --- saved configs -------------------------------------------------------------------------------


def saved_config(folder: str, overrides: Sequence[str] = (), file: str = SAVED_CONFIG, what: str = "run") -> Config:
    """The config a run (or, with file=SWEEP_CONFIG, a sweep) in `folder` saved, then `overrides`,
    placed at `folder` wherever it now is: what `--resume FOLDER` continues."""
    path = f"{storage.absolute(folder)}/{file}"
    if not storage.exists(path):
        if not storage.exists(storage.absolute(folder)):
            raise ConfigError(f"--resume {folder}: no such folder")
        if what == "sweep":
            raise ConfigError(f"--resume {folder}: not a raypack sweep (no {file} there); start one with --config")
        raise ConfigError(f"--resume {folder}: no {file} there; is it a raypack run folder?")
    text = storage.read_text(path)
    cfg = loads(text, overrides, path, saved=True)
    # Configs saved before data.eval_max_examples existed held out eval_fraction of the examples,
    # uncapped: keep that split, and with it the packed data their checkpoints index.
    saved_data = (yaml.safe_load(text) or {}).get("data") or {}
    if "eval_max_examples" not in saved_data and not any(o.startswith("data.eval_max_examples=") for o in overrides):
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_max_examples=None))
    return at(cfg, folder)


def save_config(cfg: Config, file: str = SAVED_CONFIG) -> None:
    """Save `cfg` (paths made absolute) into its run folder, unless a config is saved there already."""
    path = f"{run_dir(cfg)}/{file}"
    if not storage.exists(path):
        storage.write_text(path, dumps(absolute_paths(cfg)))


def differences(saved: Config, new: Config, sections: Sequence[str] | None = None) -> list[str]:
    """`section.key: old there, new here` for every field that differs (nested keys dotted)."""
    a, b = saved.to_dict(), new.to_dict()
    out: list[str] = []

    def walk(x: Any, y: Any, key: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in x:
                walk(x[k], y.get(k), f"{key}.{k}" if key else k)
        elif (isinstance(x, list) and isinstance(y, list) and len(x) == len(y)
              and all(isinstance(v, dict) for v in x + y)):  # a list of sections: data.sources[1].weight
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{key}[{i}]")
        elif x != y:
            out.append(f"{key}: {x!r} there, {y!r} here")

    for section in sections or a:
        walk(a[section], b[section], section)
    return out


RERUN_FIELDS = ("train.epochs", "train.max_steps", "train.eval_every_steps", "train.checkpoint_every_steps",
                "train.report_every_steps", "train.keep_checkpoints", "train.max_failures", "train.start_timeout_s",
                "train.stop_grace_s", "train.stop_checkpoint_after_s", "train.cpus_per_worker",
                "train.placement_strategy", "train.tensorboard", "train.mlflow", "run.wandb.")
"""The fields a rerun of a run (`--resume`, or the same `--config` again) may change: how long it
trains, how it is evaluated, checkpointed, watched and placed, never what a step trains on or how
(the data, the model, the optimizer): its checkpoints were taken under those. A prefix ending in a
dot stands for every field under it."""


RESIZE_FIELDS = ("train.num_workers", "train.grad_accum")
"""What `--resume` may change besides RERUN_FIELDS: the run goes on at another size, the rest of
its epoch planned again from the step logs (raypack/train/resize.py). Not a `--config` rerun's:
that one trains the config it names, whose packed data the checkpoints must index."""


def check_rerun(overrides: Sequence[str], folder: str) -> None:
    """A ConfigError naming the first of `--resume folder`'s overrides that a resume may not change."""
    for item in overrides:
        key = item.partition("=")[0]
        if not key.startswith(RERUN_FIELDS + RESIZE_FIELDS):
            may = ", ".join(f + "*" if f.endswith(".") else f for f in RERUN_FIELDS + RESIZE_FIELDS)
            raise ConfigError(
                f"--resume {folder}: override {item}: a resumed run trains the config it was started with; a rerun "
                f"may change only {may}. Start a new run for the rest: raypack train --config FILE run.name=NEW_NAME"
            )


def check_same_config(cfg: Config, root: str) -> None:
    """A ConfigError if the run in `root` was started with a config other than `cfg` (a rerun of
    `raypack train --config` with a changed file or overrides); nothing if it has none saved."""
    path = f"{root}/{SAVED_CONFIG}"
    if not storage.exists(path):
        return
    diff = [d for d in differences(saved_config(root), absolute_paths(cfg)) if not d.startswith(RERUN_FIELDS)]
    mixture = [d for d in diff if d.startswith(("data.sources", "data.examples_per_epoch"))]
    if mixture:  # the first thing to say: its checkpoints were taken on another draw of the examples
        raise ConfigError(
            f"run {cfg.run.name!r} in {root} was started with another mixture ({mixture[0]}): a changed weight or "
            "source draws other examples, so it is a different run; start it with run.name=NEW_NAME, or continue "
            f"this one as it was with `raypack train --resume {root}`"
        )
    if diff:
        raise ConfigError(
            f"run {cfg.run.name!r} in {root} was started with another config ({diff[0]}"
            + (f", and {len(diff) - 1} more" if len(diff) > 1 else "")
            + f"); continue it with `raypack train --resume {root}` (overrides allowed), or start a new run with run.name=NEW_NAME"
        )


def has_checkpoint(root: str) -> bool:
    return storage.exists(f"{root}/{CHECKPOINTS}")


def reported_checkpoints(root: str) -> list[dict[str, Any]]:
    """The checkpoints Ray Train registered for the run and still keeps, in the order reported:
    `{"checkpoint_dir_name": ..., "metrics": {...}}` each, the metrics (`step`, `eval_loss`, ...)
    being those reported with it. [] for a run with none."""
    if not has_checkpoint(root):
        return []
    return list(json.loads(storage.read_text(f"{root}/{CHECKPOINTS}"))["checkpoint_results"])


def orphan_checkpoints(root: str) -> list[str]:
    """Checkpoint folders of the run that Ray Train never registered: written when the run was
    stopped (Ctrl-C, a killed driver) after the folder was saved, before the report reached the
    controller. A resume continues from the last registered one; these would only take space."""
    registered = {c["checkpoint_dir_name"] for c in reported_checkpoints(root)}
    return [f"{root}/{name}" for name in storage.list_dirs(root, "checkpoint_") if name not in registered]


# --- results -------------------------------------------------------------------------------------


def read_result(root: str) -> dict[str, Any] | None:
    path = f"{root}/{RESULT}"
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def write_result(root: str, step: int, metrics: dict[str, Any], checkpoint: str | None,
                 startup: dict[str, float] | None = None, trained: dict[str, Any] | None = None,
                 ran: dict[str, Any] | None = None) -> None:
    """`startup`: seconds per start-up phase before the first step (raypack/train/startup.py);
    `trained`: the examples and label tokens the run trained, per epoch too (train/resize.py);
    `ran`: the train.epochs and train.max_steps it finished under."""
    result = {"step": step, "metrics": metrics, "checkpoint": checkpoint, **({"ran": ran} if ran else {})}
    if trained is not None:
        result["trained"] = trained
    if startup:
        result["startup_s"] = startup
    storage.write_text(f"{root}/{RESULT}", json.dumps(result, indent=1))


# --- sweep trials --------------------------------------------------------------------------------


def trial_name(params: dict[str, Any]) -> str:
    return label(params)


def trial_config(base: Config, params: dict[str, Any], runs_dir: str, suffix: str = "",
                 batch_size: float | None = None) -> Config:
    """The base config with the trial's strategy, budget, lr, optional parameters (LoRA rank, DPO beta,
    router loss coefficient: raypack/config/swept.py) and equal-work `batch_size`, its run under
    `runs_dir` with a name no other trial (or earlier sweep) uses: a reused name would resume that run."""
    name = trial_name(params) + (f"-{suffix}" if suffix else "")
    pack = dataclasses.replace(base.pack, strategy=params["strategy"], budget=params["budget"])
    if batch_size is not None:
        pack = dataclasses.replace(pack, batch_size=batch_size)
    cfg = dataclasses.replace(base, pack=pack, train=dataclasses.replace(base.train, lr=params["lr"]))
    for p in OPTIONAL:
        if params.get(p.name) is not None:
            cfg = set_field(cfg, p.sets, params[p.name])
    return dataclasses.replace(
        cfg,
        # W&B shows a sweep's trials together: one run each, grouped by the sweep's name.
        run=dataclasses.replace(base.run, name=name, storage_path=runs_dir,
                                wandb=dataclasses.replace(base.run.wandb, group=base.run.wandb.group or base.run.name)),
    )
