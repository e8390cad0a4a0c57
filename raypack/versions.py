"""The versions raypack needs, checked where a job starts on a cluster that raypack didn't install.

`pip install raypack` brings versions pyproject.toml allows. A job submitted with `ray job
submit --working-dir .` does not: its driver runs on the cluster's head with the cluster's own
Python and packages (the Ray of its image), and imports raypack from the uploaded folder. A
cluster on another Ray would fail late, in a worker, with a traceback about some moved internal.
`check()` says it at once, in one line naming both versions and what to do, before Ray or torch
is imported (jobs/*.py call it first). Imports only the standard library and `packaging`
(a dependency of transformers and of pip). SUPPORTED and OPTIONAL are pyproject.toml's ranges;
tests/unit/test_versions.py keeps them equal.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Callable

PYTHON = (3, 10)
"""pyproject.toml's requires-python (its lower bound)."""
SUPPORTED: dict[str, str] = {
    "ray": ">=2.55,<2.61",
    "torch": ">=2.11,<2.14",
    "transformers": ">=5.24,<5.26",
    "datasets": ">=5.2,<5.3",
    "pyarrow": ">=26,<27",
}
"""What a job's driver imports, as pyproject.toml's dependencies allow. DeepSpeed is checked by the
workers that import it (a run on the torch engine needs none)."""
OPTIONAL: dict[str, str] = {"deepspeed": ">=0.19.8,<0.20", "peft": ">=0.21,<0.23"}
"""Checked where installed: a version outside the range is refused; a missing one is the run's
own business (train.engine: torch needs no DeepSpeed; model.peft names peft where it is used)."""

HOW = {
    "ray": "submit it to a cluster on the raypack image (docker/Dockerfile's BASE_IMAGE; KubeRay: "
           "spec.rayVersion and the image tag, docs/guides/clusters.md) or one whose Ray is in range",
}  # fmt: skip


def problems(installed: Callable[[str], str | None] | None = None, python: tuple[int, ...] | None = None) -> list[str]:
    """What this environment lacks, one phrase each (empty: all good). `installed`: a package's
    version or None (default: the installed distributions'); `python`: sys.version_info."""
    from packaging.specifiers import SpecifierSet

    installed = installed or _installed
    python = python or tuple(sys.version_info[:3])
    found: list[str] = []
    if tuple(python[:2]) < PYTHON:
        found.append(f"its Python is {'.'.join(map(str, python))}, and raypack needs Python >= "
                     f"{'.'.join(map(str, PYTHON))}")
    for name, spec in {**SUPPORTED, **OPTIONAL}.items():
        version = installed(name)
        if version is None:
            if name in SUPPORTED:
                found.append(f"it has no {name} installed, and raypack needs {name}{spec}")
            continue
        if version.split("+")[0] not in SpecifierSet(spec):
            how = HOW.get(name, f"install {name}{spec} on every node (the cluster image, or the job's runtime_env pip)")
            found.append(f"its {name} is {version}, and raypack needs {name}{spec}: {how}")
    return found


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(where: str = "this cluster") -> None:
    """Exit with status 2 and one line per problem, naming `where`, if this environment can't run
    raypack; nothing otherwise."""
    found = problems()
    if found:
        for problem in found:
            print(f"[raypack] error: {where}: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
