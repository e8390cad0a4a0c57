"""benchmarks/attention_throughput.py runs end to end (tiny model, one step, CPU)."""

from __future__ import annotations

import importlib.util

from paths import REPO


def test_benchmark_smoke(tmp_path):
    path = REPO / "benchmarks" / "attention_throughput.py"
    spec = importlib.util.spec_from_file_location("attention_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.md"
    args = ["--tiny", "--steps", "1", "--warmup", "0", "--examples-per-step", "4", "--distributions", "flan"]
    assert bench.main([*args, "--out", str(out)]) == 0
    assert "| flan | packed_varlen |" in out.read_text()
