"""Starting a run: the one way `raypack train` and every sweep trial train a config.

    outcome = start(cfg)                     # check, prepare, fit; or say the run is complete
    outcome = start(cfg, resume=True)        # cfg from the run's saved config (runs.saved_config)

    cfg ──> preflight (no Ray) ──> can this run continue? ──> init_ray ──> room for the workers?
        ──> prepare (tokenize, plan, pack; once, reused on resume) ──> TorchTrainer.fit
                                                 workers: raypack.train.loop.train_loop_per_worker

With train.overlap_start the fit starts right after the room check, and a thread prepares the data
meanwhile, handing it to the workers when it is ready (raypack/train/handoff.py). Either way the
start-up's phases reach the run's result (raypack/train/startup.py).

Runs land in `<run.storage_path>/<run.name>/` (raypack/runs.py): the saved config, Ray's result
files and checkpoints, `packed/` (the plan's per-rank packs, or under `data.cache_path` when set)
and `tensorboard/`. Starting the same name and storage path again continues from that run's last
checkpoint (what `raypack train --resume RUN` and a restarted sweep trial do), provided nothing
that shaped its packed data changed: that is decided before anything is prepared, so a refused
resume leaves the run's `packed/` as it was. A run that already took every step says so.

Failures: Ray Train restarts the worker group from the last checkpoint up to
`train.max_failures` times, which is right for a crash (a killed worker, a lost node). An
`InputError` raised in a worker (a model that can't run packed rows, a checkpoint taken on other
data, a tracker that can't start) would fail the same way every time, and so would an ImportError
(a package missing on a node): either ends the run at once, `fit` raises it as it is, and Ray
Train's tracebacks of it are left out, so the command's one line is the first word of it.
SIGTERM and Ctrl-C during `fit` stop the workers after their step (raypack/train/stop.py). An
elastic run (`train.num_workers: [min, max]`) that Ray Train restarted on another worker count
fits again on it, from its last checkpoint (raypack/train/elastic.py).
Workers the cluster can never hold stop a start in seconds, and room for the others is waited for
at most `train.start_timeout_s` (raypack/train/placement.py); after that, Ray Train's own waits are
unbounded. On a local instance the run listens on 127.0.0.1 only (placement.py too).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from raypack import raycompat, runs, storage
from raypack.config import Config
from raypack.data.cache import packed_key, packed_root, read_manifest
from raypack.data.prepare import prepare
from raypack.data.shards import Prepared
from raypack.errors import ConfigError, InputError
from raypack.runtime import init_ray, is_local_instance
from raypack.train import elastic, resize
from raypack.train.handoff import Handoff
from raypack.train.metrics import source_eval_losses
from raypack.train.placement import check_request, process_group, worker_resources
from raypack.train.preflight import Checked, preflight
from raypack.train.remote import StopOnInputError, worker_loop
from raypack.train.startup import Startup
from raypack.train.stop import DriverStop
from raypack.train.tracking import TrackingTargets, save_wandb_id, targets

SUMMARY = ("step", "loss", "eval_loss", "rewards/accuracies", "eval_rewards/accuracies", "rewards/margins",
           "router_aux_loss", "expert_load_max", "expert_load_worst_layer",
           "tokens_per_s", "packing_efficiency", "peak_memory_gb")
"""The metrics a finished run records in its result file and prints (a run that lacks one, as SFT
lacks DPO's rewards, records it as null and prints none); a mixture's `eval_<name>_loss` follow
eval_loss (`summarized`)."""


def summarized(metrics: dict) -> dict:
    """The SUMMARY metrics of `metrics`, a mixture's per-source eval losses right after eval_loss."""
    summary = {}
    for k in SUMMARY:
        summary[k] = metrics.get(k)
        if k == "eval_loss":
            summary.update(source_eval_losses(metrics))
    return summary


@dataclass
class Outcome:
    """How `start` ended: trained now, or found complete from an earlier start."""

    root: str
    """The run folder."""
    complete_before: bool
    """True when the run had already taken every step (nothing was trained now)."""
    metrics: dict[str, Any]
    """The SUMMARY metrics of the last step."""
    checkpoint: str | None
    tracking: TrackingTargets
    result: Any = None
    """Ray Train's `Result` of the fit, when one ran."""
    startup: dict[str, float] | None = None
    """Seconds per start-up phase before the first step (raypack/train/startup.py), when one ran."""
    stopped: dict[str, Any] | None = None
    """A run a signal stopped before its last step: {"signal", "step", "checkpoint"} (stop.py)."""
    resized_to: int | None = None
    """An elastic run's fit that Ray Train restarted on this many workers (raypack/train/elastic.py)."""


def start(cfg: Config, *, resume: bool = False, reprepare: bool = False, callbacks: Sequence = (),
          trial: bool = False) -> Outcome:
    """Train the run `cfg` names, or continue it from its last checkpoint; see the module doc.
    `resume`: `cfg` is the run's own saved config (with overrides), so it is not compared with
    what the run was started with. `reprepare` packs changed sources again (a run with no
    checkpoint yet). `callbacks`: Ray Train callbacks (a sweep trial forwards reports with one).
    `trial`: a sweep trial, which waits for room for its workers behind the other trials for as
    long as it takes, not `train.start_timeout_s`. An elastic run that Ray Train restarted on
    another worker count starts again on it, from its last checkpoint (raypack/train/elastic.py)."""
    elastic.check_elastic(cfg)
    started = cfg
    while True:
        outcome = _start(cfg, resume=resume, reprepare=reprepare, callbacks=callbacks, trial=trial)
        if outcome.resized_to is None:
            return outcome
        if outcome.resized_to == cfg.train.num_workers:
            elastic.unresized(cfg)
        cfg = elastic.going_on(cfg, outcome.resized_to, outcome.root, started)
        resume, reprepare = True, False  # its own config, changed in size only; its packed data made


def _start(cfg: Config, *, resume: bool, reprepare: bool, callbacks: Sequence, trial: bool) -> Outcome:
    """One fit of `start`."""
    clock = Startup.begin()
    root = runs.run_dir(cfg)
    trained = runs.has_checkpoint(root)
    if not resume:
        runs.check_same_config(cfg, root)
    if reprepare and trained:
        raise ConfigError(
            f"--reprepare: run {cfg.run.name!r} in {root} has checkpoints taken on its packed data, which a resume "
            "on new packs would mix up; start a new run with run.name=NEW_NAME"
        )
    if trained:  # another worker count than the checkpoint's, where its state can't be resharded
        resize.check_resizable(cfg, resize.last_position(root))
    checked = preflight(cfg, reprepare=reprepare)
    clock.mark("preflight")
    cfg = checked.cfg
    if done := _finished(root, checked):
        # What ended it is what to raise: a step cap, or the epochs
        more = "train.max_steps=null" if cfg.train.max_steps == done["step"] else "train.epochs=N"
        print(f"[raypack] run {cfg.run.name!r} is complete ({done['step']} steps); nothing to train. "
              f"Start a new run with run.name=NEW_NAME, or train on with --resume {root} {more}", flush=True)
        shown = {**done["metrics"], **({"trained": done["trained"]} if done.get("trained") else {})}
        return Outcome(root, True, shown, done.get("checkpoint"), targets(cfg, root, check=False))
    if trained:
        _check_same_data(cfg, root, checked)
        print(f"[raypack] run {cfg.run.name!r} exists in {root}: continuing from its last checkpoint", flush=True)
        for orphan in runs.orphan_checkpoints(root):
            storage.remove_dir(orphan)
            print(f"[raypack] removed {orphan}: saved as the run stopped, never registered", flush=True)

    tracking = targets(cfg, root)  # a tracker that can't work here stops before Ray starts
    fresh = not storage.exists(root)
    init_ray()
    clock.mark("ray")
    overlap = cfg.train.overlap_start
    stop = DriverStop(cfg.train.stop_grace_s)
    try:
        check_request(elastic.at_least(cfg, is_local_instance()), wait=not trial)
        if overlap:  # the workers start now and wait for the data (raypack/train/handoff.py)
            clock.mark("prepare")
            data = Handoff.remote()
        else:
            with elastic.planning(cfg):
                data = prepare_data(checked, reprepare, clock).to_dict()
        clock.mark("fit")
        trainer = build_trainer(checked, tracking, data, callbacks=callbacks, startup=clock, stop_key=stop.key)
    except BaseException:
        if fresh:  # a start that failed leaves nothing that looks like a run
            storage.remove_dir(root)
        raise
    preparing = Preparing(checked, reprepare, data, tracking) if overlap else None
    if preparing is None:
        ready(cfg, tracking)
    try:
        result = fit_trainer(trainer, stop)
    except KeyboardInterrupt:
        raise  # now, not after the preparation (the thread ends with Ray)
    except BaseException:
        if preparing is not None and preparing.wait() is not None:
            if fresh:
                storage.remove_dir(root)
            raise preparing.error from None  # what the workers' PreparationFailed stands for
        raise
    if preparing is not None and preparing.wait() is not None:
        raise preparing.error
    metrics = dict(result.metrics or {})
    checkpoint = result.checkpoint.path if result.checkpoint else None
    summary = summarized(metrics)
    startup = metrics.get("startup_s")
    if stopped := stop.stopped_at():
        # Not finished: no result file, which says a run is complete (chat, export, a rerun read it).
        stopped["signal"] = signal.Signals(stop.signum).name
        return Outcome(root, False, summary, checkpoint, tracking, result, startup, stopped)
    if (count := elastic.resized_to(result)) is not None:  # not finished either: `start` goes on
        return Outcome(root, False, summary, checkpoint, tracking, result, startup, resized_to=count)
    trained = resize.trained_totals(checkpoint) if checkpoint and storage.exists(checkpoint) else None
    runs.write_result(root, metrics.get("step", 0), summary, checkpoint, startup=startup, trained=trained,
                      ran={"epochs": cfg.train.epochs, "max_steps": cfg.train.max_steps})
    if trained is not None:  # from the step logs, a resize's or a restart's included
        summary["trained"] = trained
    return Outcome(root, False, summary, checkpoint, tracking, result, startup)


def _finished(root: str, checked: Checked) -> dict | None:
    """The run's saved result if it already took every step this config asks for."""
    result = runs.read_result(root)
    t = checked.cfg.train
    if result is not None and checked.prepared is None and "ran" in result:
        # Its packed data is for another worker count (it finished after a resize): no plan to
        # count steps in, but the epochs and step cap it finished under say whether more is asked.
        ran = result["ran"]
        capped = t.max_steps is not None and result.get("step", 0) >= t.max_steps
        return result if capped or (t.epochs <= ran["epochs"] and t.max_steps == ran["max_steps"]) else None
    if checked.prepared is None or result is None:
        return None
    total = checked.prepared.total_steps(t.grad_accum, t.epochs, t.max_steps)
    return result if result.get("step", 0) >= total else None


def _check_same_data(cfg: Config, root: str, checked: Checked) -> None:
    """A run with checkpoints continues only on the packed data they index: refuse, before
    anything is prepared, a config whose packed data differs from the one the run saved."""
    n = cfg.train.data_parallel
    if checked.prepared is not None:
        return  # this config's packed data is there, made from these sources
    saved = runs.saved_config(root)
    resizing = [d for d in runs.differences(saved, cfg) if d.startswith(runs.RESIZE_FIELDS)]
    pos = resize.last_position(root)
    shape = (cfg.train.num_workers, cfg.train.grad_accum)
    if pos is not None and pos.world_size and (resizing or (pos.world_size, pos.grad_accum) != shape):
        resize.check_resizable(cfg, pos)
        return  # the epoch's rest is planned again from the step logs, whatever packs they index
    # The run's packed/ is there, but keyed otherwise: packing again would overwrite the rows
    # its checkpoints index, so only a missing folder is made again.
    made = read_manifest(storage.absolute(packed_root(cfg, n, root)))
    if made is None and packed_key(saved, saved.train.data_parallel) == packed_key(cfg, n):
        return  # same config, its packed folder gone: packing again makes the same rows
    shaping = ("data.", "tokenize.", "pack.", "train.num_workers", "train.sequence_parallel", "train.grad_accum",
               "train.epochs", "train.max_steps")
    diff = [d for d in runs.differences(saved, cfg) if d.startswith(shaping)]
    if not diff:
        raise InputError(
            f"run {cfg.run.name!r} in {root} has checkpoints taken on packed data that another raypack version made "
            "(this one keys the same config differently); continue it with that version, or start a new run with "
            "run.name=NEW_NAME"
        )
    raise InputError(
        f"run {cfg.run.name!r} in {root} has checkpoints taken on packed data that this config would change "
        f"({', '.join(diff[:3])}); resume it without those overrides, or start a new run with run.name=NEW_NAME"
    )


def prepare_data(checked: Checked, reprepare: bool, clock: Startup | None = None) -> Prepared:
    """The run's packed data, prepared (or reused) under the run dir; `reprepare` packs it again
    from changed sources."""
    clock = clock or Startup()
    clock.mark("prepare")
    cfg = checked.cfg
    n = cfg.train.data_parallel  # packed rows per data-parallel rank: a sequence-parallel group shares them
    prepared = prepare(cfg, n, packed_root(cfg, n, runs.run_dir(cfg)), checked.sources, vocab_size=checked.vocab_size,
                       reprepare=reprepare, vision_model=checked.vision_model, tower=checked.tower)
    # a checkpoint whose position indexes other packs (taken on another worker count): its epoch's rest
    prepared = resize.resized(cfg, prepared, runs.run_dir(cfg), checked.sources, vocab_size=checked.vocab_size,
                              tower=checked.tower)
    clock.mark("data")
    return prepared


def ready(cfg: Config, tracking: TrackingTargets) -> None:
    """The data is prepared: the run's config is saved (never before: a start that fails leaves
    no run behind), and its W&B id."""
    runs.save_config(cfg)
    save_wandb_id(runs.run_dir(cfg), tracking)


class Preparing:
    """train.overlap_start: the data prepared in a thread while the workers start; the result, or
    the error, handed over to them (raypack/train/handoff.py)."""

    def __init__(self, checked: Checked, reprepare: bool, handoff, tracking: TrackingTargets) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(checked, reprepare, handoff, tracking),
                                        name="raypack-prepare", daemon=True)
        self._thread.start()

    def _run(self, checked: Checked, reprepare: bool, handoff, tracking: TrackingTargets) -> None:
        clock = Startup()
        try:
            prepared = prepare_data(checked, reprepare, clock)
            ready(checked.cfg, tracking)
            value = {"prepared": prepared.to_dict(), "marks": {"data": clock.marks["data"]}}
        except BaseException as e:  # handed to the workers, which stop; the driver raises it
            self.error = e
            value = {"error": f"data preparation failed on the driver: {e}"}
        try:
            ray.get(handoff.put.remote(value))
        except Exception as e:  # Ray shut down under it (Ctrl-C): the workers are gone with it
            self.error = self.error or e

    def wait(self) -> BaseException | None:
        """Wait for the preparation to end; its error, if it failed."""
        self._thread.join()
        return self.error


