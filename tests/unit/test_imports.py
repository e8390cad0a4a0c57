"""The import graph runs one way, has no cycle, and the GPU-side modules import without Ray or DeepSpeed.

    cli ──> commands ──> tune ──> train ──> data, model ──> config ──> typed, storage ──> errors
                                    └──> runs (run folders), runtime (Ray start-up) ──> config
                                                              └──> console (the screen)
    commands ──> runlock (a run folder's lock) ──> storage
    every layer ──> raycompat (Ray's internals, each with a fallback)

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
LAYERS = (
    ("raypack.errors", "raypack.raycompat", "raypack.versions"),
    ("raypack.console", "raypack.runlock", "raypack.storage", "raypack.typed"),
    ("raypack.config",),
    ("raypack.data", "raypack.model", "raypack.runs", "raypack.runtime"),
    ("raypack.train",),
    ("raypack.tune",),
    COMMAND_LAYER,
)
"""Bottom to top: a module imports from its own layer's package and from lower layers only."""
SIBLINGS_APART = {
    # packages of one layer that never import each other
    "raypack.data": ("raypack.model", "raypack.runs", "raypack.runtime"),
    "raypack.model": ("raypack.data", "raypack.runs", "raypack.runtime"),
    "raypack.runs": ("raypack.data", "raypack.model", "raypack.runtime"),
    "raypack.runtime": ("raypack.data", "raypack.model", "raypack.runs"),
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


def layer_of(name: str) -> tuple[int, str]:
    """(layer index, the package of that layer the module is under)."""
    for i, layer in enumerate(LAYERS):
        for package in layer:
            if _under(name, package):
                return i, package
    raise AssertionError(f"{name} is in no layer of test_imports.LAYERS; add it")


def raypack_imports(name: str) -> set[str]:
    return {m for m in imports_of(name) if m in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_one_way(name):
    if name == "raypack":
        return
    mine, package = layer_of(name)
    for m in raypack_imports(name) - {"raypack"}:
        theirs, other = layer_of(m)
        assert theirs <= mine, f"{name} imports {m}, a layer above it"
        assert theirs < mine or other == package or other not in SIBLINGS_APART.get(package, ()), (
            f"{name} imports {m}: {package} and {other} stay apart")
    if not any(_under(name, layer) for layer in COMMAND_LAYER):
        bad = sorted(m for m in imports_of(name) if any(_under(m, layer) for layer in COMMAND_LAYER))
        assert not bad, f"{name} imports the command layer: {bad}"
        assert "argparse" not in imports_of(name), f"{name} parses arguments; that is the command layer's job"


def test_no_import_cycle():
    """Module by module, at the top or inside functions: no chain of imports comes back to its start."""
    graph = {name: raypack_imports(name) - {name, "raypack"} for name in MODULES}
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)

    for name in sorted(graph):
        visit(name)


def test_the_graph_check_sees_imports():
    """Guard the guard: the walk finds known edges, top-level, relative and inside functions."""
    assert "raypack.data.plan" in imports_of("raypack.data.strategies")
    assert "raypack.storage" in imports_of("raypack.runs")
    assert "raypack.data.cache" in imports_of("raypack.commands.plan")  # imported inside a function
    assert "raypack.data.strategies" in imports_of("raypack.cli")  # inside main
    assert layer_of("raypack.config") < layer_of("raypack.data.strategies")


def test_config_and_errors_import_nothing_above_them():
    """Loading a config (or raising an input error) loads no data, model or training module."""
    code = ("import sys, raypack.config, raypack.errors; "
            "bad = [m for m in sys.modules if m.startswith(('raypack.data', 'raypack.model', 'raypack.train'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_gpu_side_modules_import_without_ray():
    """The attention and loss benchmarks and the GPU tests run where Ray and DeepSpeed are not installed."""
    code = (
        "import sys, raypack.model.build, raypack.model.attention, raypack.data.collate, raypack.data.synthetic,"
        " raypack.train.objectives.loss, raypack.train.prefetch;"
        "bad = [m for m in ('ray', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_what_ray_ships_to_the_controller_imports_no_data_or_model_code():
    """The Train controller unpickles the run's callback and scaling policy by importing their
    module before it starts a worker: raypack.train.remote keeps that to Ray Train's own imports."""
    code = ("import sys, raypack.train.remote; "
            "bad = [m for m in sys.modules if m.startswith(('raypack.data', 'raypack.model', 'transformers', "
            "'raypack.train.')) and m != 'raypack.train.remote']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
