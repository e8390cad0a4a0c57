"""What the cluster files need to get past their first step at run time (issue 26), checked
without a cloud: the ServiceAccount every Ray pod names exists in a shipped manifest, every RayJob
has token auth, the AWS subnet layout passes Ray's own bootstrap, GCE `scheduling` is a mapping,
ephemeral-storage requests fit a documented node shape, NCCL takes the plugin of its cluster's
fabric, and the pieces around them (operator Helm values, eksctl ClusterConfig, GKE script,
reservations, the NCCL smoke job, the fake-autoscaler runner, memory.py without torch) hold
together."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

import psutil
import pytest
import yaml
from cloudstubs import stub_sdks
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "cluster"
ASSETS = Path(__file__).resolve().parent / "assets"
MANIFESTS = sorted(CLUSTER.glob("ray-*.yaml"))
LAUNCHERS = sorted(CLUSTER.glob("*-gpu.yaml"))
README = (CLUSTER / "README.md").read_text()
GB = 10**9
Gi = 2**30


def _id(p: Path) -> str:
    return p.name


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def cluster_specs(manifest: dict) -> list[dict]:
    if manifest["kind"] == "RayCluster":
        return [manifest["spec"]]
    return [manifest["spec"]["rayClusterSpec"]] if "rayClusterSpec" in manifest["spec"] else []


def groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def pod_specs(manifest: dict) -> list[dict]:
    pods = [g["template"]["spec"] for s in cluster_specs(manifest) for g in groups(s)]
    if "submitterPodTemplate" in manifest["spec"]:
        pods.append(manifest["spec"]["submitterPodTemplate"]["spec"])
    return pods


def module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# --- ServiceAccount ------------------------------------------------------------------------------


def shipped_service_accounts() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(CLUSTER.glob("*.yaml")):
        for d in docs(path):
            if d.get("kind") == "ServiceAccount" and d.get("apiVersion") == "v1":
                found[(d["metadata"].get("namespace", "default"), d["metadata"]["name"])] = d
    return found


def test_every_service_account_a_pod_names_is_created_by_a_shipped_manifest():
    """KubeRay 1.5.1 refuses the head pod when autoscaling is on and the head's named account is
    missing (raycluster_controller.go, reconcileAutoscalerServiceAccount)."""
    accounts = shipped_service_accounts()
    named = set()
    for path in MANIFESTS:
        manifest = yaml.safe_load(path.read_text())
        ns = manifest["metadata"].get("namespace", "default")
        for pod in pod_specs(manifest):
            if pod.get("serviceAccountName"):
                named.add((ns, pod["serviceAccountName"]))
                assert (ns, pod["serviceAccountName"]) in accounts, f"{path.name}: {pod['serviceAccountName']}"
    assert ("default", "raypack") in named


def test_the_service_account_carries_irsa_and_workload_identity():
    sa = shipped_service_accounts()[("default", "raypack")]
    notes = sa["metadata"]["annotations"]
    role = notes["eks.amazonaws.com/role-arn"]
    gsa = notes["iam.gke.io/gcp-service-account"]
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", role)
    assert re.fullmatch(r"[a-z][\w-]*@[\w-]+\.iam\.gserviceaccount\.com", gsa)
    # eksctl makes that role for that account; gke-cluster.sh binds that GCP account to it.
    eks = yaml.safe_load((CLUSTER / "eks-cluster.yaml").read_text())
    (irsa,) = [s for s in eks["iam"]["serviceAccounts"] if s["metadata"]["name"] == "raypack"]
    assert irsa["metadata"]["namespace"] == "default" and irsa["roleOnly"] is True
    assert role.endswith("/" + irsa["roleName"]) and eks["iam"]["withOIDC"] is True
    script = (CLUSTER / "gke-cluster.sh").read_text()
    assert '[default/raypack]' in script and "roles/iam.workloadIdentityUser" in script
    assert gsa.split("@")[0] in script and "--workload-pool=" in script and "GKE_METADATA" in script


# --- token auth on every RayJob -------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CLUSTER.glob("ray-job.*.yaml")), ids=_id)
def test_every_rayjob_has_token_auth(path):
    """A RayJob that makes its cluster sets rayClusterSpec.authOptions. One that selects a cluster
    cannot (KubeRay 1.5.1's RayJob CRD has authOptions under rayClusterSpec only); the operator
    gives the selected cluster's token to its submitter (rayjob_controller.go,
    configureSubmitterContainer), so the selected shipped RayCluster must have token auth."""
    job = yaml.safe_load(path.read_text())
    spec = job["spec"]
    assert ("rayClusterSpec" in spec) != ("clusterSelector" in spec), path.name
    if "rayClusterSpec" in spec:
        assert spec["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    else:
        target = spec["clusterSelector"]["ray.io/cluster"]
        clusters = [yaml.safe_load(p.read_text()) for p in sorted(CLUSTER.glob("ray-cluster.*.yaml"))]
        (selected,) = [c for c in clusters if c["metadata"]["name"] == target]
        assert selected["spec"]["authOptions"] == {"mode": "token"}
        assert spec["submissionMode"] == "K8sJobMode"  # SidecarMode refuses a clusterSelector


def test_the_hf_token_secret_is_required():
    """A missing Secret stops the head pod (CPU) at once, not a gated download on the GPU nodes."""
    for path in MANIFESTS:
        for pod in pod_specs(yaml.safe_load(path.read_text())):
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef", {})
                    if ref.get("name") == "raypack-hf-token":
                        assert not ref.get("optional"), f"{path.name}: {c['name']}"


# --- AWS: the subnet layout Ray's bootstrap accepts ------------------------------------------------


class _Subnet:
    def __init__(self, subnet_id: str, public: bool, az="us-east-1a", vpc="vpc-1"):
        self.subnet_id, self.map_public_ip_on_launch = subnet_id, public
        self.availability_zone, self.vpc_id, self.state = az, vpc, "available"


class _EC2:
    def __init__(self, subnets):
        outer = self

        class Subnets:
            def all(self):
                return list(outer._subnets)

            def filter(self, Filters):
                ids = set(Filters[0]["Values"])
                return [s for s in outer._subnets if s.subnet_id in ids]

        self._subnets, self.subnets = subnets, Subnets()


def aws_subnets(config: dict) -> set[str]:
    ids = set()
    for t in config["available_node_types"].values():
        ids |= set(t["node_config"].get("SubnetIds", []))
        ids |= {ni["SubnetId"] for ni in t["node_config"].get("NetworkInterfaces", [])}
    return ids


@pytest.fixture
def aws():
    """ray.autoscaler._private.aws.config, with stub SDKs where boto3 is absent; sys.modules restored."""
    roots = {r for r in ("boto3", "botocore") if importlib.util.find_spec(r) is None}
    with stub_sdks(roots):
        yield importlib.import_module("ray.autoscaler._private.aws.config")


def bootstrap_subnets(aws, config: dict, public: set[str], monkeypatch) -> dict:
    """Ray's own AWS bootstrap steps for subnets (_configure_from_network_interfaces, then
    _configure_subnet) against subnets of which only `public` map public IPs on launch."""
    subnets = [_Subnet(s, s in public) for s in sorted(aws_subnets(config))]
    monkeypatch.setattr(aws, "_resource", lambda name, cfg: _EC2(subnets))
    monkeypatch.setattr(aws, "_get_vpc_id_of_sg", lambda sg_ids, cfg: "vpc-1")
    config = aws._configure_from_network_interfaces(copy.deepcopy(config))
    return aws._configure_subnet(config)


def test_the_aws_layout_passes_rays_subnet_bootstrap(aws, monkeypatch):
    """Every subnet is private (p5 with 32 EFA interfaces gets no public IP): Ray keeps them only
    with use_internal_ips, and `ray up` then needs the head's private address, through the bastion."""
    config = prepare_config(yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text()))
    assert config["provider"]["use_internal_ips"] is True
    assert "ssh_proxy_command" in config["auth"]  # or run `ray up` inside the VPC (README)
    done = bootstrap_subnets(aws, config, public=set(), monkeypatch=monkeypatch)
    for name, t in done["available_node_types"].items():
        assert t["node_config"]["SubnetIds"], name
    # The p5 interfaces all sit in the one subnet the bootstrap kept for the type.
    p5 = done["available_node_types"]["gpu_p5"]["node_config"]
    assert {ni["SubnetId"] for ni in p5["NetworkInterfaces"]} == set(p5["SubnetIds"])


