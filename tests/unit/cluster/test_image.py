"""The lock (constraints.txt) pins versions inside pyproject.toml's ranges, and both the dev setup
(`make setup`, hence CI) and the cluster image install with it; the image builds DeepSpeed's ops in
and ships raypack as a package whose DeepSpeed presets resolve from an installed wheel. No Docker
engine runs here: the recipe is checked as text, the wheel is built and imported for real.

What is checked is the lock itself, against pyproject.toml and the recipes that read it, never the
live environment against the lock: a newer release of a dependency must not fail this suite
(`make test-latest` is where it is found)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
DOCKERFILE = (DOCKER / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

sys.path.insert(0, str(DOCKER))
import check_image  # noqa: E402

PINS = check_image.pins()
MAKEFILE = (REPO / "Makefile").read_text()
LOCKED_EXTRAS = ("dev", "bench", "tracking", "optuna", "peft", "docs")
"""The extras tools/lock.sh installs to make the lock (its LOCK_EXTRAS). Not locked: `flash` (needs CUDA to
build) and `liger` (Triton on CUDA: the CUDA torch's own Triton, which a lock made with the CPU torch can't pin)."""


def requirements(extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in check_image.requirements(extras)]
    return {check_image.normalize(r.name): r for r in reqs}


def test_every_dependency_is_pinned_inside_pyprojects_range():
    for name, req in requirements(LOCKED_EXTRAS).items():
        assert name in PINS, f"{name} is a dependency but constraints.txt does not pin it"
        assert req.specifier.contains(Version(PINS[name]), prereleases=False), (
            f"{name}=={PINS[name]} is outside pyproject.toml's {req.specifier}")
    assert set(check_image.IMAGE_EXTRAS) <= set(LOCKED_EXTRAS)
    assert set(PYPROJECT["project"]["optional-dependencies"]) - set(LOCKED_EXTRAS) == {"flash", "liger"}


INSTALLER = {"pip": "", "setuptools": "", "wheel": ""}.keys()
"""What `pip freeze` leaves out by design: the installer's own packages, which every venv has."""


def test_the_lock_is_closed_under_dependencies():
    """Whatever a pinned package needs is pinned too, so no version is left to the day of install.
    Read from the installed packages' metadata (names only: this checks the lock, not the venv)."""
    from packaging.markers import default_environment

    env = {**default_environment(), "extra": ""}
    missing = []
    for name in PINS:
        try:
            if importlib.metadata.version(name).split("+")[0] != PINS[name].split("+")[0]:
                continue  # another version's needs (make test-latest's venv) say nothing of the pinned one's
            needs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # pinned for an extra or platform this venv does not have
        for raw in needs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate(env):
                if check_image.normalize(req.name) not in PINS | INSTALLER:
                    missing.append(f"{name} needs {req.name}")
    assert not missing, missing


def test_the_dev_setup_and_the_image_install_with_the_lock():
    # make setup (make run, make test and CI) takes every version but torch's from the lock...
    assert "LOCK   := constraints.txt" in MAKEFILE
    assert "grep -v '^torch==' $(LOCK) > .cache/constraints-without-torch.txt" in MAKEFILE
    assert '$(BIN)/pip install -q -c .cache/constraints-without-torch.txt -e ".[dev]"' in MAKEFILE
    # ...and torch at the lock's version unless a CUDA box asks for another
    assert re.search(r"^TORCH\s+\?= torch==(\S+)$", MAKEFILE, re.M)[1] == PINS["torch"]
    assert "make lock" in (REPO / "tools" / "lock.sh").read_text()


def test_check_image_fails_on_a_drifted_pin(tmp_path):
    have = importlib.metadata.version("torch")
    assert check_image.version_mismatches({"torch": "2.11.0"}) == [f"torch: installed {have}, pinned 2.11.0"]
    # pinned but not installed: an error only when the image needs it
    assert check_image.version_mismatches({"no-such-package-here": "1.0"}) == []
    assert check_image.version_mismatches({"no-such-package-here": "1.0"}, ("no-such-package-here",))
    assert check_image.version_mismatches({}, ("torch",)) == ["torch: required but not pinned by constraints.txt"]
    loose = tmp_path / "constraints.txt"
    loose.write_text("torch>=2.11\n")
    with pytest.raises(ValueError, match="not an exact pin"):
        check_image.pins(loose)


def _runs() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def _requirements_of(cmd: str) -> list[str]:
    """What one `pip install ...` command asks for: its arguments that are not options."""
    tokens = shlex.split(cmd.split("pip install", 1)[1])
    reqs, skip = [], False
    for t in tokens:
        if skip:
            skip = False
        elif t in ("-c", "-r", "-w", "--index-url", "--extra-index-url"):
            skip = True
        elif not t.startswith("-"):
            reqs.append(t)
    return reqs


