"""The CPU exact attention path: one masked attention over the whole row vs one attention per example.

    PYTHONPATH=. python benchmarks/attention_cpu.py                  # budgets 256..4096, results file
    PYTHONPATH=. python benchmarks/attention_cpu.py --smoke       # seconds; results in the temp folder

raypack's CPU path used to attend over the whole packed row with a block-diagonal mask: O(row²)
time and memory, where the varlen kernels cost Σ len². It now runs SDPA per example. This runs
both, side by side in one process, on the model the CPU configs train (tiny-llama, fp32), on
packed rows of FLAN-like examples filled to each budget:

    masked        the old path, reproduced here (`masked_attention`): SDPA over the flattened row
                  with a [T, T] same-example causal mask built once per forward
    per_example   raypack's `sdpa_varlen` (raypack_exact_varlen): SDPA per cu_seqlens segment

Each step is a forward and backward of one row; the two paths alternate step by step, so load
on a shared host hits both alike. Reported: median seconds per step, real tokens/s, their
ratio (and the ratio of the fastest steps, the least disturbed on a shared host), the largest
logit difference between the paths (they must agree), and, unless --smoke,
each path's peak resident memory above the process's just before the step (one fresh process
per path and budget, sampled every millisecond). Torch runs one thread by default, as in a Ray
Train worker with one CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_line, results_path, smoke_banner  # noqa: E402
from raypack.data.collate import collate_packed  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402
from raypack.model import attention as attn  # noqa: E402
from raypack.model.build import load_model  # noqa: E402

MASKED = "bench_masked_varlen"
PATHS = {"masked": MASKED, "per_example": attn.NAMES["sdpa_varlen"]}


def masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     softcap=None, **kwargs):  # fmt: skip
    """raypack's former CPU path (no softcap or sinks; the model here has neither)."""
    cu = kwargs["cu_seq_lens_q"]
    batch, heads, length, dim = query.shape
    total = batch * length
    idx = torch.arange(total)
    seg = torch.searchsorted(cu[1:].to(idx.dtype), idx, right=True)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    if sliding_window:
        mask &= idx[:, None] - idx[None, :] < sliding_window
    q = query.transpose(0, 1).reshape(1, heads, total, dim)
    k = key.transpose(0, 1).reshape(1, key.shape[1], total, dim)
    v = value.transpose(0, 1).reshape(1, value.shape[1], total, dim)
    if k.shape[1] != heads:
        k, v = k.repeat_interleave(heads // k.shape[1], dim=1), v.repeat_interleave(heads // k.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out[0].transpose(0, 1).reshape(batch, length, heads, -1), None


def register_masked() -> None:
    attn.register()
    AttentionInterface.register(MASKED, masked_attention)


def make_row(budget: int, seed: int, vocab: int) -> tuple[dict, int]:
    """One packed row: FLAN-like examples, next-fit until the budget is full (the last one cut)."""
    lengths = sample_lengths("flan", 4 * budget, seed=seed, max_length=budget)
    chosen, used = [], 0
    for n in lengths.tolist():
        n = min(n, budget - used)
        chosen.append(n)
        used += n
        if used == budget:
            break
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (budget,), generator=g).tolist()
    row = {"input_ids": ids, "labels": ids, "position_ids": [p for n in chosen for p in range(n)]}
    return row, len(chosen)


def build(path: str, seed: int = 0):
    register_masked()
    torch.manual_seed(seed)
    model = load_model("tiny-llama", attention="sdpa_varlen", dtype="float32")
    model.set_attn_implementation(PATHS[path])
    return model