def scaling_config(cfg: Config, local: bool) -> ray.train.ScalingConfig:
    """Ray Train's ScalingConfig for `cfg`: its workers (an elastic run's (min, max) on a cluster,
    elastic.scaling_workers), their resources and placement, and how often an elastic run looks for
    capacity come back (train.elastic_resize_interval_s)."""
    t = cfg.train
    return ray.train.ScalingConfig(
        num_workers=elastic.scaling_workers(cfg, local),
        use_gpu=t.use_gpu,
        resources_per_worker=worker_resources(t),
        placement_strategy=t.placement_strategy,
        elastic_resize_monitor_interval_s=t.elastic_resize_interval_s,
    )


def build_trainer(checked: Checked, tracking: TrackingTargets, data: dict | Any, *, callbacks: Sequence = (),
                  startup: Startup | None = None, stop_key: str | None = None) -> TorchTrainer:
    """The `TorchTrainer` for `checked.cfg` (preflight's record), training on `data` (the
    Prepared record as a dict, or a Handoff the workers wait on), tracking to `tracking`;
    `stop_key`: where the driver asks the workers to stop (stop.DriverStop)."""
    cfg = checked.cfg
    t = cfg.train
    loop_config = {
        "cfg": cfg.to_dict(),
        "data": data,
        "tracking": asdict(tracking),
        "startup": dict((startup or Startup()).marks),  # the workers add theirs (raypack/train/startup.py)
        "stop_key": stop_key,
    }
    # W&B's settings reach rank 0 this way, but never WANDB_API_KEY: Ray shows a runtime_env's
    # variables in its dashboard. Workers find the key where the driver did: in the environment
    # the local instance was started with, or on a cluster's nodes (a Kubernetes Secret).
    env = {k: v for k, v in os.environ.items()
           if k in ("TORCH_EXTENSIONS_DIR", "HF_HOME", "MLFLOW_TRACKING_URI")
           or (k.startswith("WANDB_") and k != "WANDB_API_KEY")}
    quiet = {
        # Ray Train patches print() in workers to log through its own logger, whose console
        # handler writes to stderr while the print still reaches stdout: every line twice.
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # The final checkpoint's save_pretrained draws a progress bar for one shard.
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        # DeepSpeed's collectives call a torch API that warns of its deprecation, in every worker.
        "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger",
        # DeepSpeed otherwise warns, in every worker, that it found no GPU.
        **({} if t.use_gpu else {"DS_ACCELERATOR": "cpu"}),
    }
    env.update({k: os.environ.get(k, v) for k, v in quiet.items()})  # the user's own settings win
    local = is_local_instance()
    torch_config, listen_env = process_group(t, local)
    env.update(listen_env)
    return RunTrainer(
        worker_loop,
        local=local,
        train_loop_config=loop_config,
        torch_config=torch_config,
        scaling_config=scaling_config(cfg, local),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=runs.storage_path(cfg),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=t.keep_checkpoints),
            callbacks=[StopOnInputError(), *callbacks],
            worker_runtime_env={"env_vars": env},
            # Ray Train's INFO lines (worker group start, one "Reporting training result" dump per
            # report) bury raypack's own; its warnings stay.
            **raycompat.train_logging("WARNING"),
        ),
    )


