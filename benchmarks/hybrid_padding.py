"""What a hybrid's mixers cost on the exact torch path: the token slots they run, and the CPU time
of a forward and backward, with the examples as one padded batch (main's layout before the length
buckets) and in raypack/model/mixer_buckets.py's length buckets, side by side in one run.

    PYTHONPATH=. python benchmarks/hybrid_padding.py            # a few minutes on 2 cores
    PYTHONPATH=. python benchmarks/hybrid_padding.py --smoke    # small rows and plans: proves the script runs

1. Padded slots over real tokens (host arithmetic only, `mixer_buckets.layout`), for 1 (one padded
   batch), 2, 3, 4 (raypack's BUCKETS), 6 and 8 buckets, over every row of raypack's own plans:
   the synthetic length shapes of raypack/data/synthetic.py (10,000 examples each), the packed
   strategies `balanced` (the default) and `random`, budgets 4096 and 16384, 8 ranks; and the
   bundled sample data (raypack/assets/sample: chat, completion and instruction examples through
   raypack's encoder and the tiny tokenizer, and the tokenized parquet; 1,200 examples) at budgets
   1024 and 4096. Mean over the plan's tokens and the worst row; and the layout's host time per row.
2. One forward and backward (fp32, CPU, 2 threads) of a Qwen3.5-shaped hybrid (hidden 256, three
   gated delta rule layers and one attention layer: hybrid_throughput.py's exactness sizes) and a
   Nemotron-H-shaped one (hidden 256, Mamba-2 and attention), on two rows: the issue's, one
   example of 4000 tokens among thirty of 100, and the worst row of the `balanced` plan of the
   bimodal shape at 4096. Both layouts in turn, the best of `--repeats`, in CPU seconds of the
   process (and wall seconds). `one batch` is BUCKETS = 1:
   the same slots as main's single padded batch (its rows sorted by length). The token slots the
   mixers ran are counted at their output projections; the loss and every gradient of the two
   layouts are compared (relative, as tests/exactness.py does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.common import cpu_header, host_now, write_results  # noqa: E402

COUNTS = (1, 2, 3, 4, 6, 8)
SHAPES = ("flan", "orcamath", "wildchat", "pareto", "bimodal", "tiny")
QWEN = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
NEMOTRON = dict(hidden_size=256, intermediate_size=512)


def plan_rows(lengths, strategy: str, budget: int) -> list:
    """Every non-empty row of raypack's plan of `lengths`, as arrays of its pieces' lengths."""
    import numpy as np

    from raypack.config import PackConfig
    from raypack.data.strategies import make_plan

    plan = make_plan(lengths, PackConfig(strategy=strategy, budget=budget), 8)
    sizes = plan.end - plan.start
    order = np.argsort(plan.pack, kind="stable")
    bounds = np.searchsorted(plan.pack[order], np.arange(plan.num_packs + 1))
    return [sizes[order[a:b]] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def sample_lengths_bundled():
    """Token counts of the bundled sample's examples, through raypack's encoder and tiny tokenizer."""
    import json

    import numpy as np
    import pyarrow.parquet as pq

    from raypack.data.encode import Encoder

    folder = ROOT / "raypack" / "assets" / "sample"
    enc = Encoder(str(ROOT / "raypack" / "assets" / "tokenizer"), None, "auto", "truncate", 1 << 20)
    read = lambda name: [json.loads(line) for line in (folder / name).read_text().splitlines() if line.strip()]  # noqa: E731
    chats = enc.encode_chat(*zip(*[(json.dumps(r["messages"]), None) for r in read("chat.jsonl")]))
    pairs = enc.encode_pairs(*zip(*[(r["prompt"], r["completion"]) for r in read("completion.jsonl")]))
    rows = read("instruction.jsonl")
    prompts = [f"### Instruction:\n{r['instruction']}\n\n" + (f"### Input:\n{r['input']}\n\n" if r.get("input") else "")
               + "### Response:\n" for r in rows]  # fmt: skip
    instructions = enc.encode_pairs(prompts, [r["output"] for r in rows])
    tokenized = [len(x) for x in pq.read_table(folder / "tokenized.parquet").column("input_ids").to_pylist()]
    return np.array([len(ids) for ids, _ in [*chats, *pairs, *instructions]] + tokenized, dtype=np.int64)


def ratios(rows) -> tuple[list[str], float, float]:
    """Per bucket count, 'mean/worst' slots over tokens; and the layout's mean and 99th-percentile
    host ms a row (the worst is the shared host's scheduling, not the layout)."""
    import numpy as np

    from raypack.model.mixer_buckets import layout

    tokens = sum(int(r.sum()) for r in rows)
    cells, times = [], []
    for k in COUNTS:
        slots = []
        for r in rows:
            t0 = time.perf_counter()
            slots.append(layout(r.tolist(), k).slots)
            if k == 4:
                times.append(time.perf_counter() - t0)
        cells.append(f"{sum(slots) / tokens:.2f} / {max(s / r.sum() for s, r in zip(slots, rows)):.2f}")
    return cells, 1e3 * float(np.mean(times)), 1e3 * float(np.percentile(times, 99))


def padding_table(smoke: bool) -> list[str]:
    import numpy as np

    from raypack.data.synthetic import sample_lengths

    n = 2000 if smoke else 10_000
    lines = ["| lengths | strategy | budget | rows | examples a row | " + " | ".join(f"{k} bucket{'s' * (k > 1)}"
             for k in COUNTS) + " | layout ms a row (mean / p99) |", "|---" * (6 + len(COUNTS)) + "|"]  # fmt: skip
    cases = [(shape, strategy, budget, sample_lengths(shape, n, seed=0, max_length=budget))
             for shape in SHAPES for strategy in ("balanced", "random") for budget in (4096, 16384)]  # fmt: skip
    bundled = sample_lengths_bundled()
    cases += [("bundled sample", strategy, budget, bundled) for strategy in ("balanced", "random") for budget in (1024, 4096)]
    for shape, strategy, budget, lengths in cases:
        rows = plan_rows(lengths, strategy, budget)
        cells, mean_ms, worst_ms = ratios(rows)
        lines.append(f"| {shape} | {strategy} | {budget} | {len(rows)} | {np.mean([len(r) for r in rows]):.0f} | "
                     + " | ".join(cells) + f" | {mean_ms:.2f} / {worst_ms:.2f} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def step(model, batch, labels):
    from exactness import summed_loss

    model.zero_grad(set_to_none=True)
    loss = summed_loss(model(**batch).logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def timing_rows(smoke: bool) -> list[tuple[str, list[int]]]:
    """The rows each model is timed on: the issue's (one example of 4000 tokens among thirty of
    100), and the worst row of the default strategy's plan of the bimodal shape at 4096."""
    from raypack.data.synthetic import sample_lengths
    from raypack.model.mixer_buckets import layout

    if smoke:
        return [("one of 200 among thirty of 5", [200] + [5] * 30)]
    rows = plan_rows(sample_lengths("bimodal", 10_000, seed=0, max_length=4096), "balanced", 4096)
    worst = max(rows, key=lambda r: layout(r.tolist(), 1).slots / r.sum())
    return [("one of 4000 among thirty of 100", [100] * 15 + [4000] + [100] * 15),
            (f"bimodal balanced 4096, worst row ({len(worst)} examples)", worst.tolist())]


def timing_table(smoke: bool, repeats: int) -> list[str]:
    import torch
    from exactness import make_rows, rel_err

    from raypack.data.collate import collate_packed
    from raypack.model import mixer_buckets, mixers
    from raypack.model.build import load_model, tiny_config
    from raypack.model.traits import decoder

    torch.set_num_threads(2)
    lines = [f"| model | row | tokens | layout | mixer slots a layer | slots / tokens | CPU s (best of {repeats}) | "
             "wall s | speed-up (CPU) | loss, worst gradient vs one batch |", "|---" * 10 + "|"]  # fmt: skip
    models = [("Qwen3.5-shaped", "qwen3_5", QWEN), ("Nemotron-H-shaped", "nemotron_h", NEMOTRON)]
    for label, family, sizes in models:
        config = tiny_config(family, **({} if smoke else sizes))
        torch.manual_seed(0)
        model = load_model(config, attention="sdpa_varlen", dtype="float32").train()
        layers = len(mixers.find(decoder(model)))
        seen: list[int] = []
        for name in mixers.find(decoder(model)):
            proj = decoder(model).get_submodule(name).out_proj
            proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[:-1].numel()))
        for row_label, lengths in timing_rows(smoke):
            rows, _ = make_rows((lengths,), vocab=min(1024, config.vocab_size))
            batch = collate_packed(rows)
            labels = batch.pop("labels")
            buckets = mixer_buckets.BUCKETS
            layouts = {"one batch": 1, f"{buckets} buckets": buckets}
            times = {name: [] for name in layouts}
            results = {}
            try:
                for _ in range(repeats):  # the layouts taken in turn: a shared host's load falls on both
                    for name, k in layouts.items():
                        mixer_buckets.BUCKETS = k
                        seen.clear()
                        t0, c0 = time.perf_counter(), time.process_time()
                        out = step(model, batch, labels)
                        times[name].append((time.process_time() - c0, time.perf_counter() - t0))
                        real = sum(n for n in seen if n > 1) // layers  # the spare calls' one token aside
                        results[name] = (min(times[name]), real, out)
            finally:
                mixer_buckets.BUCKETS = buckets
            ((c1, _), _, (l1, g1)), (_, _, (l4, g4)) = results.values()
            diff = f"{rel_err(l4, l1):.1e}, {max(rel_err(g4[n], g1[n]) for n in g1):.1e}"
            for name, ((c, w), s, _) in results.items():
                lines.append(f"| {label} | {row_label} | {sum(lengths)} | {name} | {s:,} | {s / sum(lengths):.2f} | "
                             f"{c:.2f} | {w:.2f} | {c1 / c:.1f}x | {diff if name != 'one batch' else ''} |")  # fmt: skip
                print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small rows and plans; results in the temp folder")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps a layout, taken in turn (default 3; smoke 1)")
    parser.add_argument("--out", help="results file (default: benchmarks/results/hybrid_padding_cpu_<date>.md)")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    started = host_now()
    t0 = time.perf_counter()
    padding = padding_table(args.smoke)
    t1 = time.perf_counter()
    timing = timing_table(args.smoke, args.repeats or (1 if args.smoke else 3))
    lines = [
        *cpu_header("Hybrid mixers on the exact torch path: one padded batch against length buckets",
                    "hybrid_padding.py", argv, args.smoke, started, modules=("numpy", "torch", "transformers")),
        "",
        "## Padded slots over real tokens, by number of buckets", "",
        "Every row of raypack's plan (8 ranks): mean over the plan (all slots / all tokens) / worst row. 1 bucket "
        "is one padded batch (examples x longest); raypack runs 4 (`mixer_buckets.BUCKETS`). The layout's host time "
        f"is for 4 buckets (sort, cuts, index; numpy). {t1 - t0:.0f} s.", "",
        *padding, "",
        "## One forward and backward, CPU", "",
        "fp32, 2 threads, train mode, no optimizer; CPU seconds of this process (both threads; less swayed by the "
        "shared host's load than wall time), the best step of each layout, the layouts taken in turn. "
        "`mixer slots a layer`: batch x length the mixers' output "
        "projections received per layer (the scans also pad each row to whole chunks: 64 tokens for the gated delta "
        "rule, the config's chunk_size for Mamba-2). The last column: the 4-bucket run against the one-batch run, "
        f"relative (both exact against each example alone: tests/unit/model/test_mixers.py). "
        f"{time.perf_counter() - t1:.0f} s.", "",
        *timing, "",
    ]
    write_results("hybrid_padding", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