def test_the_old_public_head_private_workers_layout_is_what_ray_rejects(aws, monkeypatch):
    """The check above can fail: without use_internal_ips a private subnet stops `ray up` with
    "No usable subnets found" (cli_logger.abort), even when the head's subnet is public."""
    config = prepare_config(yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text()))
    config["provider"]["use_internal_ips"] = False
    config["available_node_types"]["head"]["node_config"]["SubnetIds"] = ["subnet-public"]
    with pytest.raises(Exception, match="cli_logger.abort|[Uu]sable"):
        bootstrap_subnets(aws, config, public={"subnet-public"}, monkeypatch=monkeypatch)


# --- GCP -----------------------------------------------------------------------------------------

GCE_SCHEDULING = {"onHostMaintenance", "automaticRestart", "preemptible", "provisioningModel",
                  "instanceTerminationAction", "nodeAffinities", "maxRunDuration", "terminationTime",
                  "availabilityDomain", "localSsdRecoveryTimeout", "onInstanceStopAction"}


def test_gcp_scheduling_is_a_mapping():
    """GCE's Instance.scheduling is one Scheduling object; a list is refused at insert."""
    config = yaml.safe_load((CLUSTER / "gcp-gpu.yaml").read_text())
    seen = 0
    for name, t in config["available_node_types"].items():
        sched = t["node_config"].get("scheduling")
        if sched is not None:
            seen += 1
            assert isinstance(sched, dict), f"{name}: scheduling must be a mapping, not {type(sched).__name__}"
            assert set(sched) <= GCE_SCHEDULING, name
        if t["resources"].get("GPU"):
            assert sched and sched["onHostMaintenance"] == "TERMINATE", f"{name}: GPU VMs cannot live-migrate"
    assert seen


