"""The import graph runs one way, and the GPU-side modules import without Ray or DeepSpeed.

    cli ──> commands ──> tune ──> train ──> data, model ──> config, storage
                         runtime (Ray start-up, run paths): used by commands, train and tune

Library modules take typed configs; only the command layer (cli.py, commands/) sees argparse.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import raypack

PACKAGE = Path(raypack.__file__).parent
COMMAND_LAYER = ("raypack.cli", "raypack.commands")
NEVER_IMPORTS = {
    # a module under the key imports nothing under any of the values
    "raypack.data": ("raypack.train", "raypack.tune", "raypack.runtime", *COMMAND_LAYER),
    "raypack.model": ("raypack.data", "raypack.train", "raypack.tune", "raypack.runtime", *COMMAND_LAYER),
    "raypack.train": ("raypack.tune", *COMMAND_LAYER),
    "raypack.tune": COMMAND_LAYER,
    "raypack.runtime": COMMAND_LAYER,
    "raypack.config": ("raypack.",),
    "raypack.storage": ("raypack.",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, at the top or inside a function (both are edges of the graph)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from raypack import storage`
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_one_way(name):
    for layer, forbidden in NEVER_IMPORTS.items():
        if _under(name, layer):
            bad = sorted(m for m in imports_of(name) for f in forbidden if _under(m, f) and m in MODULES)
            assert not bad, f"{name} imports {bad}"
    if not any(_under(name, layer) for layer in COMMAND_LAYER):
        bad = sorted(m for m in imports_of(name) if any(_under(m, layer) for layer in COMMAND_LAYER))
        assert not bad, f"{name} imports the command layer: {bad}"
        assert "argparse" not in imports_of(name), f"{name} parses arguments; that is the command layer's job"


def test_the_graph_check_sees_imports():
    """Guard the guard: the walk finds known edges, top-level, relative and inside functions."""
    assert "raypack.data.plan" in imports_of("raypack.data.strategies")
    assert "raypack.storage" in imports_of("raypack.runtime")
    assert "raypack.data.tokenize" in imports_of("raypack.commands.plan")  # imported inside a function


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_gpu_side_modules_import_without_ray():
    """The attention and loss benchmarks and the GPU tests run where Ray and DeepSpeed are not installed."""
    code = (
        "import sys, raypack.model.build, raypack.model.attention, raypack.data.collate, raypack.data.synthetic,"
        " raypack.train.loss, raypack.train.prefetch;"
        "bad = [m for m in ('ray', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
