"""Planning speed and packing efficiency: raypack's strategies against TRL's bfd and an FFD reference.

    python benchmarks/pack_plan.py                       # full grid: 1M and 10M x flan/orcamath/wildchat x 2048/4096/8192
    python benchmarks/pack_plan.py --quick               # 1M, budget 4096 only
    python benchmarks/pack_plan.py --sizes 1000000 --budgets 4096 --kinds flan --out /tmp/x.md
    python benchmarks/pack_plan.py --smoke               # 20k lengths, one budget: proves the script runs

For every (kind, size, budget) the same lengths go to:

- each raypack strategy, through `make_plan` with 8 ranks (so the time includes the remainder
  handling and the (step, rank) layout, not just the bin packing);
- TRL's `pack_dataset(..., strategy="bfd")` on a `datasets.Dataset` whose `input_ids` list column
  has those lengths (int8 zeros, to keep memory down). Twice: with the datasets default map batch
  of 1000 rows (what TRL users get: packing within each batch of 1000) and with the whole dataset
  as one batch (a global BFD, the like-for-like comparison). Only up to `--trl-max` examples, and
  only where TRL is installed (`pip install -e '.[bench]'`; a run without it says so);
- `ffd_reference`: a straightforward first-fit-decreasing (a max segment tree over bins, one
  Python step per example), the algorithm Axolotl's multipack sampler implements (with numba
  there). Only up to `--ref-max` examples.

Fill efficiency is real tokens / (budget x packs) for every method (for pad / pad_sorted this is
not their padding efficiency, which `raypack plan` reports); `lb` is packs / ceil(total / budget).
raypack's packs are rounded up to a multiple of 8 ranks (see plan.py); for bfd and greedy the
table also shows the bin count before that rounding, the number to compare with TRL and FFD.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import results_path  # noqa: E402
from raypack.config import PackConfig  # noqa: E402
from raypack.data.strategies import STRATEGIES, get_strategy, make_plan  # noqa: E402
from raypack.data.synthetic import sample_lengths  # noqa: E402

RANKS = 8


def ffd_reference(lengths: np.ndarray, budget: int) -> int:
    """First-fit decreasing, one example at a time: leftmost bin with room, via a max segment tree."""
    size = 1
    while size < len(lengths):
        size *= 2
    tree = [0] * (2 * size)  # remaining capacity; unopened bins hold 0 until opened
    n_bins = 0
    for length in sorted(lengths.tolist(), reverse=True):
        if tree[1] >= length:
            i = 1
            while i < size:  # descend to the leftmost leaf with room
                i = 2 * i if tree[2 * i] >= length else 2 * i + 1
        else:
            i = size + n_bins
            n_bins += 1
            tree[i] = budget
        tree[i] -= length
        i //= 2
        while i:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i //= 2
    return n_bins


def trl_bfd(lengths: np.ndarray, budget: int, batch_size: int | None) -> tuple[int, float]:
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    column = pa.LargeListArray.from_arrays(offsets, pa.array(np.zeros(int(offsets[-1]), np.int8)))
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    packed = pack_dataset(ds, budget, strategy="bfd", map_kwargs={"batch_size": batch_size, "keep_in_memory": True})
    seconds = time.perf_counter() - t0
    return len(packed), seconds


def run(kinds, sizes, budgets, strategies, trl_max, ref_max, trl: bool = True) -> list[dict]:
    rows = []
    for n in sizes:
        for kind in kinds:
            for budget in budgets:
                lengths = sample_lengths(kind, n, seed=0, max_length=budget)
                total = int(lengths.sum())
                bound = -(-total // budget)

                def add(method, packs, seconds, **extra):
                    row = dict(kind=kind, n=n, budget=budget, method=method, packs=packs, seconds=seconds,
                               efficiency=total / (budget * packs), lb=packs / bound, **extra)
                    rows.append(row)
                    print(_fmt(row), flush=True)

                for name in strategies:
                    plan = make_plan(lengths, PackConfig(strategy=name, budget=budget, seed=0), RANKS)
                    s = plan.stats()
                    # packs before rounding up to a multiple of the ranks, to compare with TRL / FFD
                    bins = get_strategy(name, budget=budget).pack(lengths).num_packs if name in ("bfd", "greedy") else None
                    add(name, plan.num_packs, plan.seconds, tok=s["token_imbalance"], att=s["attention_imbalance"],
                        bins=bins)
                if trl and n <= trl_max:
                    for label, bs in (("trl_bfd(batch=1000)", 1000), ("trl_bfd(global)", None)):
                        packs, seconds = trl_bfd(lengths, budget, bs)
                        add(label, packs, seconds)
                if n <= ref_max:
                    t0 = time.perf_counter()
                    packs = ffd_reference(lengths, budget)
                    add("ffd_reference", packs, time.perf_counter() - t0)
    return rows


def _fmt(r: dict) -> str:
    extra = f" | {r['tok']:.4f} | {r['att']:.4f}" if "tok" in r else " | | "
    bins = f"{r['bins']:,}" if r.get("bins") else ""
    return (f"| {r['kind']} | {r['n']:,} | {r['budget']} | {r['method']} | {r['packs']:,} | {bins} | {r['lb']:.5f} | "
            f"{r['efficiency']:.4f} | {r['seconds']:.2f}{extra} |")


HEADER = ("| lengths | n | budget | method | packs | bins before rank rounding | packs / lower bound | fill efficiency "
          "| seconds | token imb. | attn imb. |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1M examples at budget 4096 only")
    p.add_argument("--smoke", action="store_true", help="20k FLAN-like lengths, budget 2048: proves the script runs")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--kinds", nargs="+", default=["flan", "orcamath", "wildchat"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--trl-max", type=int, default=1_000_000, help="largest size TRL runs at")
    p.add_argument("--ref-max", type=int, default=1_000_000, help="largest size the FFD reference runs at")
    p.add_argument("--out", default=None, help="markdown results file (default: print only)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.budgets = [1_000_000], [4096]
    if args.smoke:
        args.sizes, args.budgets, args.kinds, args.ref_max = [20_000], [2048], ["flan"], 20_000
    import pyarrow

    try:
        import trl
    except ImportError:
        trl = None
        print("TRL is not installed (pip install -e '.[bench]'): its rows are left out", file=sys.stderr)

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    print(HEADER)
    t0 = time.perf_counter()
    rows = run(args.kinds, args.sizes, args.budgets, args.strategies, args.trl_max, args.ref_max, trl=trl is not None)
    wall = time.perf_counter() - t0
    if args.out or args.smoke:
        lines = [
            "# Packing plan benchmark (CPU)",
            "",
            f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:] if argv is None else argv)}`",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
            f"started {started}; load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}, "
            f"at end {os.getloadavg()[0]:.1f} (the machine is shared with other engineers' jobs: "
            "times are upper bounds). Every method runs on one core.",
            "",
            *(["**--smoke run: few lengths, to prove the script works; these numbers are not results.**", ""]
              if args.smoke else []),
            f"Versions: python {platform.python_version()}, numpy {np.__version__}, pyarrow {pyarrow.__version__}, "
            f"trl {trl.__version__ if trl else 'not installed (its rows are left out)'}. Total wall {wall:.0f} s.",
            "",
            HEADER,
            *[_fmt(r) for r in rows],
            "",
        ]
        out = results_path("pack_plan", args.smoke, args.out)
        out.write_text("\n".join(lines))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