def test_gcp_launcher_installs_the_tcpx_plugin_without_googles_nccl():
    config = yaml.safe_load((CLUSTER / "gcp-gpu.yaml").read_text())
    a3 = config["available_node_types"]["gpu_a3"]
    assert not any("--install-nccl" in c for c in a3["initialization_commands"])


def test_readme_names_the_gcp_launchers_iam_needs():
    """Ray's GCP bootstrap creates ray-autoscaler-sa-v1 and sets the project's IAM policy."""
    for needle in ("ray-autoscaler-sa-v1", "roles/resourcemanager.projectIamAdmin", "roles/iam.serviceAccountAdmin"):
        assert needle in README


# --- ephemeral storage fits a documented node shape -------------------------------------------------


def allocatable(disk_gb: float) -> float:
    """What pods may request on a node whose ephemeral storage is `disk_gb` GB: less the kubelet's
    eviction threshold (15%) and ~35 GB of images (the raypack image and the system's)."""
    return (disk_gb * 0.85 - 35) * GB / Gi


# name in cluster/README.md ("Node shapes") -> ephemeral storage of the node (GB)
NODE_SHAPES = {
    "any 8-GPU node, 500 GB boot disk": 500,
    "CPU node, 200 GB boot disk": 200,
    "CPU node, 300 GB boot disk": 300,
    "p5.48xlarge, 8x 3.84 TB NVMe in RAID0": 8 * 3840,
    "a3-highgpu-8g, 16x 375 GB local SSD": 16 * 375,
}
# (file, group) -> the shape its nodes have: GPU groups by file, CPU groups and heads by file.
SHAPE_OF = {
    "ray-cluster.gpu.yaml": ("any 8-GPU node, 500 GB boot disk", "CPU node, 200 GB boot disk"),
    "ray-job.plan.yaml": (None, "CPU node, 200 GB boot disk"),
    "ray-cluster.eks-efa.yaml": ("p5.48xlarge, 8x 3.84 TB NVMe in RAID0", "CPU node, 200 GB boot disk"),
    "ray-job.sft.yaml": ("p5.48xlarge, 8x 3.84 TB NVMe in RAID0", "CPU node, 200 GB boot disk"),
    "ray-cluster.gke-tcpx.yaml": ("a3-highgpu-8g, 16x 375 GB local SSD", "CPU node, 300 GB boot disk"),
}


def quantity(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(q))
    return float(m[1]) * units.get(m[2], 1)


