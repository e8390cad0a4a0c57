"""How fast, and how cleanly, `raypack train` refuses bad input: wall time, exit code, lines on
stderr, and whether Ray was started, per class of bad input; for this checkout and, side by side
in the same run, a baseline checkout (e.g. the main branch before the pre-Ray checks).

    python benchmarks/fail_fast.py --baseline /path/to/other/checkout [--repeat 1]
    python benchmarks/fail_fast.py --smoke   # this checkout, the two cases that need no data read

Each case is a fresh process (`python -m raypack.cli train --config jobs/configs/tiny_cpu.yaml
... <overrides>`) with the checkout on PYTHONPATH, a temporary storage path, no RAY_ADDRESS (a
local Ray instance when one is started) and HF_HUB_OFFLINE=1 (no network here; online, an unknown
hub name adds ~30 s of hub retries per attempt). Writes benchmarks/results/fail_fast_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import cpu_header, host_now, results_path  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its worker prefixes
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


SMOKE_CASES = ("unknown pack.strategy", "train.lr=inf")
"""--smoke: config errors, refused before any data is read (a few seconds each)."""


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    bad = tmp / "bad_row.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n{oops\n")
    return [
        ("missing data path", [f"data.paths=[{tmp / 'typo.jsonl'}]"]),
        ("malformed JSON row", [f"data.paths=[{bad}]"]),
        ("unknown pack.strategy", ["pack.strategy=bogus"]),
        ("train.lr=inf", ["train.lr=inf"]),
        ("unknown model (tiny-nope)", ["model.name=tiny-nope"]),
    ]


def run_case(checkout: Path, overrides: list[str], storage: Path, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(checkout / ".cache" / "torch_extensions"))}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "raypack.cli", "train", "--config", str(checkout / "jobs" / "configs" / "tiny_cpu.yaml"),
           f"run.storage_path={storage}", "run.name=bench", *overrides]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    seconds = time.perf_counter() - t0
    screen = stdout + stderr
    lines = [ANSI.sub("", line) for line in stderr.splitlines() if line.strip()]
    return {
        "seconds": seconds,
        "exit": code,
        "stderr_lines": len(lines),
        "ray_started": "yes" if "local Ray instance" in screen else "tried: timed out" if "timed out during startup" in screen else "no",
        "last": (lines[-1] if lines else "")[:160].replace("|", "/"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="another raypack checkout to run side by side")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--smoke", action="store_true", help="this checkout only, the config-error cases; results file in the temp folder")
    p.add_argument("--out", help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)
    if args.smoke:
        args.baseline = None
    started = host_now()
    out = results_path("fail_fast", smoke=args.smoke, out=args.out)
    checkouts = [("this checkout", REPO)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="raypack_fail_fast_") as tmp:
        for name, overrides in cases(Path(tmp)):
            if args.smoke and name not in SMOKE_CASES:
                continue
            for label, checkout in checkouts:
                for i in range(args.repeat):
                    r = run_case(checkout, overrides, Path(tmp) / f"runs-{label[:4]}-{i}", args.timeout)
                    rows.append({"case": name, "checkout": label, **r})
                    print(f"{name:<28} {label:<14} {r['seconds']:7.1f} s  exit {r['exit']}  stderr {r['stderr_lines']:4d} lines  "
                          f"ray {r['ray_started']}  {r['last'][:70]}", flush=True)
    lines = [
        *cpu_header("`raypack train` on bad input: time to the error, exit code, stderr lines, Ray started", __file__,
                    argv, args.smoke, started, ("ray", "torch", "transformers"),
                    notes=f"Compare within a case, not across runs. Baseline: {args.baseline or 'none'}."),
        "",
        "| case | checkout | seconds | exit code | stderr lines | Ray started | last stderr line |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['case']} | {r['checkout']} | {r['seconds']:.1f} | {r['exit']} | {r['stderr_lines']} | "
              f"{r['ray_started']} | `{r['last']}` |" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
