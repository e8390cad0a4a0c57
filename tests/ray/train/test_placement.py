"""A run on the local instance listens on loopback only, torch.distributed included: rank 0's
store (which torch binds to every interface, with no authentication) and gloo's pairs.

One tiny run, two gloo workers; rank 0 looks at its own process while the process group is up.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import psutil
import pytest
import ray
import ray.train

from raypack.train import trainer
from tests.ray.train.test_trainer import tiny_cfg, with_worker_loop

pytestmark = pytest.mark.ray

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def outside_address() -> str | None:
    """An IPv4 address of this machine that isn't loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def reaches(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def loop_looking_at_rank0(config: dict, out: str, outside: str | None) -> None:
    """Rank 0 records its listening sockets and whether the store's port answers on `outside`,
    and (guarding the guard) whether a store made as torch makes one does; then both ranks meet."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    if ray.train.get_context().get_world_rank() == 0:
        me = psutil.Process()
        port = int(os.environ["MASTER_PORT"])
        found = {"store_port": port, "master_addr": os.environ["MASTER_ADDR"],
                 "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
                 "listening": [[c.laddr.ip, c.laddr.port] for c in me.net_connections("inet")
                               if c.status == psutil.CONN_LISTEN]}
        if outside:
            plain = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            found.update(store_reached=reaches(outside, port), plain_reached=reaches(outside, plain.port))
        Path(out).write_text(json.dumps(found))
    dist.barrier()


@pytest.fixture(scope="module")
def rank0(ray_local, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("loopback")
    out = tmp / "rank0.json"
    patch = pytest.MonkeyPatch()
    with_worker_loop(patch, loop_looking_at_rank0, out=str(out), outside=outside_address())
    try:
        trainer.start(tiny_cfg(tmp, "train.max_steps=1"))
    finally:
        patch.undo()
    return json.loads(out.read_text())


def test_rank0_listens_on_loopback_only(rank0):
    assert rank0["master_addr"] == "127.0.0.1"
    # gloo binds the host name's address unless told an interface (here the name is loopback anyway)
    assert rank0["gloo_interface"] in ("lo", "lo0")
    assert rank0["store_port"] in {port for _, port in rank0["listening"]}, "the store's socket was not seen"
    assert {ip for ip, _ in rank0["listening"]} <= LOOPBACK, rank0["listening"]


def test_the_store_refuses_this_machines_other_address(rank0):
    if "store_reached" not in rank0:
        pytest.skip("this machine has no IPv4 address besides loopback to connect from")
    assert rank0["plain_reached"], "guard: a store made as torch makes one should answer there"
    assert not rank0["store_reached"], "rank 0's store answers on a non-loopback address"


def test_a_ray_worker_knows_the_instance_is_local(ray_local):
    """A sweep trial runs `trainer.start` in a Tune actor, not in the process that started Ray:
    it too must pick the loopback store (and the local instance's request check)."""
    from raypack.runtime import is_local_instance

    assert is_local_instance()
    assert ray.get(ray.remote(is_local_instance).remote())
