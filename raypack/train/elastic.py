"""Elastic runs (`train.num_workers: [min, max]`): Ray Train's elastic scaling picks the worker
count, raypack plans the data for it.

    driver: fit on Ray Train's ScalingConfig(num_workers=(min, max)), the data planned for N
      └─ a node lost: Ray Train restarts the group on the M workers the cluster holds (a node
         back: it grows the group, after train.elastic_resize_interval_s)
           └─ workers: M != N, return {RESIZED: M} untrained (raypack/train/remote.py)
    driver: the fit ends with that value ──> going_on(cfg, M): one line, the step size kept
      └─ start again on M (trainer.start): the epoch's rest planned for M from the last
         checkpoint's step logs, its state resharded (raypack/train/resize.py), fit on (min, max)

Why the driver plans and not the restarted workers: the plan is a global Ray Data job over the
tokenized examples (raypack/data/rest.py), which is the driver's work everywhere else, and a fit
ended and started again is the path a `--resume` on another worker count already takes, tested.
What a restart costs: one worker-group start that trains nothing, the steps since the last
checkpoint (as any restart), and the rest's planning (seconds for small data).

Each change of size is one line on the screen and, in the trackers, the `workers` metric of
every report, which steps where the run changed size (raypack/train/loop.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from raypack.config import Config
from raypack.errors import InputError
from raypack.train import resize
from raypack.train.remote import RESIZED


def scaling_workers(cfg: Config, local: bool) -> int | tuple[int, int]:
    """Ray Train's `ScalingConfig(num_workers=...)`: (min, max) for an elastic run on a cluster.
    A local instance (`local`) has one node, none to lose or gain: there an elastic run is a
    fixed one on max workers, without the AutoscalingCoordinator, which has no autoscaler to ask."""
    t = cfg.train
    return (t.elastic[0], t.elastic[1]) if t.elastic and not local else t.num_workers


def check_elastic(cfg: Config) -> None:
    """Refuse, before anything runs, an elastic run whose checkpoints couldn't go on on another
    worker count: pieces of examples, or DeepSpeed state its universal checkpoint doesn't reshard
    exactly (resize.unconvertible)."""
    from raypack.data.strategies import STRATEGIES

    if cfg.train.elastic and STRATEGIES[cfg.pack.strategy].splits_examples:
        raise InputError(f"train.num_workers={list(cfg.train.elastic)}: pack.strategy={cfg.pack.strategy} splits "
                         "examples across steps, so a run that changes size can't tell which pieces trained; use "
                         "a fixed train.num_workers, or a strategy that keeps examples whole")
    if cfg.train.elastic and cfg.train.engine == "deepspeed" and (why := resize.unconvertible(cfg)):
        raise InputError(f"train.num_workers={list(cfg.train.elastic)}: a run that changes size reshards its "
                         f"DeepSpeed ZeRO state, which {why} raypack can't do exactly; use a fixed "
                         "train.num_workers, or train.engine=torch")


def at_least(cfg: Config, local: bool) -> Config:
    """`cfg` at its smallest size: what must have room before an elastic run starts on a cluster
    (on a local instance, its max: `scaling_workers`)."""
    t = cfg.train
    if not t.elastic or local:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(t, num_workers=t.elastic[0]))


@contextlib.contextmanager
def planning(cfg: Config) -> Iterator[None]:
    """An elastic run's data planned for its current size: a plan the data can't fill (fewer
    packs than ranks) says which size of the range it was planned for, in its one line."""
    try:
        yield
    except InputError as e:
        t = cfg.train
        if not t.elastic:
            raise
        raise InputError(f"train.num_workers={list(t.elastic)}, the data planned for {t.num_workers} workers: {e}") from None


def resized_to(result: Any) -> int | None:
    """The worker count a fit's workers returned for (they found the group restarted on another
    count than the data is planned for); None for a fit that trained to its end or stopped."""
    value = getattr(result, "return_value", None)
    return int(value[RESIZED]) if isinstance(value, dict) and RESIZED in value else None


def going_on(cfg: Config, count: int, root: str, started: Config) -> Config:
    """`cfg` on `count` workers, after Ray Train restarted the group on them: an optimizer step
    keeps the size it had at the last checkpoint (or in `started`, the config the run started
    with, before its first), where `count` divides it (resize.keep_step_size); one line says so."""
    t = cfg.train
    was = t.num_workers
    pos = resize.last_position(root)
    # what a step trained last: the checkpoint's shape, or the configured one before any checkpoint
    shape = pos or resize.Position(epoch=0, micro_step=0, step=0, plan="", world_size=started.train.num_workers,
                                   grad_accum=started.train.grad_accum, checkpoint="")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, num_workers=count, grad_accum=shape.grad_accum))
    resize.check_resizable(cfg, pos)
    cfg, line = resize.keep_step_size(cfg, shape, accum_given=False)
    where = f"from step {pos.step}'s checkpoint" if pos is not None else "from the start (no checkpoint yet)"
    if line and pos is None:  # no epoch's rest: its data is planned whole for them
        line = line.split("; the rest of epoch")[0]
    print(f"[raypack] the cluster holds {count} worker{'s' if count > 1 else ''} now, not {was} "
          f"(train.num_workers={list(t.elastic)}): going on {where}"
          + (f"; {line.split(': ', 1)[1]}" if line else ""), flush=True)
    return cfg


def unresized(cfg: Config) -> None:
    """An elastic run's workers returned untrained for a size the config already has: a bug, not
    a state to loop in."""
    raise InputError(f"train.num_workers={list(cfg.train.elastic)}: the workers asked for {cfg.train.num_workers} "
                     "workers, the size the data is planned for; this is a raypack bug: report it")
