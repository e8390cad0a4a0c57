"""tools/gpu_wheels.py works out what a GPU machine needs beside its image from the lock (this venv's
metadata is the lock's), and `make gpu-check` checks on the machine what it could only assume
(tools/bench_gpu.py). No download here: every root is installed in this venv. The whole kit is
rehearsed by `make gpu-rehearsal` (a Python 3.12 venv of the image's packages, offline)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement

from paths import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_gpu  # noqa: E402
import gpu_wheels  # noqa: E402

LOCK = gpu_wheels.read_lines(REPO / "constraints.txt")


def closure(monkeypatch, roots: list[str], image: dict[str, str | None]):
    monkeypatch.setattr(gpu_wheels, "roots", lambda: [Requirement(r) for r in roots])
    return gpu_wheels.closure(image, gpu_wheels.Metadata(LOCK))


def test_a_package_travels_unless_the_image_holds_a_version_every_requirement_allows(monkeypatch):
    v = importlib.metadata.version
    image = {"transformers": "5.17.0", "numpy": "2.5.2", "pyyaml": None, "huggingface-hub": v("huggingface_hub")}
    nodes, provided = closure(monkeypatch, ["transformers>=5.23,<6", "numpy>=2.0", "pyyaml>=6.0"], image)
    assert not provided["transformers"], "the image's 5.17 is outside raypack's >=5.23"
    assert nodes["transformers"].version == LOCK["transformers"] and nodes["transformers"].wanted["raypack"] == "<6,>=5.23"
    assert provided["numpy"] and provided["pyyaml"], "a newer numpy that the ranges allow; an unversioned name"
    # transformers travels, so its own requirements are walked: those the image lacks travel too
    assert "tokenizers" in nodes and not provided["tokenizers"]
    assert nodes["numpy"].wanted["transformers"], "what transformers asks of numpy is recorded for the check on the machine"


def test_the_image_packages_are_not_walked_into(monkeypatch):
    """What the image provides brings its own dependencies: none of them is walked or carried."""
    nodes, provided = closure(monkeypatch, ["transformers>=5.23,<6"], {"transformers": None})
    assert provided == {"transformers": True} and list(nodes) == ["transformers"]


def test_never_imported_requirements_are_left_out_with_what_only_they_need(monkeypatch):
    nodes, _ = closure(monkeypatch, ["ray[default]>=2.60,<2.61"], {})
    assert "aiohttp-cors" in nodes and "opencensus" in nodes, "the dashboard's packages travel"
    for name in ("virtualenv", "py-spy", "google-auth", "cryptography", "smart-open", "distlib"):
        assert name not in nodes, name
    assert "googleapis-common-protos" in nodes, "opencensus imports google.rpc: it stays"


def test_the_image_list_is_read_with_and_without_versions():
    image = gpu_wheels.read_lines(REPO / "tools" / "gpu_image_packages.txt")
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"
    assert "pyarrow" in image and image["pyarrow"] is None and "ray" not in image and "deepspeed" not in image


def test_a_rewritten_wheel_drops_what_it_is_told_and_keeps_a_valid_record(tmp_path):
    src, dest = tmp_path / "pkg-1.0-py3-none-any.whl", tmp_path / "out" / "pkg-1.0-py3-none-any.whl"
    dest.parent.mkdir()
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/big/data.bin", b"x" * 1000)
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    assert gpu_wheels.rewrite(src, dest, lambda name: name.startswith("pkg/big/")) == 1
    with zipfile.ZipFile(dest) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert record[0].startswith("pkg/__init__.py,sha256=") and record[-1] == "pkg-1.0.dist-info/RECORD,,"


@pytest.mark.skipif(not shutil.which("gcc") or not shutil.which("strip"), reason="needs gcc and binutils' strip")
def test_a_stripped_wheel_keeps_its_programs_running_and_its_other_files_as_they_were(tmp_path):
    """STRIP's rewrite: an ELF member loses its symbol table and still runs; the rest is byte for byte."""
    source = tmp_path / "hello.c"
    source.write_text('#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n')
    subprocess.run(["gcc", "-g", "-o", str(tmp_path / "hello"), str(source)], check=True)
    program = (tmp_path / "hello").read_bytes()
    src, dest = tmp_path / "pkg-1.0-py3-none-any.whl", tmp_path / "out" / "pkg-1.0-py3-none-any.whl"
    dest.parent.mkdir()
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "VALUE = 1\n")
        z.writestr("pkg/bin/hello", program)
        z.writestr("pkg-1.0.dist-info/RECORD", "")
    assert gpu_wheels.rewrite(src, dest, lambda name: False, strip=True) == 0
    with zipfile.ZipFile(dest) as z:
        assert z.read("pkg/__init__.py") == b"VALUE = 1\n"
        stripped = z.read("pkg/bin/hello")
    assert len(stripped) < len(program) and b".symtab" in program and b".symtab" not in stripped
    (tmp_path / "stripped").write_bytes(stripped)
    (tmp_path / "stripped").chmod(0o755)
    assert subprocess.run([str(tmp_path / "stripped")], capture_output=True, text=True).stdout == "hello\n"


def test_import_time_models_are_only_what_runs_on_import():
    text = ("from transformers.models.llama import modeling_llama\n"
            "try:\n    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model\nexcept ImportError:\n    pass\n"
            "def apply():\n    from transformers.models.mixtral import modeling_mixtral\n")  # fmt: skip
    assert gpu_wheels.import_time_models(text) == {"llama", "qwen3"}


@pytest.mark.parametrize("installed,unmet", [(True, []), (False, ["numpy"])])
def test_requirements_the_image_must_meet_are_checked_on_the_machine(tmp_path, installed, unmet):
    numpy = importlib.metadata.version("numpy")
    wanted = f">={numpy}" if installed else f">{numpy}"
    path = tmp_path / "requirements.json"
    path.write_text(json.dumps({"numpy": {"version": None, "wanted": {"raypack": wanted, "ray": ""}}}))
    lines = bench_gpu.unmet_requirements(path)
    assert [line.split()[0] for line in lines] == unmet
    if unmet:
        assert f"raypack needs {wanted}" in lines[0]


def test_the_hybrid_kernels_that_fit_travel_as_roots():
    """fla-core (flash-linear-attention's ops: the gated delta rule's Triton kernels, pure Python)
    is a root of the kit beside raypack's own requirements, which don't name it."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert {Requirement(k).name for k in gpu_wheels.KERNELS} == {"fla-core"}
    assert "fla-core" in {r.name for r in gpu_wheels.roots()}
    assert not any(Requirement(r).name == "fla-core" for r in project["dependencies"])
