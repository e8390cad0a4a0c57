"""No benchmark can rot: every script in benchmarks/ has a --smoke mode, and a test runs each one
end to end on the CPU, its results file included. Here the scripts that need no Ray, in this
process (their imports are paid once) and with the very arguments `make bench-smoke` gives them;
tests/ray/benchmarks/test_smoke.py runs the rest as commands, and `make bench-smoke`'s driver."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from paths import REPO

sys.path.insert(0, str(REPO / "tools"))
from bench_gpu import STEPS  # noqa: E402

NO_RAY = {  # script -> what its results file must show
    "attention_cpu.py": ["| 64 | 1 |", "| 128 | 1 |"],
    "attention_throughput.py": ["| flan | packed_varlen |", "| flan | pad |", "| flan | packed_chunked |"],
    "epoch_rows.py": ["| window | windowed shuffle (epoch 2) |", "| per_epoch | plan order |"],
    # each case refused before Ray starts: exit code 2, Ray not started
    # both hybrid families of the smoke run, measured before and after
    "hybrid_exactness.py": ["| lfm2 | Lfm2Config | short convolution |", "| nemotron_h | NemotronHConfig | Mamba-2 |"],
    # the torch path's padded slots by number of buckets on raypack's plans, and one step's CPU time
    # and slots, one padded batch against the length buckets (issue 52)
    "hybrid_padding.py": ["| bundled sample | balanced | 1024 |", "| tiny | random | 16384 |",
                          "| Qwen3.5-shaped | one of 200 among thirty of 5 | 350 | 4 buckets | 350 | 1.00 |",
                          "| Nemotron-H-shaped | one of 200 among thirty of 5 | 350 | one batch | 6,200 | 17.71 |"],
    # gpu-check's hybrid and vlm steps (issues 42, 44): exact in fp32 and bf16, a control the check
    # catches, both modes timed, and which path the mixers took (main returns 1 on a failed check)
    "hybrid_throughput.py": ["| fp32 | float32 | sdpa_varlen |", "| bf16 | bfloat16 | auto |",
                             "| noise | float32 vs bfloat16 | sdpa_varlen |",
                             "| control | float32 | sdpa_varlen |", "exceeds the bound: the check can fail",
                             "Mixer path on cpu: 1 gated delta rule layer (exact torch path",
                             "torch_chunk_gated_delta_rule -> transformers' torch reference", "| packed |", "| padded |",
                             "tokens/s packed / padded"],
    "vlm_throughput.py": ["| fp32 | float32 | sdpa_varlen |", "| bf16 | bfloat16 | auto |", "| control | float32 |",
                          "| noise | float32 vs bfloat16 |",
                          "exceeds the bound: the check can fail", "the bundled sample (raypack/assets/vision_sample)",
                          "| packed |", "| padded |", "tokens/s packed / padded"],
    "fail_fast.py": ["| unknown pack.strategy | this checkout |", "| 2 | 1 | no |", "| train.lr=inf | this checkout |"],
    "loss_memory.py": ["| activations kept | chunked |", "| gradient checkpointing | full |"],
    # both sides, both settings, and LoRA's frozen base checked bit for bit before timing and after
    "lora_throughput.py": ["| activations kept | lora |", "| gradient checkpointing | full |",
                           "before timing: 21 frozen tensors bit-identical; frozen_digest unchanged",
                           "after every timed step: 21 frozen tensors bit-identical"],
    "pack_plan.py": ["| flan | 20,000 | 2048 | balanced |", "## Balance at budget 2048", "| flan | 20,000 | 512 |"],
    "step_profile.py": ["| matmuls |", "| elementwise and norms |", "profiled steps after"],
    "recompute.py": ["| none | eager |", "| full | eager |", "| selective | compiled |"],
    # the router loss off, per example, per micro-batch (issue 43)
    "router_loss.py": ["| off |", "| example |", "| micro_batch |"],
    # one rank in-process and two spawned over gloo; raypack's own collectives on two ranks: the
    # host gather of N and tokens, the loss's all_reduce
    "step_syncs.py": ["## 1 rank", "## 2 ranks", "| collective: raypack (stepvalues.gather) | 0.0 | 1.0 |",
                      "| sync: deepspeed (timer.start) |"],
    # the synthetic image set, both models, before / after weighing the tower (issue 44)
    "tower_balance.py": ["| synthetic (2000,", "| tiny-qwen2_5_vl |", "| qwen2_5_vl-7b-shape |"],
    "vision_bytes.py": ["| bundled sample, tiny processor | 16-32 px PNG | 137 |", "| Qwen2.5-VL default | 640x480 JPEG q90 |"],
    # the loop's steps by model kind, reads told apart by what they read (issue 52): the VLM's tower reads host copies
    "loop_syncs.py": ["| text | tiny-llama | 0.0 (+", "| MoE, router loss per example | tiny-qwen3_moe |",
                      "| hybrid (Mamba-2) | tiny-nemotron_h |", "read: tolist of a host copy | raypack (mixers._segments)",
                      "read: tolist of a host copy | raypack (vision_tower.tower_attention)"],
    # collectives a step on 2 gloo ranks, each engine and stage against its minimum and bound (issue 60)
    "collectives.py": ["| torch | 0 | all-reduce | 1 | ",
                       "Every engine and stage within its bound (BOUNDS, grad_accum 2): yes", "| deepspeed | 3 |"],
    # every model kind on every engine's bf16 path, and the total that must stay 0 (issue 60)
    # (and the known open site, benchmarks/fp32_matmuls.py OPEN, named)
    "fp32_matmuls.py": ["fp32 matmuls on the hot path, neither the model's own nor a known open site, all kinds and "
                        "engine paths: 0", "Known open sites (OPEN, not fixed yet): 0 matmuls",
                        "| MoE, router loss | tiny-qwen3_moe | torch mixed | 45 | 45 | 0 | 0 |",
                        "| dense | tiny-llama | torch mixed |", "| VLM | tiny-qwen2_5_vl | deepspeed bf16 |",
                        "| hybrid (Mamba-2) | tiny-nemotron_h | torch bf16 |"],
    # a VLM micro-batch's host time on 1, 2 and 4 decode threads, and the tiny model's step beside it (issue 52)
    "vision_host.py": ["| bundled sample, tiny processor | 252 | 6 | 1 |", "| 640x480 JPEG q90, Qwen2.5-VL default processor |",
                       "| 2 |", "CPU ms", "forward and backward of the bundled sample's micro-batch"],
    # both engines at every stage gpu-check measures, one model and one batch stream (issue 51)
    "engines.py": ["| deepspeed | 1 |", "| deepspeed | 3 |", "| torch | 0 |", "| torch | 2 |", "| torch | 3 |",
                   "First-step losses agree across engines", "each engine loading one folder saved in bf16"],
    # every model x option set reached its longest smoke row
    "long_context.py": ["| 1b-full | none | 256 |", "| 8b-lora | both | 256 |", "| 1b-full | tiled | 256 |"],
}
NEEDS_RAY = {"train_throughput.py", "pack_materialize.py", "tokenize_throughput.py", "prepare_driver.py", "prepare_scale.py",
             "sweep_prepare.py", "sweep_spread.py", "peers.py", "startup.py", "startup_floor.py", "dpo.py"}
"""Run by tests/ray/benchmarks/test_smoke.py (train_throughput through `make bench-smoke`'s driver)."""


def scripts() -> set[str]:
    """Every runnable script in benchmarks/ (modules without a __main__ block are libraries)."""
    return {p.name for p in (REPO / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}


def test_every_benchmark_script_has_a_smoke_test():
    assert scripts() == set(NO_RAY) | NEEDS_RAY, "a benchmark script without a smoke test (or a stale entry here)"
    for name in scripts():
        assert "--smoke" in (REPO / "benchmarks" / name).read_text(), f"{name} has no --smoke mode"


def smoke_args(script: str) -> list[str]:
    """The arguments `make bench-smoke` passes, where it runs the script; plain --smoke otherwise."""
    step = next((s for s in STEPS if s.args and s.args[0] == f"benchmarks/{script}"), None)
    return [*step.args[1:], *step.smoke_args] if step else ["--smoke"]


def load(script: str):
    spec = importlib.util.spec_from_file_location(f"smoke_{script[:-3]}", REPO / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a smoke run pins one thread


SLOW = {
    "long_context.py": "six settings, each in a fresh process (60 s); the tiled MLP and the offloaded checkpoints "
                       "are exact in tests/unit/model/test_kernels.py; `make bench-smoke` runs it as gpu-check does",
    "recompute.py": "six settings, each in a fresh process, three compiled (59 s); each checkpointing mode is exact "
                    "in tests/unit/model/test_checkpointing.py, compiled in test_kernels.py",
}
"""Run by `pytest -m slow`, not by the default suite: seconds on the 2-core development machine, measured by
`pytest --durations`, for checks the default suite already makes another way."""


@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.slow] * (s in SLOW)) for s in sorted(NO_RAY)])
def test_smoke_run_writes_its_results_file(script, tmp_path, keep_torch_threads):
    out = tmp_path / f"{script}.md"
    assert load(script).main([*smoke_args(script), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# ") and "Command: `" in text and "smoke" in text.lower()
    for expected in NO_RAY[script]:
        assert expected in text, f"{script}: {expected!r} missing from\n{text}"


def test_engines_rows_are_configs_raypack_accepts_on_a_gpu():
    """The smoke run computes in fp32; on a GPU every row computes in bf16, where raypack refuses
    some engine and stage pairs (DeepSpeed without ZeRO): each row's config must load there too."""
    engines = load("engines.py")
    for name, stage in engines.ENGINES:
        cfg = engines.engine_config(name, stage, "cuda")
        assert (cfg.train.engine, cfg.train.zero_stage, cfg.model.dtype) == (name, stage, "bfloat16")


def test_gpu_check_budget_keeps_time_for_every_required_step():
    """`make gpu-check` (540 s, in a 10-minute device command): after a minute of wheel install, every
    step before the line can still get its min_s; the ones after it only use what is left."""
    from bench_gpu import BUDGET, PEERS

    assert all(s.min_s <= s.cap_s for s in STEPS)
    required = [s for s in STEPS if s.required]
    assert STEPS[: len(required)] == required, "a step that runs as time allows comes before a required one"
    assert [s.name for s in required[:2]] == ["gpu_tests", "peers"], "exactness first, then raypack against TRL"
    assert 60 + sum(s.min_s for s in required) <= BUDGET <= 9 * 60
    # the hybrid and vision-language checks (issues 42, 44) run in every GPU run, after the comparison and profiles
    names = [s.name for s in required]
    assert names.index("hybrid") > max(names.index(n) for n in PEERS) and "vlm" in names
    assert set(PEERS) <= {s.name for s in STEPS} and {"peers", "profile"} <= {s.name for s in required}


def test_gpu_benchmarks_refuse_the_cpu_without_smoke():
    """Outside --smoke, the GPU benchmarks and `make gpu-check` say they need a GPU (exit 2)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    for script in ("loss_memory.py", "attention_throughput.py", "lora_throughput.py", "hybrid_throughput.py", "vlm_throughput.py"):
        assert load(script).main([]) == 2
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "tools/bench_gpu.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "make bench-smoke" in proc.stderr, proc.stderr
