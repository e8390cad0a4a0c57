"""Planning speed, packing efficiency and rank balance: raypack's strategies against TRL's bfd and
an FFD reference, and `balanced`'s wall-time overhead over many ranks.

    python benchmarks/pack_plan.py                       # full grid: 1M and 10M x flan/orcamath/wildchat x 2048/4096/8192
    python benchmarks/pack_plan.py --quick               # 1M, budget 4096 only
    python benchmarks/pack_plan.py --sizes 1000000 --budgets 4096 --kinds flan --out /tmp/x.md
    python benchmarks/pack_plan.py --balance --out benchmarks/results/pack_plan_balance_cpu_<date>.md
    python benchmarks/pack_plan.py --smoke               # 20k FLAN-like lengths, one budget, both modes: proves the script runs

Strategy mode. For every (kind, size, budget) the same lengths go to:

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

Balance mode (--balance). For every length shape of raypack/data/synthetic.py (flan, orcamath,
wildchat and the held-out pareto, bimodal, tiny), every size and 8, 64 and 512 ranks at one
budget: `balanced`, `bfd`, and `balanced` as it was before this layout (`legacy_balanced`: packs
sorted by 256 fill buckets then attention, remainder split in halves), all on the same lengths.
For each: the wall-time overhead of imbalance, Σ_steps busiest rank / Σ_steps mean rank, for
tokens and attention (Σ len²), the worst single step, efficiency, and `make_plan`'s wall and CPU
seconds. `floor` is a lower bound on the attention overhead that no layout of whole examples can
beat (see `attention_floor`): where it is far above 1, the longest examples are too few for the
ranks, and no plan can balance them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from raypack.config import PackConfig  # noqa: E402
from raypack.data.plan import even_out, place  # noqa: E402
from raypack.data.strategies import STRATEGIES, get_strategy, make_plan  # noqa: E402
from raypack.data.synthetic import KINDS, sample_lengths  # noqa: E402

RANKS = 8
BALANCE_RANKS = (8, 64, 512)


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


def attention_floor(lengths: np.ndarray, ranks: int, budget: int) -> float:
    """A lower bound on Σ_steps max / Σ_steps mean attention for any plan of whole examples in
    packs of at most `budget` tokens (not `pad`'s minibatches, which are not bounded by it).

    Order the steps by their longest example. An example longer than budget/2 shares its pack
    with no other such example, so steps 1..k hold at most k*ranks of them and step k's longest
    is at least L[(k-1)*ranks] (lengths sorted longest first): its busiest pack costs at least
    that squared. A pack whose longest example is l costs at most g(l) = l² + (budget-l)² (l >=
    budget/2) or l*budget, increasing in l, so the k*ranks packs of steps 1..k cost at most the
    sum of g over the k*ranks longest examples. The excess of those steps over their mean is at
    least the difference; the other steps' is at least 0."""
    desc = np.sort(np.asarray(lengths))[::-1].astype(np.float64)
    total = float((desc**2).sum())
    leaders = desc[desc > budget / 2][::ranks]
    if len(leaders) == 0 or total == 0:
        return 1.0
    k = np.arange(1, len(leaders) + 1)
    g = np.where(desc >= budget / 2, desc**2 + (budget - desc) ** 2, desc * budget)
    can_carry = np.concatenate(([0.0], np.cumsum(g)))[np.minimum(k * ranks, len(desc))]
    return 1.0 + max(0.0, float((ranks * np.cumsum(leaders**2) - can_carry).max())) / total


def legacy_balanced(lengths: np.ndarray, budget: int, ranks: int):
    """`balanced` before the current layout, for comparison: even_out's halves for the remainder,
    packs sorted by 256 fill buckets, then attention (snaking), consecutive ranks per step."""
    packing = even_out(get_strategy("bfd", budget=budget).pack(lengths), ranks)
    size = (packing.end - packing.start).astype(np.float64)
    tokens = np.bincount(packing.pack, weights=size, minlength=packing.num_packs)
    attention = np.bincount(packing.pack, weights=size * size, minlength=packing.num_packs)
    bucket = np.floor(tokens * 256 / budget)
    ranked = np.lexsort((np.where(bucket % 2 == 0, attention, -attention), bucket))
    cell = np.empty(packing.num_packs, dtype=np.int64)
    cell[ranked] = np.arange(packing.num_packs)
    return place(packing, cell, ranks, strategy="legacy_balanced", budget=budget, padded=False, reset_positions=True)


def balance_grid(kinds, sizes, budget: int, ranks_list) -> list[dict]:
    rows = []
    for n in sizes:
        for kind in kinds:
            lengths = sample_lengths(kind, n, seed=3, max_length=budget)
            for ranks in ranks_list:
                floor = attention_floor(lengths, ranks, budget)
                for method in ("balanced", "bfd", "legacy_balanced"):
                    wall, cpu = time.perf_counter(), time.process_time()
                    if method == "legacy_balanced":
                        plan = legacy_balanced(lengths, budget, ranks)
                    else:
                        plan = make_plan(lengths, PackConfig(strategy=method, budget=budget), ranks)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    s = plan.stats()
                    row = dict(kind=kind, n=n, ranks=ranks, method=method, steps=s["steps"], eff=s["efficiency"],
                               tok=s["token_imbalance"], att=s["attention_imbalance"], tok_w=s["token_imbalance_worst"],
                               att_w=s["attention_imbalance_worst"], floor=floor, wall=wall, cpu=cpu)
                    rows.append(row)
                    print(_fmt_balance(row), flush=True)
    return rows


BALANCE_HEADER = ("| lengths | n | ranks | method | steps | efficiency | tokens overhead | attention overhead | worst step "
                  "tok / attn | attention floor | wall s | cpu s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _fmt_balance(r: dict) -> str:
    return (f"| {r['kind']} | {r['n']:,} | {r['ranks']} | {r['method']} | {r['steps']:,} | {r['eff']:.5f} | "
            f"{r['tok']:.4f} | {r['att']:.4f} | {r['tok_w']:.2f} / {r['att_w']:.2f} | {r['floor']:.4f} | "
            f"{r['wall']:.2f} | {r['cpu']:.2f} |")


def balance_summary(rows: list[dict], tok_target: float = 1.005, att_target: float = 1.02) -> list[str]:
    """Per cell: does balanced meet the targets, at bfd's efficiency, within 10 s?"""
    out = ["| lengths | n | ranks | steps | balanced tokens | balanced attention | floor | legacy attention | "
           "bfd attention | efficiency = bfd | targets met | cpu s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["kind"], r["n"], r["ranks"]), {})[r["method"]] = r
    for (kind, n, ranks), m in cells.items():
        b = m["balanced"]
        met = b["tok"] <= tok_target and b["att"] <= att_target
        out.append(f"| {kind} | {n:,} | {ranks} | {b['steps']:,} | {b['tok']:.4f} | {b['att']:.4f} | {b['floor']:.4f} | "
                   f"{m['legacy_balanced']['att']:.4f} | {m['bfd']['att']:.4f} | "
                   f"{'yes' if b['eff'] >= m['bfd']['eff'] else 'NO'} | {'yes' if met else 'no'} | {b['cpu']:.2f} |")
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1M examples at budget 4096 only")
    p.add_argument("--balance", action="store_true", help="balance mode: overhead at 8/64/512 ranks (see above)")
    p.add_argument("--smoke", action="store_true", help="20k FLAN-like lengths, budget 2048, both modes: proves the script runs")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="default: 1M and 10M")
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--kinds", nargs="+", default=None, help="default: flan orcamath wildchat (balance mode: all)")
    p.add_argument("--ranks", type=int, nargs="+", default=list(BALANCE_RANKS), help="balance mode ranks")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--trl-max", type=int, default=1_000_000, help="largest size TRL runs at")
    p.add_argument("--ref-max", type=int, default=1_000_000, help="largest size the FFD reference runs at")
    p.add_argument("--out", default=None, help="markdown results file (default: print only)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.budgets = [1_000_000], [4096]
    if args.smoke:
        args.sizes, args.budgets, args.kinds, args.ref_max = [20_000], [2048], ["flan"], 20_000
    sizes = args.sizes or [1_000_000, 10_000_000]
    try:
        import trl
    except ImportError:
        trl = None
        print("TRL is not installed (pip install -e '.[bench]'): its rows are left out", file=sys.stderr)

    started = host_now()
    t0 = time.perf_counter()
    sections: list[str] = []
    if args.balance or args.smoke:
        budget = args.budgets[0] if args.smoke else (4096 if args.budgets == [2048, 4096, 8192] else args.budgets[0])
        print(BALANCE_HEADER)
        rows = balance_grid(args.kinds or list(KINDS), sizes, budget, args.ranks)
        sections += [f"## Balance at budget {budget}", "", "Targets: tokens <= 1.005, attention <= 1.02, "
                     "efficiency no lower than bfd's, <= 10 s per plan on one core.", "",
                     *balance_summary(rows), "", "All rows:", "", BALANCE_HEADER, *[_fmt_balance(r) for r in rows], ""]
    if not args.balance or args.smoke:
        print(HEADER)
        rows = run(args.kinds or ["flan", "orcamath", "wildchat"], sizes, args.budgets, args.strategies,
                   args.trl_max, args.ref_max, trl=trl is not None)
        sections += ["## Strategies", "", HEADER, *[_fmt(r) for r in rows], ""]
    wall = time.perf_counter() - t0
    if args.out or args.smoke:
        lines = [
            *cpu_header("Packing plan benchmark (CPU)", __file__, argv, args.smoke, started, ("numpy", "pyarrow", "trl"),
                        notes=f"cpu s is this process's CPU time; every method runs on one core. Total wall {wall:.0f} s."),
            "",
            *sections,
        ]
        out = results_path("pack_plan", args.smoke, args.out)
        out.write_text("\n".join(lines))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
