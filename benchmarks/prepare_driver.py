"""Data preparation in the driver's process against Ray's stages, at the sizes `data.driver_max_mb` covers.

    PYTHONPATH=. python benchmarks/prepare_driver.py [--mb 0.33 4 16] [--rounds 3] [--out FILE]
    PYTHONPATH=. python benchmarks/prepare_driver.py --smoke      # the bundled sample, one round

Each size is the bundled chat sample (`raypack/assets/sample/chat.jsonl`, 300 chats, 0.33 MiB),
repeated into one JSONL file of about `--mb` MiB. For each, `raypack.data.prepare.prepare` as the
quickstart runs it (its config, 2 ranks, the eval split held out), with `data.driver_max_mb`
0 (Ray Data's read tasks and tokenizer actor, Ray's pack tasks) and 16 (the same code in this
process), in one local Ray instance started before any is timed, alternating which goes first.
Reported: each side's median seconds, and each round's ratio. Ray's side pays its actors' and
tasks' start as every run does; in later rounds some of its task workers are already up, so
its times there are, if anything, low. Both sides write the same rows
(tests/ray/data/test_prepare.py checks that); here only the time is measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, cpu_header, host_now, write_results  # noqa: E402

SAMPLE = REPO / "raypack" / "assets" / "sample" / "chat.jsonl"
SIDES = {"ray": 0, "driver": 16}


def source(work: Path, mb: float) -> Path:
    """The sample repeated to about `mb` MiB (at least once)."""
    text = SAMPLE.read_text()
    path = work / f"chat_{mb:g}mb.jsonl"
    path.write_text(text * max(1, round(mb * 2**20 / len(text))))
    return path


def timed(path: Path, limit: float, work: Path) -> float:
    from raypack.config import load
    from raypack.data.listing import Sources
    from raypack.data.prepare import prepare
    from raypack.runs import absolute_paths

    cfg = absolute_paths(load(str(REPO / "jobs" / "configs" / "quickstart.yaml"),
                              [f"data.paths=[{path}]", f"data.driver_max_mb={limit}", f"run.storage_path={work}"]))
    root = tempfile.mkdtemp(dir=work)
    t0 = time.perf_counter()
    prepare(cfg, cfg.train.num_workers, root, Sources.of(cfg.data.paths))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[0.33, 4, 16], help="source sizes, MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="the bundled sample once, one round: proves the script runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.mb, args.rounds = [0.33], 1
    started = host_now()
    from raypack.runtime import init_ray

    init_ray()
    lines = ["| source | examples | Ray's stages (median s) | in the driver (median s) | driver / Ray | rounds |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mb in args.mb:
            path = source(work, mb)
            times = {side: [] for side in SIDES}
            for r in range(args.rounds):
                for side in (SIDES if r % 2 == 0 else reversed(SIDES)):
                    times[side].append(timed(path, SIDES[side], work))
                    print(f"{mb:g} MiB, round {r + 1}, {side}: {times[side][-1]:.1f} s", flush=True)
            ratios = [d / r for d, r in zip(times["driver"], times["ray"])]
            rows = sum(1 for _ in path.open())
            lines.append(f"| {path.stat().st_size / 2**20:.2f} MiB | {rows:,} | {statistics.median(times['ray']):.1f} | "
                         f"{statistics.median(times['driver']):.1f} | **{statistics.median(ratios):.2f}x** | "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} |")
    header = cpu_header("Data preparation in the driver against Ray's stages (data.driver_max_mb)", __file__, argv,
                        args.smoke, started, ("ray", "transformers"))  # fmt: skip
    write_results("prepare_driver", args.smoke, args.out, [*header, "", *lines])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
