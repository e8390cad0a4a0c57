"""GPU memory, host memory, disk and interconnect time for every shipped GPU job config: the
arithmetic behind the tables in cluster/README.md, so that they can be re-derived and checked.

    python cluster/memory.py            # the Markdown tables (tests/unit/cluster/test_memory.py
                                        # checks that cluster/README.md holds exactly these):
                                        # per config, then what fits on one GPU

The per-GPU terms (weights, gradients, optimizer, activations, loss; full fine-tuning, LoRA and
QLoRA) are raypack/train/memory/estimate.py's, the same arithmetic `raypack plan` prints; its docstring
states what they count. Here, per config (P parameters, N ranks, T = pack.budget tokens per
micro-batch, the largest of tune.budgets for a sweep):
- the "chunked" columns compute the loss 1,024 tokens at a time and leave out its fp32 sum of the
  head's gradient (4 B x vocabulary x hidden); "what fits on one 80 GB GPU" counts it, with the
  loss's own chunk (2,048 tokens for a 128k vocabulary), under 80 GB less OVERHEAD_GB.
- not counted: CUDA context, NCCL buffers and allocator fragmentation, ~3-5 GB per GPU.
- disk: a checkpoint is the ZeRO state, 12 B/param (+ 2 B/param of bf16 weights for ZeRO <= 2,
  saved by rank 0) and, in the last one, the Hugging Face model/ (2 B/param). With adapters it
  holds only the trained params (14 B each) and, in the last one, adapter/ and the merged model/.
  Ray Train keeps 2 (CheckpointConfig num_to_keep). Saving stages each node's shards in TMPDIR;
  resuming downloads the whole checkpoint to TMPDIR on every node (Checkpoint.as_directory).
- interconnect, per micro-step and GPU: ZeRO-3 moves 3 x 2P bytes (all-gather forward and
  backward, reduce-scatter), ZeRO-2 2P (reduce-scatter) plus 2P once per optimizer step,
  each times (N-1)/N; compute is 8P FLOPs per token (6P + recomputation) at 400 TFLOP/s.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from raypack.config import Config, load  # noqa: E402
from raypack.train.memory.estimate import GB, Arch, Memory, estimate, preset_zero  # noqa: E402


GPUS_PER_NODE = 8
HBM_GB = 80  # H100 80GB
OVERHEAD_GB = 5  # CUDA context, NCCL buffers, fragmentation: what "fits" keeps free
CHUNK = 1024
ACHIEVED_FLOPS = 400e12  # bf16 per H100, ~40% of peak
# Bandwidth per GPU across nodes, GB/s: p5 EFA 3,200 Gbit/s per node; a3-highgpu TCPX 4 x 200
# Gbit/s; plain TCP on the primary NIC (~200 Gbit/s per node, an optimistic figure).
LINKS = {"EFA (p5)": 3200 / 8 / 8, "TCPX (a3)": 800 / 8 / 8, "TCP only": 200 / 8 / 8}

# From each model's config.json on the hub (tests/unit/cluster/test_memory.py builds the same
# records from transformers configs with Arch.from_config).
ARCHS = {
    "meta-llama/Llama-3.1-8B": Arch(32, 4096, 14336, 32, 8, 128256),
    "meta-llama/Llama-3.1-70B": Arch(80, 8192, 28672, 64, 8, 128256),
    "Qwen/Qwen2.5-7B": Arch(28, 3584, 18944, 28, 4, 152064, qkv_bias=True),
}
CONFIGS = ["llama8b_zero3_1node.yaml", "llama8b_zero3_2node.yaml", "llama8b_zero3_4node.yaml",
           "llama70b_zero3_offload.yaml", "qwen7b.yaml", "sweeps/packing.yaml", "llama8b_lora_1gpu.yaml",
           "llama8b_long_sp8.yaml"]
ZERO2 = ["train.zero_stage=2", "train.deepspeed_preset=zero2"]
"""The choice for several nodes without EFA or TCPX (cluster/README.md, "Interconnect")."""
VARIANTS = [("llama8b_zero3_2node.yaml", ZERO2), ("llama8b_zero3_4node.yaml", ZERO2),
            ("llama8b_zero3_1node.yaml", ["model.peft.method=lora"]),
            ("llama8b_lora_1gpu.yaml", ["model.peft.method=qlora"])]
FITS_BASE = "llama8b_lora_1gpu.yaml"
"""One GPU, ZeRO-2 (zero2 preset), r=16 all-linear adapters, chunked loss: "what fits" varies the rest."""
FITS_MODELS = ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"]
MAX_BUDGET = 1 << 20


@dataclass(frozen=True)
class Row:
    name: str
    cfg: Config
    arch: Arch

    @property
    def n(self) -> int:
        return self.cfg.train.num_workers

    @property
    def gpus_per_node(self) -> int:
        return min(self.n, GPUS_PER_NODE)

    @property
    def tokens(self) -> int:
        """Tokens a GPU holds of the longest row: a row's 1/N under train.sequence_parallel N."""
        return -(-max([self.cfg.pack.budget, *(self.cfg.tune.budgets or ())]) // self.cfg.train.sequence_parallel)

    @cached_property
    def zero(self) -> dict:
        return preset_zero(self.cfg)

    def memory(self, chunked: bool = False, tokens: int | None = None) -> Memory:
        return estimate(self.cfg, self.arch, tokens=tokens or self.tokens, loss="chunked" if chunked else "full",
                        chunk=CHUNK, zero=self.zero)

    def total(self, chunked: bool = False) -> float:
        m = self.memory(chunked)
        return m.total - m.head_sum  # the chunked columns leave the head's fp32 sum out (docstring)

    @property
    def trained(self) -> int:
        return self.memory().trained

    @property
    def adapters(self) -> bool:
        return self.cfg.model.peft.enabled

    def host_per_node(self) -> float:
        return self.memory().host * GPUS_PER_NODE

    def loss(self, tokens: int | None = None) -> float:
        return self.memory(tokens=tokens).logits

    def checkpoint(self) -> float:
        return (12 + (2 if self.cfg.train.zero_stage <= 2 or self.adapters else 0)) * self.trained

    def final_model(self) -> float:
        """What the last checkpoint adds: model/ (bf16), or adapter/ and, if merged, model/."""
        p = self.arch.params
        return 2 * self.trained + (2 * p if self.cfg.model.peft.merge else 0) if self.adapters else 2 * p

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


def largest_budget(row: Row, capacity: float) -> int:
    """The most tokens a row, in multiples of 1,024 (at most MAX_BUDGET), whose estimate (loss in
    the config's own chunks, its head sum included) stays within `capacity` bytes; 0 if none."""

    def fits(tokens: int) -> bool:
        return estimate(row.cfg, row.arch, tokens=tokens, zero=row.zero).total <= capacity

    lo, hi = 0, MAX_BUDGET // 1024  # in units of 1,024; memory grows with tokens, so bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid - 1)
    return lo * 1024


def fits_rows() -> list[tuple[Row, int]]:
    out = []
    for model in FITS_MODELS:
        for method in ("none", "lora", "qlora"):
            for ckpt in (False, True):
                overrides = [f"model.name={model}", f"model.peft.method={method}", f"model.gradient_checkpointing={ckpt}"]
                cfg = load(REPO / "jobs" / "configs" / FITS_BASE, overrides)
                row = Row(f"{model} {method}", cfg, ARCHS[model])
                out.append((row, largest_budget(row, (HBM_GB - OVERHEAD_GB) * GB)))
    return out


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def _model(r: Row) -> str:
    text = f"{r.cfg.model.name.split('/')[-1]} ({r.arch.params / 1e9:.2f}B"
    peft = r.cfg.model.peft
    return text + (f"; {peft.method} r{peft.r}: {r.trained / 1e6:.1f}M trained)" if r.adapters else ")")


def _fits(budget: int) -> str:
    """Two cells: the largest power of two and multiple of 1,024 within `budget`."""
    if budget == 0:
        return "does not fit | does not fit"
    return f"{1 << (budget.bit_length() - 1)} | {budget}" + (" (the most tried)" if budget == MAX_BUDGET else "")


def markdown() -> str:
    rs = rows(variants=True)
    lines = [
        "| config | model (params) | ranks (nodes) | ZeRO | tokens / GPU | weights | grads | optimizer "
        "| activations | loss, full logits | **total / GPU** | loss, chunked | total, chunked | GPU / node | host RAM / node |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        t, m = r.cfg.train, r.memory()
        zero = f"{t.zero_stage}" + (" + offload" if t.offload_optimizer else "")
        lines.append(
            f"| `{r.name}` | {_model(r)} | {r.n} ({math.ceil(r.n / GPUS_PER_NODE)}) "
            f"| {zero} | {r.tokens} | {_gb(m.weights)} | {_gb(m.grads)} | {_gb(m.optimizer)} "
            f"| {_gb(m.activations)} | {_gb(m.logits)} | **{_gb(r.total())}** | {_gb(r.loss(min(CHUNK, r.tokens)))} "
            f"| {_gb(r.total(chunked=True))} | {_gb(r.gpus_per_node * r.total())} | {_gb(r.host_per_node())} |"
        )
    lines += [
        "",
        "| config | checkpoint | storage (2 kept + final model/) | per node: save staging | per node: resume staging "
        "| per node: model cache | local disk to plan per node |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows():
        p = r.arch.params
        if r.adapters:  # each rank's adapter state, and rank 0 stages adapter/ and model/ at the end
            save = 12 * r.trained / r.n * r.gpus_per_node + r.final_model()
        else:
            save = 12 * p / r.n * GPUS_PER_NODE + (2 * p if r.cfg.train.zero_stage <= 2 else 0)
        resume = r.checkpoint()
        model = 2 * p
        lines.append(
            f"| `{r.name}` | {_gb(r.checkpoint())} | {_gb(2 * r.checkpoint() + r.final_model())} | {_gb(save)} | {_gb(resume)} "
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


def fits_markdown() -> str:
    """The largest pack.budget that fits on one GPU, per model, fine-tuning method and checkpointing."""
    lines = [
        "| model | fine-tuning | gradient checkpointing | weights | grads + optimizer | activations / 1k tokens "
        "| largest power of two | largest multiple of 1024 | total there |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, budget in fits_rows():
        m = estimate(r.cfg, r.arch, tokens=max(budget, 1024), zero=r.zero)
        peft = r.cfg.model.peft
        method = {"none": "full", "lora": f"LoRA r{peft.r}", "qlora": f"QLoRA r{peft.r}"}[peft.method]
        ckpt = "on" if r.cfg.model.gradient_checkpointing == "full" else "off"
        per_1k = _gb(m.activations / max(budget, 1024) * 1024)
        total = _gb(m.total) if budget else "-"
        lines.append(f"| {r.cfg.model.name.split('/')[-1]} ({r.arch.params / 1e9:.2f}B) | {method} | {ckpt} | {_gb(m.weights)} "
                     f"| {_gb(m.grads + m.optimizer)} | {per_1k} | {_fits(budget)} | {total} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown() + "\n" + fits_markdown(), end="")
