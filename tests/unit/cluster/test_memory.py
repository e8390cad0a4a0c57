"""The memory, disk and interconnect tables in cluster/README.md are what cluster/memory.py
computes from the shipped configs, and the shipped configs and manifests fit within them.
(The per-GPU arithmetic itself is tested in tests/unit/train/memory/test_estimate.py.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("cluster_memory", REPO / "cluster" / "memory.py")
memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = memory  # dataclasses look their module up there
_spec.loader.exec_module(memory)

GiB = 2**30
OVERHEAD_GB = memory.OVERHEAD_GB  # CUDA context, NCCL buffers, fragmentation: not in the totals


def quantity(q: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Gi|Ti)", q).groups()
    return int(number) * {"Gi": GiB, "Ti": 2**40}[unit]


def test_readme_tables_are_the_scripts_output():
    readme = (REPO / "cluster" / "README.md").read_text()
    assert memory.markdown() in readme, "regenerate with: python cluster/memory.py"
    assert memory.fits_markdown() in readme, "regenerate with: python cluster/memory.py (its last table)"


def test_archs_are_what_transformers_configs_give():
    from transformers import LlamaConfig, Qwen2Config

    llama = dict(num_key_value_heads=8, vocab_size=128256)
    built = {
        "meta-llama/Llama-3.1-8B": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                               num_attention_heads=32, **llama),
        "meta-llama/Llama-3.1-70B": LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                num_attention_heads=64, **llama),
        "Qwen/Qwen2.5-7B": Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    }  # fmt: skip
    assert {name: memory.Arch.from_config(c) for name, c in built.items()} == memory.ARCHS


def test_what_fits_on_one_gpu():
    rows = memory.fits_rows()
    fits = {(r.cfg.model.name.split("-")[-1], r.cfg.model.peft.method, r.cfg.model.gradient_checkpointing): budget
            for r, budget in rows}
    assert len(fits) == 12
    # full fine-tuning holds 16 B/param of state: 8B (129 GB) and 70B fit on no single GPU
    assert all(budget == 0 for (_, method, _), budget in fits.items() if method == "none")
    for size in ("8B", "70B"):
        for method in ("lora", "qlora"):
            assert fits[size, method, "full"] >= fits[size, method, "none"]  # checkpointing frees activations
        assert fits[size, "qlora", "full"] >= fits[size, "lora", "full"]  # 4-bit weights free memory
    assert fits["70B", "lora", "full"] == 0 < fits["70B", "qlora", "full"]  # 141 GB of bf16 weights
    capacity = (memory.HBM_GB - OVERHEAD_GB) * memory.GB
    for row, budget in rows:  # the largest: 1,024 tokens more would not fit
        if budget:
            assert memory.estimate(row.cfg, row.arch, tokens=budget, zero=row.zero).total <= capacity
            assert memory.estimate(row.cfg, row.arch, tokens=budget + 1024, zero=row.zero).total > capacity


def test_the_shipped_lora_config_is_within_what_fits():
    (lora,) = [r for r in memory.rows() if r.name == "llama8b_lora_1gpu.yaml"]
    (budget,) = [b for r, b in memory.fits_rows() if r.cfg.model.name == lora.cfg.model.name
                 and r.cfg.model.peft.method == "lora" and r.cfg.model.gradient_checkpointing == "full"]
    assert lora.cfg.pack.budget <= budget and lora.cfg.train.num_workers == 1


def test_every_shipped_gpu_config_is_in_the_table():
    from raypack.config import load

    shipped = {str(p.relative_to(REPO / "jobs" / "configs")) for p in (REPO / "jobs" / "configs").rglob("*.yaml")
               if load(p).train.use_gpu}
    assert shipped == set(memory.CONFIGS)


@pytest.mark.parametrize(("name", "published"), [("meta-llama/Llama-3.1-8B", 8.03e9),
                                                 ("meta-llama/Llama-3.1-70B", 70.6e9),
                                                 ("Qwen/Qwen2.5-7B", 7.62e9)])
def test_parameter_counts_match_the_published_sizes(name, published):
    assert abs(memory.ARCHS[name].params / published - 1) < 0.01


@pytest.mark.parametrize("row", memory.rows(), ids=lambda r: r.name)
def test_every_config_fits_an_h100(row):
    assert row.total() / memory.GB + OVERHEAD_GB <= memory.HBM_GB, row.name
    assert row.host_per_node() < 0.5 * 2000 * memory.GB  # p5 / a3 hosts: ~2 TB


def test_the_logits_term_is_the_one_the_review_found():
    (qwen,) = [r for r in memory.rows() if r.name == "qwen7b.yaml"]
    assert 29 < qwen.loss() / memory.GB < 31  # 16k tokens x 152k vocabulary


def test_gpu_pods_request_the_disk_their_configs_need():
    need = {r.name: 1.2 * (r.checkpoint() + 2 * r.arch.params) for r in memory.rows()}
    for path in sorted((REPO / "cluster").glob("ray-*.yaml")):
        manifest = yaml.safe_load(path.read_text())
        spec = manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"].get("rayClusterSpec")
        if spec is None:
            continue
        entry = manifest["spec"].get("entrypoint", "")
        config = re.search(r"jobs/configs/(\S+\.yaml)", entry)
        # A long-lived cluster sized for some configs only says which (metadata annotation).
        sized_for = manifest["metadata"].get("annotations", {}).get("raypack/sized-for", "").split()
        assert all(name in need for name in sized_for), f"{path.name}: {sized_for}"
        if config and config[1] in need:
            wanted = need[config[1]]
        elif sized_for:
            wanted = max(need[name] for name in sized_for)
        else:
            wanted = max(need.values())
        for group in spec["workerGroupSpecs"]:
            limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
            if "nvidia.com/gpu" in limits:
                assert quantity(limits["ephemeral-storage"]) >= wanted, f"{path.name}: {group['groupName']}"
