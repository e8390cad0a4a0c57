"""Every KubeRay manifest in cluster/ validates strictly against the KubeRay 1.5.1 CRD schemas
(an unknown field is an error, as under `kubectl apply --validate=strict`) and carries what a real
cluster needs: token auth through spec.authOptions, the project image, the Hugging Face token
from a Secret, node-local scratch for TMPDIR and HF_HOME, a CPU group, and the interconnect
resources of its cloud on every GPU group."""

from __future__ import annotations

import copy
import gzip
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "cluster"
CRDS = REPO / "tests" / "assets" / "kuberay"
MANIFESTS = sorted(CLUSTER.glob("ray-*.yaml"))
IMAGE_TAG = "raypack:0.1.0-cu128"  # docker/Dockerfile; the registry is per cloud


def _id(p: Path) -> str:
    return p.name


# --- strict CRD validation ------------------------------------------------------------------------


def strict(schema: dict) -> dict:
    """The CRD's openAPIV3Schema as the API server applies it under strict field validation:
    an object that lists `properties` accepts no other key, unless it preserves unknown fields;
    `x-kubernetes-int-or-string` accepts an int or a string."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
                and "additionalProperties" not in node
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def crd_schema(kind: str, version: str = "v1", strict_fields: bool = True) -> dict:
    # gzipped (2.2 MB of YAML in 96 KB): the repository travels to the GPU machine within a byte budget
    path = {"RayCluster": CRDS / "rayclusters-1.5.1.yaml.gz", "RayJob": CRDS / "rayjobs-1.5.1.yaml.gz"}[kind]
    crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    return strict(schema) if strict_fields else schema


def errors(manifest: dict, strict_fields: bool = True) -> list[str]:
    group, version = manifest["apiVersion"].split("/")
    assert group == "ray.io"
    schema = crd_schema(manifest["kind"], version, strict_fields)
    validator = jsonschema.Draft7Validator(schema)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest))


@pytest.mark.parametrize("path", MANIFESTS, ids=_id)
def test_manifest_validates_strictly_against_kuberay_1_5_1(path):
    manifest = yaml.safe_load(path.read_text())
    assert manifest["kind"] in ("RayCluster", "RayJob")
    assert errors(manifest) == []


def _sample() -> dict:
    return yaml.safe_load((CLUSTER / "ray-cluster.gpu.yaml").read_text())


def test_strict_validation_rejects_a_misspelled_auth_options():
    bad = _sample()
    bad["spec"]["authOption"] = bad["spec"].pop("authOptions")
    assert any("authOption" in e and "not allowed" in e for e in errors(bad))
    # Without strict field validation the API server would drop it silently: the cluster would
    # come up without token auth. That is what the strict check is for.
    assert errors(bad, strict_fields=False) == []


def test_strict_validation_rejects_unknown_fields_deep_in_the_pod_template():
    bad = _sample()
    bad["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["envv"] = []
    assert any("envv" in e for e in errors(bad))
    bad = _sample()
    bad["spec"]["headGroupSpec"]["template"]["spec"]["volumes"][0]["emptyDir"]["size"] = "1Gi"
    assert any("size" in e for e in errors(bad))


def test_strict_validation_rejects_a_wrong_auth_mode_and_a_wrong_type():
    bad = _sample()
    bad["spec"]["authOptions"]["mode"] = "tokens"
    assert any("authOptions.mode" in e for e in errors(bad))
    bad = _sample()
    bad["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    assert any("maxReplicas" in e for e in errors(bad))


def test_int_or_string_quantities_accept_both():
    ok = _sample()
    limits = ok["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["cpu"] = 30  # an int where the manifests write "30"
    assert errors(ok) == []


# --- what a real cluster needs -----------------------------------------------------------------


def cluster_specs(manifest: dict) -> list[dict]:
    if manifest["kind"] == "RayCluster":
        return [manifest["spec"]]
    return [manifest["spec"]["rayClusterSpec"]] if "rayClusterSpec" in manifest["spec"] else []


def groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def gpus(group: dict) -> int:
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return int(limits.get("nvidia.com/gpu", 0))


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def all_manifests() -> list[tuple[Path, dict]]:
    return [(p, yaml.safe_load(p.read_text())) for p in MANIFESTS]


def test_every_file_is_covered():
    names = {p.name for p in MANIFESTS}
    assert {"ray-cluster.gpu.yaml", "ray-cluster.eks-efa.yaml", "ray-cluster.gke-tcpx.yaml",
            "ray-job.sft.yaml", "ray-job.sweep.yaml", "ray-job.plan.yaml"} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=_id)
def test_token_auth_comes_from_auth_options(path):
    manifest = yaml.safe_load(path.read_text())
    for spec in cluster_specs(manifest):
        # authOptions needs KubeRay >= 1.5.1 and Ray >= 2.52.
        assert spec["authOptions"] == {"mode": "token"}, path.name
        assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52), path.name
        for group in groups(spec):
            for c in group["template"]["spec"]["containers"]:
                e = env(c)
                # A hand-set token from another Secret would differ from the operator's, which the
                # autoscaler and the job-status client use: never set one.
                assert "RAY_AUTH_TOKEN" not in e, f"{path.name}: {c['name']} sets RAY_AUTH_TOKEN"
                if c["name"].startswith("ray-"):
                    assert e["RAY_AUTH_MODE"]["value"] == "token", path.name
    if manifest["kind"] == "RayJob" and "clusterSelector" in manifest["spec"]:
        target = manifest["spec"]["clusterSelector"]["ray.io/cluster"]
        selected = [m for _, m in all_manifests() if m["kind"] == "RayCluster" and m["metadata"]["name"] == target]
        assert selected and selected[0]["spec"]["authOptions"] == {"mode": "token"}


@pytest.mark.parametrize("path", MANIFESTS, ids=_id)
def test_every_ray_pod_runs_the_project_image(path):
    manifest = yaml.safe_load(path.read_text())
    containers = [c for spec in cluster_specs(manifest) for g in groups(spec) for c in g["template"]["spec"]["containers"]]
    containers += manifest["spec"].get("submitterPodTemplate", {}).get("spec", {}).get("containers", [])
    images = {c["image"] for c in containers if c["name"].startswith("ray-")}
    assert len(images) == 1 and images.pop().endswith("/" + IMAGE_TAG), f"{path.name}: {images}"


@pytest.mark.parametrize("path", MANIFESTS, ids=_id)
def test_hf_token_scratch_and_ephemeral_storage(path):
    manifest = yaml.safe_load(path.read_text())
    for spec in cluster_specs(manifest):
        for group in groups(spec):
            pod = group["template"]["spec"]
            ray = pod["containers"][0]
            assert ray["name"].startswith("ray-"), "KubeRay runs Ray in the first container"
            e = env(ray)
            assert e["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "raypack-hf-token"
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in ray["volumeMounts"]}
            for var in ("TMPDIR", "HF_HOME"):
                where = e[var]["value"]
                assert where in mounts, f"{path.name}: {var}={where} is not a mounted volume"
                assert "emptyDir" in volumes[mounts[where]] or "ephemeral" in volumes[mounts[where]]
            res = ray["resources"]
            assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"]
            if gpus(group):
                assert gpus(group) == 8
                # CPU, GPU and memory are explicit: KubeRay turns the limits into Ray resources.
                assert {"cpu", "memory", "nvidia.com/gpu"} <= set(res["limits"])
                assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_long_lived_clusters_and_the_plan_job_have_a_cpu_group():
    for path, manifest in all_manifests():
        specs = cluster_specs(manifest)
        if manifest["kind"] == "RayCluster" or path.name == "ray-job.plan.yaml":
            (spec,) = specs
            assert any(gpus(g) == 0 for g in spec["workerGroupSpecs"]), path.name
    plan = yaml.safe_load((CLUSTER / "ray-job.plan.yaml").read_text())
    (spec,) = cluster_specs(plan)
    assert all(gpus(g) == 0 for g in groups(spec)), "the dry run must never start a GPU node"
    assert re.match(r"python jobs/plan\.py --config (\S+)", plan["spec"]["entrypoint"])


def test_efa_groups_ask_for_every_interface_and_can_pin_memory():
    for path, manifest in all_manifests():
        for spec in cluster_specs(manifest):
            for g in spec["workerGroupSpecs"]:
                pod = g["template"]["spec"]
                if pod.get("nodeSelector", {}).get("node.kubernetes.io/instance-type") != "p5.48xlarge":
                    continue
                ray = pod["containers"][0]
                for side in ("requests", "limits"):
                    assert ray["resources"][side]["vpc.amazonaws.com/efa"] == "32", path.name
                    assert "hugepages-2Mi" in ray["resources"][side]
                assert "IPC_LOCK" in ray["securityContext"]["capabilities"]["add"]
                assert env(ray)["FI_PROVIDER"]["value"] == "efa"


def test_tcpx_groups_have_multi_networking_and_the_receive_daemon():
    manifest = yaml.safe_load((CLUSTER / "ray-cluster.gke-tcpx.yaml").read_text())
    (gpu,) = [g for g in manifest["spec"]["workerGroupSpecs"] if gpus(g)]
    annotations = gpu["template"]["metadata"]["annotations"]
    nics = json.loads(annotations["networking.gke.io/interfaces"])
    assert [n["interfaceName"] for n in nics] == ["eth0", "eth1", "eth2", "eth3", "eth4"]
    pod = gpu["template"]["spec"]
    names = [c["name"] for c in pod["containers"]]
    assert names[0] == "ray-worker" and "tcpx-daemon" in names
    e = env(pod["containers"][0])
    assert e["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"]["value"] == "eth1,eth2,eth3,eth4"
    assert e["LD_LIBRARY_PATH"]["value"].startswith("/usr/local/nvidia/lib64")
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"


def test_pods_end_the_way_raypack_stops():
    """A pod deleted or evicted (scale-down, a spot reclaim, a RayJob deleted): a GPU worker's
    preStop drains its node (Ray Train's preemption notice: raypack checkpoints and the workers
    move to the nodes left) and the head's stops the running jobs as `ray job stop` does (SIGTERM:
    raypack checkpoints and exits), each within terminationGracePeriodSeconds; `ray job stop`
    waits longer than raypack's stop takes (train.stop_grace_s). The hook runs in the pod and was
    not run here: cluster/README.md says what only a real cluster can show."""
    import ast

    from raypack.config import TrainConfig

    checked = 0
    for path, manifest in all_manifests():
        for spec in cluster_specs(manifest):
            if not any(gpus(g) for g in groups(spec)):
                continue  # no training here (the plan job's CPU cluster)
            for group in groups(spec):
                if group is not spec["headGroupSpec"] and not gpus(group):
                    continue
                pod = group["template"]["spec"]
                ray = pod["containers"][0]
                hook = ray["lifecycle"]["preStop"]["exec"]["command"]
                grace = pod["terminationGracePeriodSeconds"]
                if group is spec["headGroupSpec"]:
                    code = hook[2]
                    ast.parse(code)  # the script the hook runs is Python
                    assert "stop_job" in code and "time.time() + 50" in code, path.name
                    waits = int(env(ray)["RAY_JOB_STOP_WAIT_TIME_S"]["value"])
                    assert TrainConfig().stop_grace_s + 10 <= waits < 50 < grace, path.name
                else:
                    script = hook[2]
                    assert hook[:2] == ["/bin/sh", "-c"] and "--reason DRAIN_NODE_REASON_PREEMPTION" in script
                    deadline = int(script.split("--deadline-remaining-seconds ")[1].split(";")[0])
                    assert TrainConfig().stop_grace_s < deadline < grace and "seq 50" in script, path.name
                    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0, f"{path.name}: not sh"
                checked += 1
    assert checked == 8  # the three RayClusters' and ray-job.sft.yaml's heads and GPU groups
