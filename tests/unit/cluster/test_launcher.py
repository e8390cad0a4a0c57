"""The cluster launcher files pass Ray's own `prepare_config` and `validate_config`, and every
node type declares the resources its provider would not fill in, checked with the providers' own
`fillout_available_node_types_resources`. Nothing here reaches a cloud."""

from __future__ import annotations

import copy
import importlib
import re
import types
from pathlib import Path
from unittest import mock

import jsonschema
import pytest
import yaml
from cloudstubs import stub_sdks
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "cluster"
LAUNCHERS = sorted(CLUSTER.glob("*-gpu.yaml"))
GiB = 2**30

# What the machines have (AWS and GCP machine-type pages): the declared resources must fit them.
MACHINES = {
    "m7i.4xlarge": {"CPU": 16, "GPU": 0, "mem": 64 * GiB},
    "m7i.8xlarge": {"CPU": 32, "GPU": 0, "mem": 128 * GiB},
    "p5.48xlarge": {"CPU": 192, "GPU": 8, "mem": 2048 * GiB},
    "n2-standard-16": {"CPU": 16, "GPU": 0, "mem": 64 * 10**9},
    "n2-standard-32": {"CPU": 32, "GPU": 0, "mem": 128 * 10**9},
    "a3-highgpu-8g": {"CPU": 208, "GPU": 8, "mem": 1872 * 10**9},
}


def _id(p: Path) -> str:
    return p.name


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def machine(node_type: dict) -> str:
    cfg = node_type["node_config"]
    return cfg.get("InstanceType") or cfg["machineType"]


def worker_types(config: dict) -> dict[str, dict]:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_prepare_and_validate_with_ray(path):
    prepared = prepare_config(copy.deepcopy(load(path)))
    validate_config(prepared)
    assert prepared["provider"]["type"] in ("aws", "gcp")


def test_ray_validation_can_fail():
    bad = load(CLUSTER / "aws-gpu.yaml")
    bad["available_node_types"]["gpu_p5"]["resourcez"] = bad["available_node_types"]["gpu_p5"].pop("resources")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))
    bad = load(CLUSTER / "gcp-gpu.yaml")
    bad["available_node_types"]["gpu_a3"]["resources"]["memory"] = "1600Gi"  # Ray wants bytes, an int
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_declared_resources_fit_the_machine(path):
    config = load(path)
    for name, node_type in config["available_node_types"].items():
        have = MACHINES[machine(node_type)]
        res = node_type["resources"]
        if name == config["head_node_type"]:
            assert res == {"CPU": 0}, "no training on the head"
            continue
        assert res["CPU"] == have["CPU"], name
        assert res.get("GPU", 0) == have["GPU"], name
        assert 0 < res["memory"] <= 0.85 * have["mem"], f"{name}: leave room for the object store and OS"
        if have["GPU"]:
            assert res["accelerator_type:H100"] == 1


# --- the providers' own autodetection ----------------------------------------------------------


@pytest.fixture
def providers():
    """(AWSNodeProvider, GCPNodeProvider), imported with stub SDKs where the real ones are absent;
    sys.modules is restored afterwards."""
    roots = [r for r in ("boto3", "botocore", "googleapiclient", "google_auth_httplib2", "httplib2", "google")
             if importlib.util.find_spec(r) is None]
    if importlib.util.find_spec("google") is not None and importlib.util.find_spec("google.oauth2") is None:
        roots.append("google.oauth2")
    with stub_sdks(roots):
        aws = importlib.import_module("ray.autoscaler._private.aws.node_provider")
        gcp = importlib.import_module("ray.autoscaler._private.gcp.node_provider")
        yield aws, gcp


def test_gcp_autodetects_nothing_so_every_type_declares_cpu_gpu_memory(providers):
    _, gcp = providers
    config = load(CLUSTER / "gcp-gpu.yaml")
    # What the provider fills in for a3 / n2 machines when nothing is declared: nothing (only TPUs).
    bare = copy.deepcopy(config)
    for node_type in worker_types(bare).values():
        node_type["resources"] = {}
    filled = gcp.GCPNodeProvider.fillout_available_node_types_resources(bare)
    assert all(t["resources"] == {} for t in worker_types(filled).values())
    # So the shipped file declares them, and they survive the fill-out.
    filled = gcp.GCPNodeProvider.fillout_available_node_types_resources(copy.deepcopy(config))
    for name, node_type in worker_types(filled).items():
        assert {"CPU", "memory"} <= set(node_type["resources"]), name
        if MACHINES[machine(node_type)]["GPU"]:
            assert node_type["resources"]["GPU"] == 8, name