def step(model, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach()


def time_budget(models: dict, budget: int, steps: int, warmup: int) -> dict:
    row, examples = make_row(budget, seed=budget, vocab=1024)
    batch = collate_packed([row])
    logits = {name: step(m, batch) for name, m in models.items()}  # also the first warm-up
    diff = ((logits["masked"] - logits["per_example"]).abs().max() / logits["masked"].abs().max()).item()
    times = {name: [] for name in models}
    for i in range(warmup - 1 + steps):
        for name, m in models.items():
            t0 = time.perf_counter()
            step(m, batch)
            if i >= warmup - 1:
                times[name].append(time.perf_counter() - t0)
    return {"budget": budget, "examples": examples, "max_rel_logit_diff": diff,
            "seconds": {n: statistics.median(t) for n, t in times.items()},
            "spread": {n: [min(t), max(t)] for n, t in times.items()}}  # fmt: skip


def peak_memory(path: str, budget: int, threads: int) -> float:
    """MiB of resident memory a step adds at its peak, in a fresh process: /proc/self/statm
    sampled every millisecond by a thread (torch ops release the GIL) during one step, less the
    resident memory just before it."""
    code = (
        f"import sys, threading, time, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import attention_cpu as b, torch; from raypack.data.collate import collate_packed; "
        f"torch.set_num_threads({threads}); m = b.build({path!r}); "
        f"batch = collate_packed([b.make_row({budget}, {budget}, 1024)[0]]); "
        "b.step(m, collate_packed([b.make_row(16, 0, 1024)[0]])); "
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096; "
        "before, peak, done = rss(), [0], [False]\n"
        "def watch():\n"
        "    while not done[0]:\n"
        "        peak[0] = max(peak[0], rss()); time.sleep(0.001)\n"
        "t = threading.Thread(target=watch); t.start(); b.step(m, batch); done[0] = True; t.join(); "
        "print(json.dumps((max(peak[0], rss()) - before) / 2**20))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def report(results: list[dict], args, argv, seconds: float) -> str:
    load = os.getloadavg()
    lines = [
        "# CPU exact attention: masked row vs per example",
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        *smoke_banner(args.smoke),
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, torch threads {torch.get_num_threads()}, "
        f"load average at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (a shared host: compare the paths "
        "within a row, not across files). "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
        f"Model: tiny-llama (hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim 16), fp32. One packed row per "
        f"step of FLAN-like examples filled to the budget; forward + backward; median of {args.steps} steps after "
        f"{args.warmup} warm-up, the paths alternating step by step. Total {seconds:.0f} s.",
        "",
        "| budget | examples | masked s/step | per-example s/step | speed-up (medians) | speed-up (fastest steps) "
        "| masked tokens/s | per-example tokens/s | max rel. logit diff | masked peak MiB | per-example peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, b = r["seconds"], r["budget"]
        mem = r.get("peak_mib", {})
        lines.append(
            f"| {b} | {r['examples']} | {s['masked']:.4f} | {s['per_example']:.4f} | "
            f"{s['masked'] / s['per_example']:.2f}x | {r['spread']['masked'][0] / r['spread']['per_example'][0]:.2f}x | "
            f"{b / s['masked']:,.0f} | {b / s['per_example']:,.0f} | "
            f"{r['max_rel_logit_diff']:.1e} | {mem.get('masked', float('nan')):.0f} | "
            f"{mem.get('per_example', float('nan')):.0f} |"
        )
    lines += ["", "Spread (min-max s/step): " + "; ".join(
        f"{r['budget']}: masked {r['spread']['masked'][0]:.4f}-{r['spread']['masked'][1]:.4f}, per-example "
        f"{r['spread']['per_example'][0]:.4f}-{r['spread']['per_example'][1]:.4f}" for r in results)]  # fmt: skip
    if not args.memory:
        lines += ["", "Peak memory not measured (--smoke or --no-memory)."]
    lines += ["", "```json", json.dumps(results, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is what a Ray Train worker with cpus_per_worker=1 runs (Ray sets "
                        "OMP_NUM_THREADS), and on a shared host more threads mostly spin")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny and quick: budgets 64 and 128, one step, no memory")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.budgets, args.steps, args.warmup, args.memory = [64, 128], 1, 1, False
    out = results_path("attention_exact", args.smoke, args.out)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    models = {name: build(name) for name in PATHS}
    results = []
    for budget in args.budgets:
        r = time_budget(models, budget, args.steps, args.warmup)
        if args.memory:
            r["peak_mib"] = {name: peak_memory(name, budget, args.threads) for name in PATHS}
        results.append(r)
        s = r["seconds"]
        print(f"budget {budget}: masked {s['masked']:.4f} s, per-example {s['per_example']:.4f} s "
              f"({s['masked'] / s['per_example']:.2f}x), diff {r['max_rel_logit_diff']:.1e}", flush=True)  # fmt: skip
        if r["max_rel_logit_diff"] > 1e-4:
            print(f"the two paths disagree at budget {budget}", file=sys.stderr)
            return 1
    out.write_text(report(results, args, argv, time.perf_counter() - t0))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