def test_every_manifest_has_a_node_shape():
    with_groups = {p.name for p in MANIFESTS if cluster_specs(yaml.safe_load(p.read_text()))}
    assert with_groups == set(SHAPE_OF)


@pytest.mark.parametrize("name", sorted(SHAPE_OF), ids=str)
def test_ephemeral_storage_requests_fit_a_documented_node_shape(name):
    manifest = yaml.safe_load((CLUSTER / name).read_text())
    gpu_shape, cpu_shape = SHAPE_OF[name]
    for spec in cluster_specs(manifest):
        for group in groups(spec):
            res = group["template"]["spec"]["containers"][0]["resources"]
            shape = gpu_shape if "nvidia.com/gpu" in res["limits"] else cpu_shape
            asked = quantity(res["requests"]["ephemeral-storage"])
            room = allocatable(NODE_SHAPES[shape])
            assert asked <= room * Gi, f"{name}: {group.get('groupName', 'head')} asks {asked / Gi:.0f}Gi, " \
                                       f"{shape} has {room:.0f}Gi"
            # emptyDir limits inside the request: a pod is evicted past its own request.
            dirs = sum(quantity(v["emptyDir"].get("sizeLimit", "0")) for v in group["template"]["spec"]["volumes"]
                       if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
            assert dirs <= asked, f"{name}: {group.get('groupName', 'head')}"


def test_node_shapes_are_documented_and_made_by_the_shipped_setup():
    for shape in NODE_SHAPES:
        assert shape in README, f"cluster/README.md, 'Node shapes', lacks {shape!r}"
    eks = yaml.safe_load((CLUSTER / "eks-cluster.yaml").read_text())
    ngs = {g["name"]: g for g in eks["managedNodeGroups"]}
    assert "strategy: RAID0" in ngs["gpu-p5"]["overrideBootstrapCommand"]
    assert ngs["system"]["volumeSize"] >= 200 and ngs["cpu"]["volumeSize"] >= 200
    script = (CLUSTER / "gke-cluster.sh").read_text()
    assert "--ephemeral-storage-local-ssd=count=16" in script and "--disk-size=300" in script


# --- NCCL: each cluster's fabric, and no foreign plugin or NCCL ---------------------------------------


def gpu_envs() -> list[tuple[str, str, dict[str, str]]]:
    """(file, fabric, env) for every GPU group / node type."""
    out = []
    for path in MANIFESTS:
        m = yaml.safe_load(path.read_text())
        for spec in cluster_specs(m):
            for g in groups(spec):
                c = g["template"]["spec"]["containers"][0]
                if "nvidia.com/gpu" not in c["resources"]["limits"]:
                    continue
                env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
                fabric = ("efa" if "vpc.amazonaws.com/efa" in c["resources"]["limits"]
                          else "tcpx" if "tcpx" in path.name else "none")
                out.append((path.name, fabric, env))
    for path in LAUNCHERS:
        cfg = yaml.safe_load(path.read_text())
        for name, t in cfg["available_node_types"].items():
            if not t["resources"].get("GPU"):
                continue
            env = {}
            for opt in t.get("docker", {}).get("worker_run_options", []):
                if opt.startswith("--env "):
                    k, _, v = opt[len("--env "):].partition("=")
                    env[k] = v
            fabric = "efa" if env.get("FI_PROVIDER") == "efa" else "tcpx" if "NCCL_GPUDIRECTTCPX_CTRL_DEV" in env else "none"
            out.append((f"{path.name}:{name}", fabric, env))
    return out


def test_nccl_takes_the_plugin_of_its_fabric():
    check_image = module(REPO / "docker" / "check_image.py", "raypack_check_image_for_nccl")
    fabrics = set()
    for where, fabric, env in gpu_envs():
        fabrics.add(fabric)
        if fabric == "efa":  # the image's aws-ofi-nccl, found on its LD_LIBRARY_PATH
            assert env.get("NCCL_NET_PLUGIN") != "none" and "LD_LIBRARY_PATH" not in env, where
        elif fabric == "tcpx":  # Google's plugin first, torch's own NCCL preloaded over Google's
            assert "tcpx" in env["LD_LIBRARY_PATH"].split(":")[0] or "nvidia" in env["LD_LIBRARY_PATH"].split(":")[0], where
            assert env["LD_PRELOAD"] == check_image.TORCH_NCCL, where
        else:  # no fabric: never the image's EFA plugin
            assert env.get("NCCL_NET_PLUGIN") == "none", where
    assert fabrics == {"efa", "tcpx", "none"}


# --- operator Helm values, eksctl, reservations ---------------------------------------------------------


def _keys_exist(ours, theirs, where=""):
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), where
        for k, v in ours.items():
            assert k in theirs, f"{where}.{k} is not a key of the chart"
            # resources is a Kubernetes ResourceRequirements (the chart leaves requests commented out).
            if k != "resources" and theirs[k] is not None and not isinstance(theirs[k], (list, str)) and v != {}:
                _keys_exist(v, theirs[k], f"{where}.{k}")


