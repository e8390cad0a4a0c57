"""DeepSpeed JSON presets: found by name in the package (raypack/configs/deepspeed/) or by path.

Kept apart from engines/deepspeed_engine.py, which imports DeepSpeed, and outside the engines package,
which imports torch: the memory estimate (`raypack plan`, cluster/memory.py) reads the presets'
bucket sizes without the training stack's imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
"""The shipped presets, inside the package: found wherever raypack is installed."""


def find_auto(node: Any, path: str = "") -> str | None:
    if node == "auto":
        return path or "<root>"
    if isinstance(node, dict):
        for key, value in node.items():
            if found := find_auto(value, f"{path}.{key}" if path else key):
                return found
    return None


def load_preset(name: str | None) -> dict[str, Any]:
    """Read a DeepSpeed JSON preset by name (raypack/configs/deepspeed/<name>.json) or path."""
    if not name:
        return {}
    path = Path(name)
    if not path.exists():
        path = PRESETS / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        choices = ", ".join(sorted(p.stem for p in PRESETS.glob("*.json")))
        raise ValueError(f"train.deepspeed_preset: no preset {name!r}; expected a path or one of {choices}")
    return json.loads(path.read_text())
