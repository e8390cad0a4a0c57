"""NCCL smoke test across nodes: which transport NCCL took, and the all-reduce bandwidth.

    ray job submit ... -- python jobs/nccl_smoke.py --nodes 2 --expect efa     # EKS / aws-gpu.yaml
    ray job submit ... -- python jobs/nccl_smoke.py --nodes 2 --expect tcpx    # GKE / gcp-gpu.yaml

Run it (a few minutes, most of them the GPU nodes starting) before a long multi-node run is paid
for: it starts `--nodes` x `--gpus-per-node` Ray Train workers (one per GPU, PACK, so exactly
`--nodes` nodes), all-reduces `--size-mb` of bf16 `--iters` times with NCCL_DEBUG=INFO written
to one file per process, and every rank then reads its own NCCL log:

- the transport NCCL chose, from its "Using network ..." line (and, for aws-ofi-nccl, the
  libfabric provider: "Selected provider is efa"): `efa`, `tcpx`, `ib`, `socket`, `ofi-<provider>`;
- a rank whose transport is not `--expect` fails the job (exit 1), naming what it found. `socket`
  means NCCL fell back to TCP (the plugin did not load, or the device was not in the pod).

Rank 0 prints the bus bandwidth (the all-reduce algorithm bandwidth x 2(n-1)/n, as nccl-tests
reports it): on p5 with EFA expect well over 100 GB/s across 2 nodes, on a3 with TCPX tens of GB/s,
over plain TCP a few. The interconnect table in cluster/README.md section 6 assumes 50 / 12.5 / 3.1
GB/s per GPU.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

NCCL_LOG = "/tmp/raypack-nccl-smoke.%h.%p.log"  # NCCL expands %h (host) and %p (pid)
NCCL_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": NCCL_LOG}


def transport(log: str) -> str:
    """The network NCCL used, from an NCCL_DEBUG=INFO log (NCCL_DEBUG_SUBSYS including INIT,NET)."""
    nets = re.findall(r"Using network (\S+(?: \S+)?)", log)
    net = nets[-1] if nets else ""
    if "GPUDirectTCPX" in net or "GPUDirectTCPX" in log and not nets:
        return "tcpx"
    if "Libfabric" in net or "OFI" in net or (not nets and "NET/OFI" in log):
        provider = re.findall(r"NET/OFI Selected [Pp]rovider is (\w+)", log)
        return "efa" if provider and provider[-1] == "efa" else f"ofi-{provider[-1] if provider else 'unknown'}"
    if net.startswith("IB"):
        return "ib"
    if net.startswith("Socket"):
        return "socket"
    return net.lower() or "unknown"


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s: size / time x 2(n-1)/n."""
    return size_bytes / seconds * 2 * (world - 1) / world / 1e9


def _loop(config: dict) -> None:
    import time

    import ray.train
    import torch
    import torch.distributed as dist

    os.environ.update(NCCL_ENV)  # before this process's first collective creates its communicator
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(config["size_mb"] * 2**20 // 2, dtype=torch.bfloat16, device=device)
    for _ in range(3):  # warm up: NCCL connects (and logs its transport) here
        dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(config["iters"]):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / config["iters"]
    logs = glob.glob(NCCL_LOG.replace("%h", "*").replace("%p", str(os.getpid())))
    found = transport("".join(open(p, errors="replace").read() for p in logs))
    if found != config["expect"]:
        raise RuntimeError(f"rank {dist.get_rank()} on {os.uname().nodename}: NCCL used {found!r}, "
                           f"expected {config['expect']!r} (log: {logs})")
    ray.train.report({"transport": found, "busbw_gbps": bus_bandwidth(x.numel() * 2, seconds, world),
                      "world": world})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--expect", required=True, choices=["efa", "tcpx", "ib", "socket"])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    try:  # the workers' environment from their start; the loop sets it again before NCCL starts
        ray.init(runtime_env={"env_vars": NCCL_ENV})
    except ValueError:  # the job's own runtime env already sets one of these: keep the job's
        ray.init()
    trainer = TorchTrainer(
        _loop,
        train_loop_config={"size_mb": args.size_mb, "iters": args.iters, "expect": args.expect},
        scaling_config=ScalingConfig(num_workers=args.nodes * args.gpus_per_node, use_gpu=True,
                                     placement_strategy="PACK"),
        run_config=RunConfig(name="raypack-nccl-smoke", storage_path="/tmp/raypack-nccl-smoke"),
    )
    try:
        result = trainer.fit()
    except Exception as e:  # a rank's RuntimeError above, or NCCL failing to connect
        print(f"nccl_smoke: FAILED: {e}", file=sys.stderr)
        return 1
    m = result.metrics
    print(f"nccl_smoke: ok: {m['world']} ranks on {args.nodes} node(s), transport {m['transport']}, "
          f"all-reduce bus bandwidth {m['busbw_gbps']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