def test_operator_helm_values_are_keys_of_the_1_5_1_chart():
    chart = yaml.safe_load((ASSETS / "kuberay-operator-1.5.1-values.yaml").read_text())
    ours = yaml.safe_load((CLUSTER / "kuberay-operator.values.yaml").read_text())
    _keys_exist(ours, chart)
    assert ours["image"]["tag"] == chart["image"]["tag"] == "v1.5.1"
    assert "--version 1.5.1" in README and "kuberay-operator.values.yaml" in README


def test_eksctl_config_matches_the_efa_manifest():
    eks = yaml.safe_load((CLUSTER / "eks-cluster.yaml").read_text())
    assert eks["apiVersion"] == "eksctl.io/v1alpha5" and eks["kind"] == "ClusterConfig"
    (gpu,) = [g for g in eks["managedNodeGroups"] if g["instanceType"] == "p5.48xlarge"]
    assert gpu["efaEnabled"] is True and len(gpu["availabilityZones"]) == 1 and gpu["privateNetworking"]
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in gpu["taints"]
    pages = int(re.search(r"vm\.nr_hugepages=(\d+)", gpu["overrideBootstrapCommand"])[1])
    manifest = yaml.safe_load((CLUSTER / "ray-cluster.eks-efa.yaml").read_text())
    (p5,) = [g for g in manifest["spec"]["workerGroupSpecs"]
             if g["template"]["spec"].get("nodeSelector", {}).get("node.kubernetes.io/instance-type") == "p5.48xlarge"]
    asked = quantity(p5["template"]["spec"]["containers"][0]["resources"]["limits"]["hugepages-2Mi"])
    assert pages * 2 * 2**20 >= asked  # one GPU pod per node
    assert gpu["maxSize"] >= p5["maxReplicas"]
    # Every instance type the manifest selects has a node group.
    types_ = {g["instanceType"] for g in eks["managedNodeGroups"]}
    for g in groups(manifest["spec"]):
        sel = g["template"]["spec"].get("nodeSelector", {}).get("node.kubernetes.io/instance-type")
        assert sel is None or sel in types_


def gke_allocatable_gib(memory_gb: float) -> float:
    """GKE's allocatable memory: less kube-reserved (25% of the first 4 GB, 20% of the next 4, 10%
    of the next 8, 6% of the next 112, 2% above) and the 100 MiB eviction threshold."""
    tiers, left, reserved = [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)], memory_gb, 0.0
    for size, share in tiers:
        reserved += min(left, size) * share
        left -= min(left, size)
        if left <= 0:
            break
    return (memory_gb - reserved) * GB / Gi - 100 / 1024


def test_gke_cpu_pool_fits_the_tcpx_manifests_cpu_pods():
    script = (CLUSTER / "gke-cluster.sh").read_text()
    machine = re.search(r"clusters create .*?--machine-type=(\S+)", script, re.S)[1]
    memory_gb = {"n2-standard-32": 128, "n2-highmem-32": 256}[machine]
    manifest = yaml.safe_load((CLUSTER / "ray-cluster.gke-tcpx.yaml").read_text())
    for g in groups(manifest["spec"]):
        res = g["template"]["spec"]["containers"][0]["resources"]["requests"]
        if "nvidia.com/gpu" not in res:
            assert quantity(res["memory"]) / Gi <= gke_allocatable_gib(memory_gb), (machine, res)
            assert float(res["cpu"]) <= 31.8  # 32 vCPU less GKE's CPU reservation
    assert gke_allocatable_gib(128) < 120  # why not n2-standard-32