def _describe(instance_type: str) -> dict:
    have = MACHINES[instance_type]
    entry = {"InstanceType": instance_type, "VCpuInfo": {"DefaultVCpus": have["CPU"]},
             "MemoryInfo": {"SizeInMiB": have["mem"] // 2**20}}
    if have["GPU"]:
        entry["GpuInfo"] = {"Gpus": [{"Name": "H100", "Count": have["GPU"], "Manufacturer": "NVIDIA"}]}
    return entry


def test_aws_declared_resources_hold_with_or_without_autodetection(providers):
    aws, _ = providers
    config = load(CLUSTER / "aws-gpu.yaml")
    fill = aws.AWSNodeProvider.fillout_available_node_types_resources
    # Autodetection needs ec2:DescribeInstanceTypes from the machine running `ray up`. When that
    # fails, `ray up` only warns and keeps what the file declares: it must be complete.
    with mock.patch.object(aws, "list_ec2_instances", side_effect=RuntimeError("no credentials")):
        with pytest.raises(RuntimeError):
            fill(copy.deepcopy(config))
    for name, node_type in worker_types(config).items():
        assert {"CPU", "memory"} <= set(node_type["resources"]), name
        if MACHINES[machine(node_type)]["GPU"]:
            assert node_type["resources"]["GPU"] == 8
    # When it works, the declared values win and agree with what EC2 reports.
    listing = [_describe(machine(t)) for t in config["available_node_types"].values()]
    with mock.patch.object(aws, "list_ec2_instances", return_value=listing):
        filled = fill(copy.deepcopy(config))
    for name, node_type in config["available_node_types"].items():
        assert filled["available_node_types"][name]["resources"] == {
            **filled["available_node_types"][name]["resources"], **node_type["resources"]}
    gpu = filled["available_node_types"]["gpu_p5"]["resources"]
    assert gpu["GPU"] == 8 and gpu["CPU"] == 192 and gpu["accelerator_type:H100"] == 1


# --- what the nodes need ---------------------------------------------------------------------


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_every_node_type_is_there(path):
    config = load(path)
    kinds = {("gpu" if MACHINES[machine(t)]["GPU"] else "cpu") for t in worker_types(config).values()}
    assert kinds == {"cpu", "gpu"}, "a CPU worker type keeps tokenizing and dry runs off GPU nodes"


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_image_not_setup_commands(path):
    config = load(path)
    assert re.fullmatch(r"\S+/raypack:\d+\.\d+\.\d+-cu\d+", config["docker"]["image"])
    assert not config.get("setup_commands"), "dependencies come from the image, not pip at boot"
    assert "rayproject/ray" not in path.read_text().split("docker:")[1].split("provider:")[0]


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_gpu_nodes_wait_for_the_driver_and_stage_on_local_disk(path):
    config = load(path)
    for name, node_type in worker_types(config).items():
        if not MACHINES[machine(node_type)]["GPU"]:
            assert "--runtime=runc" in node_type["docker"]["worker_run_options"], name
            continue
        init = " ".join(node_type["initialization_commands"])
        assert "nvidia-smi -L" in init and "timeout" in init and "exit 1" in init, f"{name}: no driver wait"
        opts = " ".join(node_type["docker"]["worker_run_options"])
        assert "--gpus all" in opts and "--env TMPDIR=/tmp" in opts and "--env HF_HOME=" in opts
        (tmp_mount,) = re.findall(r"-v (\S+):/tmp\b", opts)
        assert tmp_mount.startswith(("/opt/dlami/nvme", "/mnt/localssd")), "checkpoints staged on NVMe / local SSD"
        assert "IPC_LOCK" in opts and "memlock=-1" in opts


def test_aws_gpu_nodes_have_efa():
    node = load(CLUSTER / "aws-gpu.yaml")["available_node_types"]["gpu_p5"]
    nics = node["node_config"]["NetworkInterfaces"]
    assert [n["NetworkCardIndex"] for n in nics] == list(range(32))
    assert all(n["InterfaceType"] == "efa" for n in nics)
    assert len({n["SubnetId"] for n in nics}) == 1, "EFA traffic stays inside one subnet"
    assert node["node_config"]["Placement"]["GroupName"]
    opts = " ".join(node["docker"]["worker_run_options"])
    assert "--device=/dev/infiniband" in opts and "FI_PROVIDER=efa" in opts
    assert "resolve:ssm:/aws/service/deeplearning/ami/" in node["node_config"]["ImageId"]


def test_gcp_gpu_nodes_have_tcpx():
    node = load(CLUSTER / "gcp-gpu.yaml")["available_node_types"]["gpu_a3"]
    nics = node["node_config"]["networkInterfaces"]
    assert len(nics) == 5 and all(n["nicType"] == "GVNIC" for n in nics)
    assert not any("accessConfigs" in n for n in nics), "GPU nodes get no external IP"
    init = " ".join(node["initialization_commands"])
    assert "nccl-plugin-gpudirecttcpx" in init and "tcpgpudmarxd" in init
    opts = " ".join(node["docker"]["worker_run_options"])
    assert "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME" in opts and "/run/tcpx:/run/tcpx" in opts


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_security_groups_are_yours_not_the_launchers_default(path):
    config = load(path)
    if config["provider"]["type"] != "aws":
        pytest.skip("the GCP provider creates no firewall rules; README says which to make")
    # Without SecurityGroupIds the launcher creates a group that opens SSH to the whole internet.
    for name, node_type in config["available_node_types"].items():
        cfg = node_type["node_config"]
        groups = cfg.get("SecurityGroupIds") or [g for n in cfg.get("NetworkInterfaces", []) for g in n["Groups"]]
        assert groups, f"{name}: the launcher would create its default security group"
        assert "IamInstanceProfile" in cfg, name
