"""Data preparation of a 4-strategy sweep: tokenize once and pack per strategy (raypack now)
against tokenize and pack per trial (raypack before: the packed-data fingerprint covered pack.*).

    python benchmarks/sweep_prepare.py -n 20000     # writes benchmarks/results/sweep_prepare_cpu_<date>.md

Both sides prepare the same four pack configs (pad, flatten, bfd, balanced; budget 512, 1 rank)
from the same synthetic chat JSONL with the same code (raypack.data.prepare.prepare):

- per trial: each config prepared with no cache, as every trial of a sweep did before (tokenize,
  split, plan, pack, for each strategy);
- once: `raypack.tune.data.prepare_sweep_data`, what `raypack sweep` runs on its driver now
  (tokenize once into the cache, then split, plan and pack each strategy from it).

The sides alternate (per trial, once, once, per trial) in one Ray instance, so that load from
other jobs on a shared host falls on both. Ray start-up is not counted; tokenizer actor start-up
is (every tokenization pays it). The training itself is the same on both sides and not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402
from benchmarks.tokenize_throughput import cpu_model  # noqa: E402
from raypack.config import ASSETS, Config, DataConfig, PackConfig, TokenizeConfig, TrainConfig, TuneConfig  # noqa: E402
from raypack.data.synthetic import make_examples  # noqa: E402

STRATEGIES = ("pad", "flatten", "bfd", "balanced")


def per_trial(base: Config, root: str) -> float:
    from raypack.data.listing import Sources
    from raypack.data.prepare import prepare

    t0 = time.perf_counter()
    for s in STRATEGIES:
        cfg = dataclasses.replace(base, pack=dataclasses.replace(base.pack, strategy=s))
        prepare(cfg, base.train.num_workers, f"{root}/{s}/packed", Sources.of(cfg.data.paths))
    return time.perf_counter() - t0


def once(base: Config, cache: str) -> tuple[float, dict]:
    from raypack.data.listing import Sources
    from raypack.tune.data import prepare_sweep_data

    t0 = time.perf_counter()
    data = prepare_sweep_data(base, Sources.of(base.data.paths), cache)
    return time.perf_counter() - t0, data.to_dict()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--kind", default="flan", help="length distribution of the synthetic chats")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="a --smoke run: 300 examples, to check the script works")
    args = ap.parse_args(argv)
    started = host_now()
    if args.smoke:
        args.n = 300
    out_path = results_path("sweep_prepare", args.smoke, args.out)

    import ray

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chat.jsonl")
        with open(path, "w") as f:
            for rec in make_examples("chat", args.n, seed=0, kind=args.kind, max_length=args.budget):
                f.write(json.dumps(rec) + "\n")
        base = Config(
            data=DataConfig(paths=(path,), eval_fraction=0.05),
            tokenize=TokenizeConfig(tokenizer=str(ASSETS / "tokenizer"), overlength="truncate"),
            pack=PackConfig(budget=args.budget, batch_size=4),
            train=TrainConfig(num_workers=1, grad_accum=1),
            tune=TuneConfig(strategies=STRATEGIES),
        )
        ray.init(address="local", num_cpus=max(4, 2 * (os.cpu_count() or 2)), include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        for i, side in enumerate(("per trial", "once", "once", "per trial")):
            if side == "per trial":
                runs.append((side, per_trial(base, f"{tmp}/before{i}"), None))
            else:
                seconds, info = once(base, f"{tmp}/after{i}/cache")
                runs.append((side, seconds, info))
            print(f"{side}: {runs[-1][1]:.1f} s", flush=True)
        ray.shutdown()

    before = [s for side, s, _ in runs if side == "per trial"]
    after = [(s, info) for side, s, info in runs if side == "once"]
    info = after[0][1]
    lines = [
        *cpu_header(f"Sweep data preparation, 4 strategies, CPU, {datetime.date.today().isoformat()}", __file__, argv,
                    args.smoke, started, ("ray",), notes=f"CPU: {cpu_model()}. Compare within this run only."),
        f"Data: {info['examples']} synthetic chats (`{args.kind}` lengths, at most {args.budget} words), bundled "
        f"tokenizer, budget {args.budget}, 1 rank, strategies {', '.join(STRATEGIES)}.",
        "",
        "| run | side | seconds | tokenizations |",
        "|---|---|---|---|",
    ]
    for i, (side, seconds, inf) in enumerate(runs):
        lines.append(f"| {i + 1} | {side} | {seconds:.1f} | {inf['tokenizations'] if inf else len(STRATEGIES)} |")
    lines += [
        "",
        f"Tokenize once: tokenizing took {after[0][1]['tokenize_s']:.1f} s / {after[1][1]['tokenize_s']:.1f} s and "
        f"packing the four configs {after[0][1]['pack_s']:.1f} s / {after[1][1]['pack_s']:.1f} s in the two runs.",
        f"Time saved per sweep: best per-trial {min(before):.1f} s against best once {min(s for s, _ in after):.1f} s: "
        f"**{min(before) - min(s for s, _ in after):.1f} s ({min(before) / min(s for s, _ in after):.2f}x less time)**.",
        "",
        "Each trial also used to pay this inside its own wall time; now the driver pays it once before the first trial.",
    ]
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
