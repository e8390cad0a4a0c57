"""No benchmark can rot (the Ray half; tests/unit/benchmarks/test_smoke.py has the rest and checks
that every script is covered): the benchmark scripts that need Ray run their --smoke mode as
commands, and `make bench-smoke`'s driver (tools/bench_gpu.py --smoke) runs its steps, installing
wheels first as it does on the bare GPU machine. The start-up and scale benchmarks (SLOW) run with
`pytest -m slow`, as do the sweep, DPO and TRL comparisons: each starts several fresh processes (and
most their own Ray instances), 6.8 minutes of the suite for what the tests of `raypack train`,
`prepare`, Tune, DPO and the peers' configs already run."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from paths import REPO

COMMANDS = {  # script -> what its results file must show
    "pack_materialize.py": ["| routed |", "| shuffle |", "Rows identical between methods: True."],
    "tokenize_throughput.py": ["| raypack tokenize_dataset, run 1 |", "| datasets map only, run 1 |"],
    "prepare_driver.py": ["| 0.33 MiB | 300 |", "driver / Ray"],
    "prepare_scale.py": ["| 2,000 | ", " | raypack | ", " | floor | ", "| every process <= 4 GiB |", " | True |"],
    "sweep_prepare.py": ["| 1 | per trial |", "| 2 | once |", "Time saved per sweep"],
    "sweep_spread.py": ["Per strategy, median [min, max]", "Median ratio bfd / balanced"],
    # DeepSpeed init with its shm all-reduce built and skipped (warm: --smoke builds nothing); both
    # settings of train.overlap_start
    "startup.py": ["| warm |", "| worker group |", "| waiting for data |", "overlap / sequential"],
    # every side once: the libraries' imports, TRL, Ray Train alone (stock and raypack's), raypack
    "startup_floor.py": ["| `imports` |", "| `trl` | ", "| `ray-train` |", "| `ray-train-raypack` |", "| `raypack` |"],
    # TRL's SFTTrainer in both precision recipes and raypack's defaults on the tiny model (--configs below)
    "peers.py": ["| raypack | raypack train's defaults | ", "| trl | ", "| trl-mixed | ", "raypack / trl: **",
                 "2 forward(s) of a layer a micro-batch"],
    # TRL's DPOTrainer and raypack's DPO (the steps alone in one process too), and LoRA's reference
    "dpo.py": ["| trl | ", "| raypack | ", "raypack / TRL tokens/s, the steps alone", "| precomputed | ",
               "| on the fly | ", "on the fly / precomputed, a step"],
}
SLOW = {
    "startup_floor.py": "five fresh processes, three with their own Ray instance (90 s); its trl and raypack "
                        "sides are peers.py's rows, run below",
    "startup.py": "four fresh DeepSpeed inits and two `raypack train` runs with their own Ray (68 s); "
                  "train.overlap_start and the skipped shm build have their own tests",
    "prepare_scale.py": "prepare on its own Ray instance beside the pyarrow floor (43 s); prepare is tested "
                        "in tests/ray/data/test_prepare.py",
    "sweep_spread.py": "six `raypack sweep` trials (78 s); a sweep's reports reach Tune in tests/ray/tune",
    "peers.py": "TRL's SFTTrainer in two recipes and `raypack train`, each a fresh process (63 s); the rows' "
                "configs are tests/unit/benchmarks/test_peers.py's, and `make bench-smoke` runs it as gpu-check does",
    "dpo.py": "TRL's DPOTrainer and `raypack train` in fresh processes (66 s); raypack's DPO loss is TRL's in "
              "tests/unit/train/objectives/test_dpo.py, its runs on Ray in tests/ray/train/test_dpo.py; `make "
              "bench-smoke` runs it as gpu-check does",
}
"""Run by `pytest -m slow` (or RAYPACK_SLOW=1), not by the default suite: seconds on the 2-core development machine,
measured by `pytest --durations`, for checks the default suite already makes another way."""
ARGS = {"peers.py": ["--configs", "raypack", "trl", "trl-mixed", "--gradient-checkpointing"]}
"""Beyond --smoke: peers' other rows (raypack-full, raypack-bf16, trl-sdpa) run the same two children with
other settings: tests/unit/benchmarks/test_peers.py checks that raypack accepts each raypack row's config on
the CPU, and `make gpu-rehearsal` runs every row."""


def run(cmd: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.slow] * (s in SLOW)) for s in sorted(COMMANDS)])
def test_smoke_run_writes_its_results_file(script, tmp_path):
    out = tmp_path / f"{script}.md"
    run([sys.executable, f"benchmarks/{script}", "--smoke", *ARGS.get(script, []), "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# ") and "Command: `" in text and "--smoke run" in text
    assert "**failed" not in text and "**timed out" not in text and "**skipped" not in text, text
    for expected in COMMANDS[script]:
        assert expected in text, f"{script}: {expected!r} missing from\n{text}"


def dummy_wheel(folder) -> str:
    """A one-module wheel, standing in for the carried Ray/DeepSpeed wheels."""
    folder.mkdir()
    path = folder / "raypack_probe-0.1-py3-none-any.whl"
    info = "raypack_probe-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("raypack_probe.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: raypack_probe\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return str(folder)


def test_bench_smoke_driver(tmp_path):
    """The driver end to end on the CPU: wheels installed and put first on every step's path, the
    GPU tests (skipped here) and the train benchmark's smoke run, results files named
    <theme>_<device>_smoke_<date>.md, and they and the combined log copied to $OUT."""
    results, out, site = tmp_path / "results", tmp_path / "out", tmp_path / "site"
    proc = run(
        [sys.executable, "tools/bench_gpu.py", "--smoke", "--only", "gpu_tests", "train", "--install",
         "--wheels", dummy_wheel(tmp_path / "whl"), "--site", str(site), "--results-dir", str(results)],
        env={"OUT": str(out)},
    )  # fmt: skip
    log = proc.stdout
    assert "installing 1 wheels" in log and (site / "raypack_probe.py").exists()
    assert f"steps run with PYTHONPATH={site}{os.pathsep}" in log
    assert "gpu_tests ok" in log and "train ok" in log
    names = sorted(p.name for p in results.iterdir())
    assert len(names) == 2 and names[0].startswith("gpu_tests_cpu_smoke_") and names[1].startswith("train_cpu_smoke_")
    train = (results / names[1]).read_text()
    assert "| full stack (Ray Train + DeepSpeed) |" in train and "train.loss chunked" in train
    assert "| data wait / step time, full stack |" in train
    copied = sorted(p.name for p in out.iterdir())
    logs = [n for n in copied if n.startswith("gpu_check_cpu_smoke_") and n.endswith(".log")]
    assert len(logs) == 1 and sorted(set(copied) - set(logs) - {"results.tar.gz"}) == names
    with tarfile.open(out / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == names
    assert "[train] " in (out / logs[0]).read_text() and "[gpu-check] done" in (out / logs[0]).read_text()
