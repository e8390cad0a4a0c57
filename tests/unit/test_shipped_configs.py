"""Every shipped run config, DeepSpeed preset, cluster file and KubeRay manifest loads and holds
what it must (after litgpt's test_config_hub.py), and none exposes the cluster or a secret."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from raypack.config import load
from raypack.train.engines.presets import PRESETS as PRESET_DIR
from raypack.tune.space import check as check_sweep

from paths import REPO

CONFIGS = REPO / "jobs" / "configs"
CLUSTER = REPO / "cluster"

RUN_CONFIGS = sorted(CONFIGS.rglob("*.yaml"))
PRESETS = sorted(PRESET_DIR.glob("*.json"))
LAUNCHERS = sorted(CLUSTER.glob("*-gpu.yaml"))
KUBERAY = sorted(CLUSTER.glob("ray-*.yaml"))
SHIPPED = sorted(p for p in [*CLUSTER.iterdir(), *CONFIGS.rglob("*"), *(REPO / "jobs").glob("*.py")] if p.is_file())


def _id(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_everything_is_found():
    names = {p.name for p in RUN_CONFIGS}
    assert {"llama8b_zero3_1node.yaml", "llama8b_zero3_2node.yaml", "llama8b_zero3_4node.yaml",
            "llama70b_zero3_offload.yaml", "qwen7b.yaml", "packing.yaml", "packing_cpu.yaml"} <= names
    assert {p.name for p in LAUNCHERS} == {"aws-gpu.yaml", "gcp-gpu.yaml"}
    assert {p.name for p in KUBERAY} >= {"ray-cluster.gpu.yaml", "ray-job.sft.yaml", "ray-job.sweep.yaml"}
    assert PRESETS


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_id)
def test_run_config_saves_and_reloads_with_every_key_unchanged(path, tmp_path, monkeypatch):
    """What `raypack train --resume` relies on: the config a run saves reloads to exactly the
    config it trained, and every key computed from it (tokenized data, packed data, which
    checkpoints a resume may continue from) is the same, wherever the resume runs from."""
    from raypack.config import dumps
    from raypack.data.cache import packed_key, tokenized_key
    from raypack.data.strategies import check_strategies
    from raypack.runs import absolute_paths, at, save_config, saved_config

    monkeypatch.chdir(REPO)  # the shipped configs' relative paths are the repository's
    cfg = absolute_paths(at(load(path), str(tmp_path / "run")))
    check_strategies(cfg)
    save_config(cfg)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    back = saved_config(str(tmp_path / "run"))
    assert back == cfg and dumps(back) == dumps(cfg)
    n = cfg.train.num_workers
    assert tokenized_key(back) == tokenized_key(cfg) and packed_key(back, n) == packed_key(cfg, n)
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(cfg.to_dict(), sort_keys=True)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_id)
def test_run_config_loads(path):
    cfg = load(path)
    raw = yaml.safe_load(path.read_text())
    # Sizing is stated, not inherited from defaults: budget, batch, world size and storage.
    assert "budget" in raw["pack"] and "num_workers" in raw["train"] and "grad_accum" in raw["train"]
    assert "storage_path" in raw["run"] and "name" in raw["run"]
    assert "#" in path.read_text()  # sizing comments
    if "sweeps" in path.parts:
        check_sweep(cfg)  # what `raypack sweep` checks before any Ray work
    if cfg.train.deepspeed_preset:
        assert (PRESET_DIR / f"{cfg.train.deepspeed_preset}.json").exists()
    if cfg.train.use_gpu:
        # Multi-GPU runs: shared storage every node can write, and a real model.
        assert cfg.run.storage_path.startswith(("s3://", "gs://", "/mnt/")), cfg.run.storage_path
        assert "/" in cfg.model.name and not cfg.model.name.startswith("tiny-")


def test_cpu_sweep_is_small():
    cfg = load(CONFIGS / "sweeps" / "packing_cpu.yaml")
    assert not cfg.train.use_gpu and cfg.model.name.startswith("tiny-")
    assert len(cfg.tune.strategies) >= 3
    # Small by construction: one epoch over the bundled sample (300 examples), or a few steps.
    bundled = all("raypack/assets/sample/" in p for p in cfg.data.paths)
    assert (cfg.train.epochs == 1 and bundled) or (cfg.train.max_steps or 10**9) <= 20
    assert cfg.pack.budget <= 512 and cfg.train.num_workers <= 2


@pytest.mark.parametrize("path", PRESETS, ids=_id)
def test_deepspeed_preset_has_no_auto(path):
    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
        else:
            assert node != "auto", f"{path.name}: {where} is 'auto'; the typed config sets it"

    walk(json.loads(path.read_text()), "")


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_cluster_launcher(path):
    c = yaml.safe_load(path.read_text())
    for key in ("cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in c, f"{path.name}: no {key}"
    assert c["provider"]["type"] in ("aws", "gcp")
    assert c["head_node_type"] in c["available_node_types"]
    gpu_types = [t for t in c["available_node_types"].values()
                 if re.search(r"p5\.|a3-", json.dumps(t["node_config"]))]
    assert gpu_types, f"{path.name}: no H100 node type (p5 / a3)"
    head = " ".join(c["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head and "--dashboard-host=127.0.0.1" in head


def _containers(spec: dict) -> list[dict]:
    return spec["template"]["spec"]["containers"]


def _check_raycluster_spec(spec: dict, where: str) -> None:
    assert "headGroupSpec" in spec and spec["workerGroupSpecs"], where
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP", f"{where}: head exposed"
    # KubeRay >= 1.5.1 keeps the token in its own Secret and gives it to the Ray containers, the
    # autoscaler and the job submitter (spec.authOptions); a token set by hand would differ.
    assert spec["authOptions"]["mode"] == "token", f"{where}: token auth off"
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for c in _containers(group):
            env = {e["name"]: e for e in c.get("env", [])}
            assert "RAY_AUTH_TOKEN" not in env, f"{where}: token set by hand, not the operator's"
            if c["name"].startswith("ray-"):
                assert env["RAY_AUTH_MODE"]["value"] == "token", f"{where}: token auth off"
    for group in spec["workerGroupSpecs"]:
        limits = _containers(group)[0]["resources"]["limits"]
        assert int(limits.get("nvidia.com/gpu", 0)) in (0, 8), f"{where}: GPU group without 8 GPUs"


def test_kuberay_raycluster():
    m = yaml.safe_load((CLUSTER / "ray-cluster.gpu.yaml").read_text())
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayCluster"
    _check_raycluster_spec(m["spec"], "ray-cluster.gpu.yaml")


@pytest.mark.parametrize("name", ["ray-job.sft.yaml", "ray-job.sweep.yaml"])
def test_kuberay_rayjob(name):
    m = yaml.safe_load((CLUSTER / name).read_text())
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayJob"
    spec = m["spec"]
    script = re.match(r"python (jobs/\w+\.py) --config (\S+)", spec["entrypoint"])
    assert script and (REPO / script[1]).exists() and (REPO / script[2]).exists(), spec["entrypoint"]
    load(REPO / script[2])
    assert ("rayClusterSpec" in spec) != ("clusterSelector" in spec)
    if "rayClusterSpec" in spec:
        _check_raycluster_spec(spec["rayClusterSpec"], name)
    else:
        cluster = yaml.safe_load((CLUSTER / "ray-cluster.gpu.yaml").read_text())
        assert spec["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]


def test_local_sh_parses():
    subprocess.run(["bash", "-n", str(CLUSTER / "local.sh")], check=True)


# --- security: nothing exposed, nothing secret ---------------------------------------------------

SECRET_PATTERNS = [
    r"AKIA[0-9A-Z]{16}",                                   # AWS access key id
    r"aws_secret_access_key\s*[:=]",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"\"private_key\"\s*:",                                # GCP service-account key JSON
    r"hf_[A-Za-z0-9]{30,}",                                # Hugging Face token
    r"RAY_AUTH_TOKEN\s*[:=]\s*['\"]?[0-9a-f]{16,}",        # a literal Ray token
    r"(?i)(password|secret_key|api_key)\s*[:=]\s*['\"]?\w{8,}",
]


@pytest.mark.parametrize("path", SHIPPED, ids=_id)
def test_no_credentials(path):
    text = path.read_text(errors="ignore")
    for pattern in SECRET_PATTERNS:
        assert not re.search(pattern, text), f"{path.name}: looks like a credential ({pattern})"


@pytest.mark.parametrize("path", [*LAUNCHERS, *KUBERAY, CLUSTER / "local.sh"], ids=_id)
def test_dashboard_not_public(path):
    if path.suffix == ".yaml":  # what the file sets, not what its comments warn against
        text = yaml.safe_dump(yaml.safe_load(path.read_text()))
    else:
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    # Never turned off in a shipped file.
    assert "RAY_AUTH_MODE=disabled" not in text and not re.search(r"RAY_AUTH_MODE\W+value:\s*disabled", text)
    # No Service or security-group rule that puts the dashboard, GCS or client port on the internet.
    assert not re.search(r"type:\s*(LoadBalancer|NodePort)", text)
    assert "serviceType: LoadBalancer" not in text and "serviceType: NodePort" not in text
    assert "0.0.0.0/0" not in text and "::/0" not in text
    if path.suffix == ".sh" or path in LAUNCHERS:
        # On VMs the dashboard binds to localhost; clients come through an SSH tunnel.
        assert "--dashboard-host=0.0.0.0" not in text


def test_readme_covers_auth_and_tunnels():
    text = (CLUSTER / "README.md").read_text()
    for needle in ("RAY_AUTH_MODE=token", "auth_token", "--working-dir", "--runtime-env-json", "excludes",
                   "storage_path", "num_workers", "ssh -L", "port-forward"):
        assert needle in text, f"cluster/README.md does not mention {needle}"
