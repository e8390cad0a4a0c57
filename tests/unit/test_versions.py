"""raypack/versions.py: the ranges are pyproject.toml's, and a job on a cluster with another Ray
says so in one line, before Ray starts."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from packaging.requirements import Requirement

from paths import REPO
from raypack import versions


def pyproject_ranges() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["peft"]]
    assert project["requires-python"] == ">=" + ".".join(map(str, versions.PYTHON))
    return {r.name: str(r.specifier) for r in reqs}


def test_the_ranges_are_pyprojects():
    ranges = pyproject_ranges()
    for name, spec in {**versions.SUPPORTED, **versions.OPTIONAL}.items():
        assert sorted(spec.split(",")) == sorted(ranges[name].split(",")), name


def test_each_problem_is_named_with_both_versions():
    have = {"ray": "2.50.1", "torch": "2.13.0+cpu", "transformers": "5.24.0", "datasets": "5.2.0", "pyarrow": "26.0.0",
            "deepspeed": "0.18.0"}  # fmt: skip
    found = versions.problems(have.get, python=(3, 11, 9))
    assert len(found) == 2, found
    assert found[0].startswith("its ray is 2.50.1, and raypack needs ray>=2.55,<2.61: submit it to a cluster on the "
                               "raypack image"), found[0]  # fmt: skip
    assert found[1].startswith("its deepspeed is 0.18.0, and raypack needs deepspeed>=0.19.8,<0.20: install"), found[1]
    assert versions.problems({**have, "ray": "2.60.1", "deepspeed": "0.19.8"}.get, python=(3, 11, 9)) == []
    assert versions.problems({**have, "ray": "2.55.1", "deepspeed": "0.19.8"}.get, python=(3, 11, 9)) == []  # the oldest tested
    without_deepspeed = {**have, "ray": "2.60.1", "deepspeed": None}
    assert versions.problems(without_deepspeed.get, python=(3, 11)) == []  # optional: the run's own business
    missing = versions.problems({**have, "ray": "2.60.0", "deepspeed": "0.19.9", "pyarrow": None}.get, python=(3, 9, 1))
    assert missing == ["its Python is 3.9.1, and raypack needs Python >= 3.10",
                       "it has no pyarrow installed, and raypack needs pyarrow>=26,<27"]


def test_a_job_on_a_cluster_with_another_ray_stops_in_one_line_before_ray_starts(tmp_path):
    """`python jobs/sft.py` as `ray job submit` runs it on a cluster whose Ray is 2.50 (a
    distribution record found first on the path, as the cluster's own would be)."""
    fake = tmp_path / "site" / "ray-2.50.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 2.50.1\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "jobs/sft.py", "--config", "jobs/configs/tiny_cpu.yaml"], cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [lines[0]] and re.match(r"\[raypack\] error: this cluster: its ray is 2\.50\.1, and raypack needs "
                                            r"ray>=2\.55,<2\.61: submit it to a cluster on the raypack image", lines[0]), out.stderr
    assert "started a local Ray" not in out.stdout and time.perf_counter() - t0 < 30
