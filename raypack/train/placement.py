"""Where a run's workers go: the request checked against the cluster before anything is
prepared, and, on a local instance, a process group that listens on loopback only.

    check_request(cfg)                                   # in seconds, or a bounded wait
    torch_config, env = process_group(cfg.train, local)  # for TorchTrainer and the workers' env

A local instance can't grow: its totals decide. A joined cluster is judged by its nodes and by
the node types its autoscaler publishes; room for workers that could fit is waited for at most
`train.start_timeout_s`. Ray Train alone would wait for ever, printing a startup timeout every
minute.

On a local instance the run listens on 127.0.0.1 only, like the instance: rank 0's
torch.distributed store (`LoopbackStoreTorchConfig`) and gloo's and NCCL's sockets.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections import Counter

import ray
from ray.train.torch import TorchConfig

from raypack.config import Config
from raypack.errors import ConfigError, InputError
from raypack.runtime import ClusterView, cluster_view, is_local_instance


def worker_resources(t) -> dict[str, float]:
    """What each Ray Train worker reserves (`t`: the train section)."""
    return {"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}


WAIT_REPORT_S = 30.0
"""Seconds between the lines that say what a start is waiting for."""


def check_request(cfg: Config, wait: bool = True) -> None:
    """Before any data is prepared: refuse in seconds workers the cluster can never hold, and wait
    at most `train.start_timeout_s` for room for the others. Ray Train would wait for ever,
    printing a startup timeout every minute. A local instance can't grow: its totals decide. A
    joined cluster is judged by its nodes and by the node types its autoscaler publishes (an
    autoscaler that publishes none can't be judged: only the wait bounds it); then a placement
    group like Ray Train's is made, which is also what asks an autoscaler for nodes, and removed
    once ready, for Ray Train to make its own. Nothing holds the room while the data is prepared.
    `wait=False` skips the wait: a sweep's trials queue for room behind each other, as long as it takes."""
    t = cfg.train
    if not is_local_instance():
        view = cluster_view()
        _check_cluster_holds(t, view)
        if wait:
            _wait_for_room(t, view)
        return
    have = ray.cluster_resources()
    asks = [("CPU", t.num_workers * t.cpus_per_worker, "train.num_workers x train.cpus_per_worker"),
            ("GPU", t.num_workers if t.use_gpu else 0, "train.use_gpu (one GPU per worker)")]
    for resource, need, setting in asks:
        if need > have.get(resource, 0):
            raise ConfigError(
                f"{setting}: {t.num_workers} workers need {need:g} {resource}s, but this local Ray instance has "
                f"{have.get(resource, 0):g} and can't grow; lower train.num_workers"
                + (" or train.cpus_per_worker" if resource == "CPU" else ", or set train.use_gpu=false")
                + ", or submit to a cluster that has them (RAY_ADDRESS, ray job submit)"
            )


def _shown(resources: dict[str, float], keys) -> str:
    return "{" + ", ".join(f"{k}: {resources.get(k, 0):g}" for k in keys) + "}"


def _check_cluster_holds(t, view: ClusterView) -> None:
    """ConfigError unless the nodes, and the nodes the autoscaler may add, can hold every worker."""
    bundle = worker_resources(t)
    one_per_node = t.placement_strategy == "STRICT_SPREAD"

    def fit(resources: dict[str, float]) -> int:  # workers one node of these resources holds
        n = min(int(resources.get(k, 0) / v + 1e-6) for k, v in bundle.items())
        return min(n, 1) if one_per_node else n

    added = [fit(r) and fit(r) * (math.inf if most < 0 else most) for _, r, most in view.node_types]
    holds = sum(map(fit, view.nodes)) + sum(added)
    if holds >= t.num_workers or (view.grows and not view.node_types):
        return  # enough; or an autoscaler that doesn't say what it may add: the wait bounds it
    nodes = ", ".join(f"{n} x {shape}" for shape, n in Counter(_shown(r, bundle) for r in view.nodes).items())
    types = ", ".join(f"{name} {_shown(r, bundle)} up to {most}" for name, r, most in view.node_types)
    can_add = f"node types its autoscaler may add: {types}" if types else "no autoscaler adds nodes"
    if holds:
        fix = f"lower train.num_workers to {holds:g}"
        fix += " or set train.placement_strategy=PACK" if one_per_node else ""
    elif t.use_gpu and not any(r.get("GPU") for r in view.nodes + [r for _, r, _ in view.node_types]):
        fix = "set train.use_gpu=false, or submit to a cluster with GPU nodes"
    else:
        fix = "lower train.cpus_per_worker to what one node has"
    raise ConfigError(
        f"train.num_workers={t.num_workers} workers of {_shown(bundle, bundle)} each ({t.placement_strategy}) can "
        f"never start on this cluster, which holds at most {holds:g} (its nodes: {nodes}; {can_add}); {fix}"
    )


def _wait_for_room(t, view: ClusterView) -> None:
    """Wait, saying what for every WAIT_REPORT_S, until a placement group like Ray Train's is
    ready, then remove it; InputError after `train.start_timeout_s`."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = worker_resources(t)
    pg = placement_group([bundle] * t.num_workers, strategy=t.placement_strategy, name="raypack-start-probe")
    deadline = time.monotonic() + (math.inf if t.start_timeout_s is None else t.start_timeout_s)
    wanted = f"{t.num_workers} workers of {_shown(bundle, bundle)} each ({t.placement_strategy})"
    ready = pg.ready()  # pg.wait() takes whole seconds: 0.9 s left would not wait at all
    try:
        step = 2.0  # most starts find room at once; one that doesn't says so early
        while not ray.wait([ready], timeout=max(0.0, min(step, deadline - time.monotonic())))[0]:
            free = f"free now {_shown(ray.available_resources(), bundle)} of {_shown(ray.cluster_resources(), bundle)}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise InputError(
                    f"train.start_timeout_s={t.start_timeout_s:g}: no room for {wanted} within "
                    f"{t.start_timeout_s:g} s, {free}; raise train.start_timeout_s (null: wait as long as it takes), "
                    "free the cluster, or lower train.num_workers"
                )
            grows = "; an autoscaler may add nodes" if view.grows else ""
            until = "" if math.isinf(left) else f"; gives up in {left:.0f} s (train.start_timeout_s)"
            print(f"[raypack] waiting for room for {wanted}: {free}{grows}{until}", flush=True)
            step = WAIT_REPORT_S
    finally:
        remove_placement_group(pg)


def backend(t) -> str:
    """The process group's backend (`t`: the train section): NCCL on GPUs, gloo on CPUs. Where
    the torch engine's FSDP2 offloads (CPUOffloadPolicy), its shards and gradients are host
    tensors, and the gradient norm's all-reduce runs on them, which NCCL can't (pytorch#148532):
    then both, each tensor to the backend of its device, as torchtitan does."""
    if not t.use_gpu:
        return "gloo"
    if t.engine == "torch" and t.zero_stage > 0 and (t.offload_optimizer or t.offload_params):
        return "cpu:gloo,cuda:nccl"
    return "nccl"


def process_group(t, local: bool) -> tuple[TorchConfig, dict[str, str]]:
    """Ray Train's TorchConfig for the run (`t`: the train section), and the environment its
    workers need: on a local instance, a store and collectives that listen on loopback only."""
    backend_ = backend(t)
    if not local:
        return TorchConfig(backend=backend_), {}
    # gloo and NCCL listen on the address of the interface named here (else on the host name's
    # address, or the first interface that isn't loopback): loopback, as Ray does.
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env = {k: os.environ.get(k, loopback) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return LoopbackStoreTorchConfig(backend=backend_), env


def _store_on_master_addr() -> None:
    """In a worker, before Ray Train sets up the process group: rank 0's torch.distributed store
    listens on MASTER_ADDR only (127.0.0.1 on a local instance). torch's store binds every
    interface whatever address it is given (`::`, libuv or not; USE_LIBUV changes nothing) and
    has no authentication; the one way to choose is a socket already bound (`master_listen_fd`),
    which env:// doesn't offer. So torch's env:// handler is wrapped: on rank 0 it first starts a
    multi-tenant store server on a socket bound to MASTER_ADDR, which the store that env:// then
    makes on the same port reuses (TCPStore shares one server per port within a process)."""
    import importlib
    from urllib.parse import parse_qsl, urlparse

    from torch.distributed import TCPStore

    # The module (torch.distributed.rendezvous is also the name of a function in its package).
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    env_rendezvous = rendezvous._rendezvous_handlers["env"]  # no public way to replace one
    if getattr(env_rendezvous, "on_master_addr", False):
        return

    def on_master_addr(url: str, **kwargs):
        if dict(parse_qsl(urlparse(url).query)).get("rank", os.environ.get("RANK")) == "0":
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            listener = socket.create_server((addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
            # Held until env:// below has made its store; the server owns the socket from here.
            server = TCPStore(addr, port, is_master=True, multi_tenant=True, wait_for_workers=False,  # noqa: F841
                              master_listen_fd=listener.detach())
        yield from env_rendezvous(url, **kwargs)

    on_master_addr.on_master_addr = True
    rendezvous._rendezvous_handlers["env"] = on_master_addr


class _LoopbackStoreBackend(TorchConfig().backend_cls):  # Ray Train's torch backend, by its public name
    def on_start(self, worker_group, backend_config) -> None:
        worker_group.execute(_store_on_master_addr)
        super().on_start(worker_group, backend_config)


class LoopbackStoreTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, with rank 0's store on MASTER_ADDR only (`_store_on_master_addr`):
    what a local instance, which listens on 127.0.0.1 only, uses."""

    @property
    def backend_cls(self):
        return _LoopbackStoreBackend
