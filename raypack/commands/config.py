"""`raypack config [--config FILE] [overrides] [FIELD ...]`: the configuration reference at the terminal.

    raypack config                                   # every field with its default, as YAML
    raypack config --config jobs/configs/tiny_cpu.yaml train.lr=2e-5   # the resolved config a run would train
    raypack config pack.budget                       # one field: type, default, allowed values, docstring
    raypack config model.peft                        # a section: its fields, one line each

A misspelt field suggests the nearest names. The text is the field's docstring
(raypack/config/reference.py), the same the docs site's configuration page shows.
"""

from __future__ import annotations

import argparse
import re
import textwrap

import yaml

from raypack.config import Config, dumps, load
from raypack.config.reference import FieldDoc, fields_of, lookup
from raypack.errors import ConfigError

WIDTH = 100


def run(args: argparse.Namespace) -> int:
    overrides = [item for item in args.items if "=" in item]
    names = [item for item in args.items if "=" not in item]
    entries = [lookup(name) for name in names]  # a misspelt name fails before the config is read
    cfg = load(args.config, overrides)
    if not entries:
        print(dumps(cfg), end="")
        return 0
    source = " and ".join(filter(None, [args.config, "the overrides" if overrides else None])) or None
    print("\n\n".join(_field(e, cfg, source) if not e.section else _section(e, cfg) for e in entries))
    return 0


def _value(cfg: Config, path: str):
    node = cfg.to_dict()
    for part in path.split("."):
        # an item's field of a list of sections (data.sources.weight): its value in every item
        node = [item[part] for item in node] if isinstance(node, list) else node[part]
    return node


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _field(entry: FieldDoc, cfg: Config, source: str | None) -> str:
    lines = [f"{entry.path}: {entry.type}", f"  default: {_yaml(entry.default)}"]
    value = _value(cfg, entry.path)
    if source and value != entry.default:
        lines.append(f"  value:   {_yaml(value)} (from {source})")
    if entry.allowed:
        lines.append(f"  allowed: {', '.join([*(_yaml(v) for v in entry.allowed), *(f'or {o}' for o in entry.open)])}")
    lines.append("")
    lines += textwrap.wrap(entry.doc, WIDTH, initial_indent="  ", subsequent_indent="  ") or ["  (no docstring)"]
    if children := fields_of(entry.path):  # a list of sections: what each item holds
        lines += ["", "  each item (defaults):", *_children(children, cfg, defaults=True)]
    return "\n".join(lines)


def _section(entry: FieldDoc, cfg: Config) -> str:
    children = fields_of(entry.path)
    if not children:
        raise ConfigError(f"{entry.path}: a section with no fields")
    lines = [f"{entry.path}: a section"]
    if entry.doc:
        lines += textwrap.wrap(entry.doc, WIDTH, initial_indent="  ", subsequent_indent="  ")
    lines.append("")
    lines += _children(children, cfg)
    lines.append("\n  `raypack config FIELD` for the whole text of one.")
    return "\n".join(lines)


def _children(children: list[FieldDoc], cfg: Config, defaults: bool = False) -> list[str]:
    """One line a field: its name, value (`defaults`: its default) and the first sentence of its docstring."""
    lines, width = [], max(len(c.path) for c in children)
    for c in children:
        first = re.split(r"(?<!e\.g)(?<!i\.e)\.\s", " ".join(c.doc.split()), maxsplit=1)[0].rstrip(".")
        shown = "(section)" if c.section else _yaml(c.default if defaults else _value(cfg, c.path))
        line = f"  {c.path:<{width}}  {shown:<12}  {first}"
        lines.append(line if len(line) <= WIDTH + 20 else line[: WIDTH + 17] + "...")
    return lines
