"""What the router load-balancing loss costs a training step (issue 43): tokens/s of one
optimizer step's forward and backward on packed rows of a Qwen3-MoE-shaped model, with
`train.router_aux_loss_coef` 0 (off) and 0.001, per scope, the settings alternated so that drift
on a shared machine hits both.

    PYTHONPATH=. python benchmarks/router_loss.py            # one GPU: 16 layers, 64 experts, top 8, bf16
    PYTHONPATH=. python benchmarks/router_loss.py --smoke    # tiny model on the CPU: proves the script runs

The step is the training loop's own (raypack/train/step.py `train_step`: the chunked loss, the
router hooks, the per-example sums on the device, values read through stepvalues.Pending), on one
process without DeepSpeed (no optimizer update: the router loss adds nothing there). Rows are
FLAN-like: several examples of 20-400 tokens packed to `--tokens`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_line, device_name, gpu_or_smoke, machine, smoke_banner, versions, write_results  # noqa: E402

SETTINGS = (("off", 0.0, "example"), ("example", 0.001, "example"), ("micro_batch", 0.001, "micro_batch"))


class OneRank:
    """The engine calls train_step makes, on one process without an optimizer: backward divided by
    the micro-batches (tests/unit/train/test_step.py uses it too)."""

    def __init__(self, model, micro_batches: int, device=None):
        import torch

        self.module, self.micro_batches = model, micro_batches
        self.device = device if device is not None else torch.device("cpu")

    def __call__(self, **batch):
        return self.module(**batch)

    def backward(self, loss):
        (loss / self.micro_batches).backward()

    def step(self):
        pass

    def grad_norm(self):
        return None


def packed_rows(n_rows: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        lengths, left = [], tokens
        while left > 20:
            n = min(int(torch.randint(20, 400, (1,), generator=g)), left)
            lengths.append(n)
            left -= n
        ids = torch.randint(3, vocab, (sum(lengths),), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": [p for n in lengths for p in range(n)],
                     "num_tokens": len(ids), "example_ids": list(range(len(lengths)))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, short rows, CPU: proves the script runs")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of each packed row")
    p.add_argument("--rows", type=int, default=2, help="micro-batches (packed rows) a step")
    p.add_argument("--rounds", type=int, default=3, help="times each setting is timed, alternating")
    p.add_argument("--steps", type=int, default=4, help="timed steps a round (after one warm-up step)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = gpu_or_smoke(__file__, args.smoke, "measures the router loss")
    if device is None:
        return 2
    import torch

    from raypack.config.sections import TrainConfig
    from raypack.model.build import load_model
    from raypack.train.step import train_step
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.objectives.router_loss import make_router_loss
    from raypack.train.stepvalues import HostCounts

    if args.smoke:
        args.tokens, args.rounds, args.steps, shape = 256, 1, 1, {}
    else:
        shape = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)
    dtype = "bfloat16" if device == "cuda" else "float32"
    torch.manual_seed(0)
    model = load_model("tiny-qwen3_moe", dtype=dtype, vocab_size=32_000 if shape else 768, **shape).to(device).train()
    config = model.config
    loss = make_loss(model, "chunked")
    rows = packed_rows(args.rows, args.tokens, config.vocab_size)
    tokens = sum(r["num_tokens"] for r in rows)
    examples = sum(len(r["example_ids"]) for r in rows)
    times: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
    values: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, coef, scope in SETTINGS:
            router = make_router_loss(model, TrainConfig(router_aux_loss_coef=coef, router_aux_loss=scope), "bench")
            step = prepare_step(rows, router_scope=router.scope if router else None, pin=device == "cuda")
            for i in range(args.steps + 1):
                model.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = train_step(OneRank(model, len(rows), torch.device(device)), step, loss, HostCounts(1), 1,
                                 router=router).resolve()
                if device == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first is a warm-up
                    times[name].append(time.perf_counter() - t0)
            values[name] = got.get("router_aux_loss", float("nan"))
            if router is not None:
                router.routers.remove()
    base = statistics.median(times["off"])
    lines = [f"# Router load-balancing loss: step cost, {device_name()}, {time.strftime('%Y-%m-%d')}",
             *smoke_banner(args.smoke), "", f"Command: `{command_line(__file__, argv)}`", "",
             f"Machine: {machine()}. Versions: {versions()}.", "",
             f"Model: Qwen3-MoE-shaped, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
             f"{config.num_experts} experts, top {config.num_experts_per_tok}, {dtype}. A step: {len(rows)} packed rows, "
             f"{tokens:,} tokens, {examples} examples; forward and backward (no optimizer). Median of "
             f"{args.rounds} x {args.steps} timed steps a setting, the settings alternated.", "",
             "| router loss | tokens/s | step s | vs off | router_aux_loss |", "|---|---|---|---|---|"]
    for name, _, _ in SETTINGS:
        median = statistics.median(times[name])
        lines.append(f"| {name} | {tokens / median:,.0f} | {median:.3f} | {median / base:.3f}x | "
                     f"{values[name]:.4f} |")
    lines += ["", "`example` sums each example's loss (one scatter per layer over the examples); `micro_batch` pools "
              "the row, as transformers' load_balancing_loss_func does.", ""]
    write_results("router_loss", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