def test_gke_script_is_valid_bash_and_makes_what_the_tcpx_manifest_names():
    subprocess.run(["bash", "-n", str(CLUSTER / "gke-cluster.sh")], check=True)
    script = (CLUSTER / "gke-cluster.sh").read_text()
    manifest = (CLUSTER / "ray-cluster.gke-tcpx.yaml").read_text()
    for i in range(1, 5):
        assert f"vpc{i}" in manifest and f"network=raypack-gpu-{i},subnetwork=raypack-gpu-{i}" in script
    for needle in ("--enable-multi-networking", "--enable-dataplane-v2", "a3-highgpu-8g",
                   "nvidia-h100-80gb,count=8", "nccl-tcpx-installer", "nri-device-injector"):
        assert needle in script


def test_reservations_merge_into_the_files_they_name():
    res = yaml.safe_load((CLUSTER / "reservations.yaml").read_text())
    for key, (launcher, node_type) in {"aws_capacity_block": ("aws-gpu.yaml", "gpu_p5"),
                                       "aws_capacity_reservation": ("aws-gpu.yaml", "gpu_p5"),
                                       "gcp_reservation": ("gcp-gpu.yaml", "gpu_a3")}.items():
        config = yaml.safe_load((CLUSTER / launcher).read_text())
        config["available_node_types"][node_type]["node_config"].update(res[key])
        validate_config(prepare_config(config))
    assert res["aws_capacity_block"]["InstanceMarketOptions"]["MarketType"] == "capacity-block"
    assert re.fullmatch(r"cr-[0-9a-f]{17}", res["aws_capacity_block"]["CapacityReservationSpecification"]
                        ["CapacityReservationTarget"]["CapacityReservationId"])
    assert res["gcp_reservation"]["reservationAffinity"]["consumeReservationType"] == "SPECIFIC_RESERVATION"
    assert "capacityReservationTarget" in res["eksctl_capacity_reservation"]["capacityReservation"]


# --- the NCCL smoke job -----------------------------------------------------------------------------


def test_nccl_smoke_reads_the_transport_from_nccls_log():
    smoke = module(REPO / "jobs" / "nccl_smoke.py", "raypack_nccl_smoke")
    efa = ("host:1:1 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 32 nics)\n"
           "host:1:1 [0] NCCL INFO Using network AWS Libfabric\n")
    assert smoke.transport(efa) == "efa"
    assert smoke.transport(efa.replace("provider is efa", "provider is tcp")) == "ofi-tcp"
    assert smoke.transport("NCCL INFO NET/GPUDirectTCPX ver. 3.1.12.\nNCCL INFO Using network GPUDirectTCPX\n") == "tcpx"
    assert smoke.transport("NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\nNCCL INFO Using network Socket\n") == "socket"
    assert smoke.transport("NCCL INFO Using network IB\n") == "ib"
    assert smoke.transport("") == "unknown"
    # nccl-tests' bus bandwidth: 1 GB all-reduced in 0.1 s over 16 ranks.
    assert abs(smoke.bus_bandwidth(10**9, 0.1, 16) - 18.75) < 1e-9


@pytest.mark.parametrize("name,fabric,cluster", [("ray-job.nccl-smoke.yaml", "efa", "ray-cluster.eks-efa.yaml"),
                                                  ("ray-job.gke.yaml", "tcpx", "ray-cluster.gke-tcpx.yaml")])