class RunTrainer(TorchTrainer):
    """Ray Train's TorchTrainer, less the helper actors a raypack run has no use for. Each is a
    Python process of its own that imports Ray Train (1-2 s of CPU each, measured: see
    docs/guides/speed.md, start-up), spawned while the worker group starts:

    - the DatasetManager, which serves Ray Data shards to the workers: raypack hands them no Ray
      Dataset (they read their packed rows themselves, raypack/data/shards.py), so it serves none;
    - on a local instance (`local`), the PlacementGroupCleaner, a detached actor that removes the
      workers' placement group should the controller die while the cluster lives on: a local
      instance ends with this process, its placement groups with it (and the cleaner asks the
      State API, which only a dashboard serves); and the PreemptionWatcher, which watches for nodes
      a cloud is about to take away: a local instance has one node, this machine;
    - on a local instance, the AutoscalingCoordinator, which Ray Train's fixed-size scaling policy
      starts and waits for (its first request blocks the controller) to tell an autoscaler what
      the workers need: a local instance has none (`LocalScalingPolicy`).

    On a cluster the cleaner, the watcher and the coordinator run as Ray Train starts them. Another
    Ray version without these classes (private to Ray Train) gets Ray Train's defaults."""

    def __init__(self, *args, local: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._local = local

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        unused = raycompat.unused_callbacks(self._local)
        return [c for c in callbacks if not isinstance(c, unused)]

    def _initialize_and_run_controller(self, **kwargs):
        policy = raycompat.local_scaling_policy(self.scaling_config) if self._local else None
        if policy is not None:
            kwargs["scaling_policy"] = policy
        return super()._initialize_and_run_controller(**kwargs)

    def fit(self):
        if not self._local or os.environ.get(_PREEMPTION_WATCHER) is not None:
            return super().fit()
        # Ray Train hands the variable on to its controller when it is set here as `fit` starts
        os.environ[_PREEMPTION_WATCHER] = "0"
        try:
            return super().fit()
        finally:
            os.environ.pop(_PREEMPTION_WATCHER, None)


_PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for its PreemptionWatcher actor (on by default)."""


def fit_trainer(trainer: TorchTrainer, stop: DriverStop):
    """`trainer.fit()`, with an InputError that stopped a worker raised as it is; SIGTERM and
    Ctrl-C stop the workers after their step, with a checkpoint (`stop`, raypack/train/stop.py),
    or at once (`Terminated`) on a second signal or at the grace period's end."""
    # Ray Train installs its SIGINT handler from the main thread only, so never in a sweep trial
    before = raycompat.take_sigint_handler(trainer, stop.install)
    try:
        return trainer.fit()
    except ray.train.ControllerError as e:
        if isinstance(e.controller_failure, InputError):
            raise e.controller_failure from None
        raise
    finally:
        stop.close()
        for signum, handler in before.items():
            signal.signal(signum, handler)
