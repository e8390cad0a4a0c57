"""GPU memory, host memory, disk and interconnect time for every shipped GPU job config: the
arithmetic behind the tables in cluster/README.md, so that they can be re-derived and checked.

    python cluster/memory.py            # the Markdown tables (tests/unit/cluster/test_memory.py
                                        # checks that cluster/README.md holds exactly these)

Assumptions (per rank = per GPU; P parameters, N ranks, T = pack.budget tokens per micro-batch):
- weights bf16, 2 B/param: whole on every GPU under ZeRO-1/2; under ZeRO-3 a 1/N shard plus the
  gathered working set (the larger of the embedding and two layers, capped by the preset's
  stage3_max_live_parameters).
- gradients bf16, 2 B/param, sharded 1/N for ZeRO >= 2, plus one reduce bucket (the preset's
  reduce_bucket_size); with optimizer offload they live on the host in fp32 (4 B/param/N).
- optimizer: fp32 master weights + Adam m and v = 12 B/param, sharded 1/N; on the host with
  train.offload_optimizer.
- activations (bf16; HF Llama/Qwen layers; flash/varlen attention, so no T^2 term): a layer
  keeps ~(16h + 4kv + 8i) bytes per token (fp32 RMSNorm inputs 2x4h, norm outputs 2x2h, q 2h,
  k/v 2x2kv, attention output 2h, gate/up/act/product 4x2i). With gradient checkpointing only
  each layer's input (2h bytes per token) is kept, plus one layer recomputed and its gradients.
- loss: full logits T x vocab at their peak, 12 B per element: bf16 logits 2 + fp32 upcast 4 +
  fp32 gradient 4 + bf16 gradient 2. A loss computed in chunks of 1,024 tokens never holds more
  than one chunk's logits: the "chunked" column.
- not counted: CUDA context, NCCL buffers and allocator fragmentation, ~3-5 GB per GPU.
- disk: a checkpoint is the ZeRO state, 12 B/param (+ 2 B/param of bf16 weights for ZeRO <= 2,
  saved by rank 0) and, in the last one, the Hugging Face model/ (2 B/param). Ray Train keeps 2
  (CheckpointConfig num_to_keep). Saving stages each node's shards in TMPDIR; resuming downloads
  the whole checkpoint to TMPDIR on every node (Checkpoint.as_directory).
- interconnect, per micro-step and GPU: ZeRO-3 moves 3 x 2P bytes (all-gather forward and
  backward, reduce-scatter), ZeRO-2 2P (reduce-scatter) plus 2P once per optimizer step,
  each times (N-1)/N; compute is 8P FLOPs per token (6P + recomputation) at 400 TFLOP/s.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from raypack.config import Config, load  # noqa: E402
from raypack.train.engine import load_preset  # noqa: E402

GB = 1e9
GPUS_PER_NODE = 8
HBM_GB = 80  # H100 80GB
CHUNK = 1024
ACHIEVED_FLOPS = 400e12  # bf16 per H100, ~40% of peak
# Bandwidth per GPU across nodes, GB/s: p5 EFA 3,200 Gbit/s per node; a3-highgpu TCPX 4 x 200
# Gbit/s; plain TCP on the primary NIC (~200 Gbit/s per node, an optimistic figure).
LINKS = {"EFA (p5)": 3200 / 8 / 8, "TCPX (a3)": 800 / 8 / 8, "TCP only": 200 / 8 / 8}


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    @property
    def kv(self) -> int:
        return self.kv_heads * self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv
        bias = self.hidden + 2 * self.kv if self.qkv_bias else 0
        return attn + bias + 3 * self.hidden * self.inter + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tied else 2) + self.hidden


# From each model's config.json on the hub.
ARCHS = {
    "meta-llama/Llama-3.1-8B": Arch(32, 4096, 14336, 32, 8, 128256),
    "meta-llama/Llama-3.1-70B": Arch(80, 8192, 28672, 64, 8, 128256),
    "Qwen/Qwen2.5-7B": Arch(28, 3584, 18944, 28, 4, 152064, qkv_bias=True),
}
CONFIGS = ["llama8b_zero3_1node.yaml", "llama8b_zero3_2node.yaml", "llama8b_zero3_4node.yaml",
           "llama70b_zero3_offload.yaml", "qwen7b.yaml", "sweeps/packing.yaml"]
ZERO2 = ["train.zero_stage=2", "train.deepspeed_preset=zero2"]
"""The choice for several nodes without EFA or TCPX (cluster/README.md, "Interconnect")."""
VARIANTS = [("llama8b_zero3_2node.yaml", ZERO2), ("llama8b_zero3_4node.yaml", ZERO2)]


@dataclass(frozen=True)
class Row:
    name: str
    cfg: Config
    arch: Arch

    @property
    def n(self) -> int:
        return self.cfg.train.num_workers

    @property
    def zero(self) -> dict:
        return load_preset(self.cfg.train.deepspeed_preset).get("zero_optimization", {})

    @property
    def tokens(self) -> int:
        return max([self.cfg.pack.budget, *(self.cfg.tune.budgets or ())])

    def weights(self) -> float:
        p = self.arch.params
        if self.cfg.train.zero_stage < 3:
            return 2 * p
        live = min(self.zero.get("stage3_max_live_parameters", p),
                   max(self.arch.vocab * self.arch.hidden, 2 * self.arch.layer_params))
        return 2 * p / self.n + 2 * live

    def grads(self) -> float:
        bucket = 2 * self.zero.get("reduce_bucket_size", 0)
        if self.cfg.train.offload_optimizer:
            return bucket
        shard = self.n if self.cfg.train.zero_stage >= 2 else 1
        return 2 * self.arch.params / shard + bucket

    def optimizer(self) -> float:
        return 0.0 if self.cfg.train.offload_optimizer else 12 * self.arch.params / self.n

    def host_per_node(self) -> float:
        if not self.cfg.train.offload_optimizer:
            return 0.0
        return (12 + 4) * self.arch.params / self.n * GPUS_PER_NODE

    def activations(self) -> float:
        a, t = self.arch, self.tokens
        per_layer = 16 * a.hidden + 4 * a.kv + 8 * a.inter
        if self.cfg.model.gradient_checkpointing:
            return t * (2 * a.hidden * a.layers + 2 * per_layer)
        return t * per_layer * a.layers

    def loss(self, tokens: int | None = None) -> float:
        return 12 * (tokens or self.tokens) * self.arch.vocab

    def total(self, chunked: bool = False) -> float:
        loss = self.loss(min(CHUNK, self.tokens)) if chunked else self.loss()
        return self.weights() + self.grads() + self.optimizer() + self.activations() + loss

    def checkpoint(self) -> float:
        return (12 + (2 if self.cfg.train.zero_stage <= 2 else 0)) * self.arch.params

    def comm_seconds(self, bandwidth_gbs: float) -> float:
        moved = (3 if self.cfg.train.zero_stage == 3 else 1) * 2 * self.arch.params * (self.n - 1) / self.n
        if self.cfg.train.zero_stage < 3:
            moved += 2 * self.arch.params * (self.n - 1) / self.n / self.cfg.train.grad_accum
        return moved / (bandwidth_gbs * GB)

    def compute_seconds(self) -> float:
        return 8 * self.arch.params * self.tokens / ACHIEVED_FLOPS


def rows(variants: bool = False) -> list[Row]:
    out = []
    for name, overrides in [(n, []) for n in CONFIGS] + (VARIANTS if variants else []):
        cfg = load(REPO / "jobs" / "configs" / name, overrides)
        label = name + (" " + " ".join(overrides) if overrides else "")
        out.append(Row(label, cfg, ARCHS[cfg.model.name]))
    return out


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def markdown() -> str:
    rs = rows(variants=True)
    lines = [
        "| config | model (params) | ranks (nodes) | ZeRO | tokens / row | weights | grads | optimizer "
        "| activations | loss, full logits | **total / GPU** | loss, chunked | total, chunked | GPU / node | host RAM / node |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        t = r.cfg.train
        zero = f"{t.zero_stage}" + (" + offload" if t.offload_optimizer else "")
        lines.append(
            f"| `{r.name}` | {r.cfg.model.name.split('/')[-1]} ({r.arch.params / 1e9:.2f}B) | {r.n} ({r.n // GPUS_PER_NODE}) "
            f"| {zero} | {r.tokens} | {_gb(r.weights())} | {_gb(r.grads())} | {_gb(r.optimizer())} "
            f"| {_gb(r.activations())} | {_gb(r.loss())} | **{_gb(r.total())}** | {_gb(r.loss(min(CHUNK, r.tokens)))} "
            f"| {_gb(r.total(chunked=True))} | {_gb(GPUS_PER_NODE * r.total())} | {_gb(r.host_per_node())} |"
        )
    lines += [
        "",
        "| config | checkpoint | storage (2 kept + final model/) | per node: save staging | per node: resume staging "
        "| per node: model cache | local disk to plan per node |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows():
        p = r.arch.params
        save = 12 * p / r.n * GPUS_PER_NODE + (2 * p if r.cfg.train.zero_stage <= 2 else 0)
        resume = r.checkpoint()
        model = 2 * p
        lines.append(
            f"| `{r.name}` | {_gb(r.checkpoint())} | {_gb(2 * r.checkpoint() + 2 * p)} | {_gb(save)} | {_gb(resume)} "
            f"| {_gb(model)} | {_gb(1.2 * (resume + model))} |"
        )
    lines += [
        "",
        "| config | compute / micro-step | " + " | ".join(f"comm / micro-step, {k}" for k in LINKS) + " |",
        "|---|---|" + "---|" * len(LINKS),
    ]
    for r in rs:
        if r.n <= GPUS_PER_NODE:
            continue
        comm = " | ".join(f"{r.comm_seconds(bw):.1f} s" for bw in LINKS.values())
        lines.append(f"| `{r.name}` | {r.compute_seconds():.1f} s | {comm} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