def test_the_nccl_smoke_job_runs_on_each_fabric(name, fabric, cluster):
    job = yaml.safe_load((CLUSTER / name).read_text())
    words = shlex.split(job["spec"]["entrypoint"])
    if "&&" in job["spec"]["entrypoint"]:
        # KubeRay pastes the entrypoint unquoted into the submitter's shell command (common/job.go,
        # BuildJobSubmitCommand): a bare && would run the rest in the submitter pod.
        assert words[:2] == ["bash", "-c"] and len(words) == 3, words
        smoke, train = words[2].split("&&")
        assert train.split()[:2] == ["python", "jobs/sft.py"]
    else:
        smoke = job["spec"]["entrypoint"]
    assert f"python jobs/nccl_smoke.py --nodes 2 --expect {fabric}" == smoke.strip()
    target = yaml.safe_load((CLUSTER / cluster).read_text())
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == target["metadata"]["name"]
    gpu = [g for g in target["spec"]["workerGroupSpecs"]
           if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert gpu and gpu[0]["maxReplicas"] >= 2


# --- the fake-autoscaler runner, and memory.py without the training stack ----------------------------------


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_fake_autoscaler_config_is_the_launchers_node_types(path):
    fa = module(CLUSTER / "fake_autoscale.py", "raypack_fake_autoscale")
    launcher = yaml.safe_load(path.read_text())
    config, head = fa.fake_config(launcher, "127.0.0.1:1")
    head_type = launcher["head_node_type"]
    assert head == {k: v for k, v in launcher["available_node_types"][head_type]["resources"].items() if k != "memory"}
    for name, t in launcher["available_node_types"].items():
        if name == head_type:
            continue
        fake = config["available_node_types"][name]
        assert fake["resources"] == {k: v for k, v in t["resources"].items() if k != "memory"}
        assert (fake["min_workers"], fake["max_workers"]) == (t.get("min_workers", 0), t["max_workers"])
    validate_config(copy.deepcopy(config))  # (prepare_config wants fake_multi_node/example.yaml, not in the wheel)
    # Every shipped GPU config the runner asks for exists.
    for name in fa.GPU_CONFIGS:
        assert (REPO / "jobs" / "configs" / name).is_file()


def test_fake_autoscaler_ports_are_distinct_free_and_outside_the_ephemeral_range():
    """Two bind(0) picks can answer the same port: a CI run gave the raylet and the Ray client
    server both 42133, `ray start` refused, and the driver retried the missing GCS for 420 s."""
    fa = module(CLUSTER / "fake_autoscale.py", "raypack_fake_autoscale")
    low, _ = fa._ephemeral_range()
    for _ in range(50):
        ports = fa.pick_ports(4)
        assert len(set(ports)) == 4 and (low < 21000 or all(20000 <= p < low for p in ports)), ports
        assert all(fa._bindable(p) for p in ports)


def test_fake_autoscaler_ends_the_heads_group_and_what_names_its_temp_dir(tmp_path):
    """What a run started goes, however it ended: the head's process group by its id, a process
    that left the group but names the temp dir, and the temp dir; not a process group whose
    leader does not name it (a pid the kernel gave to someone else)."""
    fa = module(CLUSTER / "fake_autoscale.py", "raypack_fake_autoscale")
    workdir = tmp_path / "rpfake-x"
    workdir.mkdir()
    sleeper = f"import time; time.sleep(120)  # {workdir}"
    head = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                             f"{sleeper!r}]); time.sleep(120)  # {workdir}"], start_new_session=True)
    outside = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)  # left the group
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60  # until the head's child and the outsider run their own command lines
        while True:
            group = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == head.pid]
            named = [p for p in group + [psutil.Process(outside.pid)] if str(workdir) in " ".join(_cmdline(p))]
            if len(named) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(group) == 2 and len(named) == 3, (group, named)
        fa.end_processes(stranger.pid, workdir / "elsewhere")  # its leader names no such dir: untouched
        assert stranger.poll() is None
        left = fa.end_processes(head.pid, workdir)
        assert left == [outside.pid] and not workdir.exists()
        assert all(_gone(p.pid) for p in group) and _gone(outside.pid)
    finally:
        for p in (head, outside, stranger):
            p.kill()
            p.wait()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_memory_py_runs_without_the_training_stack():
    """A user sizing a cluster needs raypack's config and arithmetic only: no torch, transformers,
    deepspeed or ray (each made unimportable here)."""
    code = (
        "import sys, runpy\n"
        "for m in ('torch', 'transformers', 'deepspeed', 'ray', 'peft', 'datasets'): sys.modules[m] = None\n"
        f"sys.argv = [{str(CLUSTER / 'memory.py')!r}]\n"
        f"runpy.run_path({str(CLUSTER / 'memory.py')!r}, run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| config |" in out.stdout
    # ... the tables it prints with the training stack, which test_memory.py keeps in the README.
    for table in re.split(r"\n\s*\n", out.stdout.strip()):
        if table.startswith("| config |") or table.startswith("| model |"):
            assert table.strip() in README, table[:200]