BUILD_TOOLS = {"ninja", "packaging", "setuptools", "wheel"}


def test_every_pip_install_takes_its_version_from_the_constraints_file():
    installs = [cmd for run in _runs() for cmd in re.split(r"&&|;", run) if "pip install" in cmd]
    assert installs
    for cmd in installs:
        for req in _requirements_of(cmd):
            if req == ".":
                assert "--no-deps" in cmd, "raypack goes in after its pinned dependencies, adding none"
                continue
            sed_pin = re.fullmatch(r"([\w-]+)==\$\(sed -n 's/\^\1==//p' constraints\.txt\)", req)
            assert sed_pin or req in BUILD_TOOLS, f"not pinned by constraints.txt: {req!r} in {cmd.strip()}"
        if any(r not in BUILD_TOOLS | {"."} for r in _requirements_of(cmd)) or "-r " in cmd:
            # Whatever else resolves must resolve at the pins too (torch's own index has none).
            assert "-c constraints.txt" in cmd or "--index-url" in cmd, cmd
    assert any("torch==$(sed" in c and "--index-url" in c for c in installs), "torch from the CUDA index"
    assert any("deepspeed==$(sed" in c for c in installs)
    # raypack's requirements and the image's extras, from pyproject.toml, at the lock's versions
    extras = ",".join(check_image.IMAGE_EXTRAS)
    assert f"python docker/check_image.py --requirements {extras} > /tmp/requirements.txt" in DOCKERFILE
    assert any("-c constraints.txt -r /tmp/requirements.txt" in c for c in installs)


def test_cuda_flavour_is_consistent():
    base = re.search(r"ARG BASE_IMAGE=rayproject/ray:(\S+)-py311-(cu\d+)", DOCKERFILE)
    index = re.search(r"ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/(cu\d+)", DOCKERFILE)
    assert base and index
    assert base[1] == PINS["ray"], "the base image's Ray is the pinned Ray"
    assert base[2] == index[1], "nvcc in the base must match torch's CUDA for DeepSpeed's op build"


def test_deepspeed_ops_are_prebuilt_for_hopper():
    assert "DS_BUILD_CPU_ADAM=1" in DOCKERFILE and "DS_BUILD_FUSED_ADAM=1" in DOCKERFILE
    assert "DS_ACCELERATOR=cuda" in DOCKERFILE, "no GPU at build time: DeepSpeed must not pick the CPU"
    arch = re.search(r"ARG TORCH_CUDA_ARCH_LIST=(\S+)", DOCKERFILE)[1]
    assert "9.0" in arch.split(";") and not re.search(r"\d\.\d+a", arch), "op_builder cannot parse 9.0a"
    assert set(check_image.PREBUILT_OPS) == {"cpu_adam", "fused_adam"}
    assert DOCKERFILE.rstrip().endswith("python docker/check_image.py --image"), "the build ends by checking itself"


def test_build_context_has_what_the_dockerfile_copies():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "everything else (.venv, results) stays out of the context"
    copied = set()
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY"):
            copied |= {s for s in line.split()[1:-1] if not s.startswith("--")}
    assert copied <= allowed, copied - allowed


def test_every_cluster_file_runs_this_image():
    version = PYPROJECT["project"]["version"]
    cu = re.search(r"ARG TORCH_INDEX_URL=\S+/whl/(cu\d+)", DOCKERFILE)[1]
    tag = f"raypack:{version}-{cu}"
    images = set()
    # The files that run Ray (launchers, KubeRay manifests); the others (eksctl, Helm values,
    # ServiceAccount, reservations) start no Ray container.
    cluster = REPO / "cluster"
    for path in sorted([*cluster.glob("*-gpu.yaml"), *cluster.glob("ray-*.yaml")]):
        text = path.read_text()
        found = set(re.findall(r"image:\s*(\S+/raypack:\S+)", text))
        assert found, f"{path.name} names no raypack image"
        images |= found
        assert "rayproject/ray" not in yaml.safe_dump(yaml.safe_load(text)), f"{path.name}: stock Ray image"
    assert {i.rsplit("/", 1)[1] for i in images} == {tag}, images


def test_presets_ship_in_the_wheel_and_load_from_it(tmp_path):
    # Build from a copy, so the worktree gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "raypack", src / "raypack", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("raypack-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (REPO / "raypack" / "configs" / "deepspeed").glob("*.json"))
    assert shipped and all(f"raypack/configs/deepspeed/{n}" in names for n in shipped)
    # Import raypack from the unpacked wheel only (cwd and path away from the source tree).
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import json, raypack.train.presets as e; assert str(e.PRESETS).startswith(%r), e.PRESETS; "
            "print(json.dumps(e.load_preset('zero3')))" % str(site))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["zero_optimization"]["stage"] == 3
