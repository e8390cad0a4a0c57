"""The configuration reference, read from the dataclasses themselves: every section and field
with its type, default, allowed values and the docstring written under it.

    reference()                 # [FieldDoc(path="data.paths", ...), ...] in declaration order
    lookup("pack.budget")       # one FieldDoc, or a section's; a ConfigError naming the nearest names

`raypack config FIELD` prints one entry and the docs site's configuration page is rendered from
all of them (tools/docs_hooks.py), so a field documents itself in both places by its docstring.
Python keeps no field docstrings at run time, so they are read from each class's source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from raypack.config.sections import ASSETS, ASSETS_PREFIX
from raypack.errors import ConfigError
from raypack.typed import describe, plain


@dataclass(frozen=True)
class FieldDoc:
    path: str
    """Dotted name, as an override spells it: `pack.budget`, `model.peft.r`."""
    type: str
    """The accepted form, in the words the config errors use (`an integer`, `one of 'a', 'b'`)."""
    default: Any
    """The default as YAML writes it (plain data)."""
    allowed: tuple[Any, ...]
    """The values a Literal field accepts (with true and false, and null, where its type also takes
    a bool or None); empty for open types."""
    doc: str
    """The docstring under the field, dedented; empty if the field has none."""
    section: bool = False
    """A nested section (`model.peft`) rather than a value."""
    open: tuple[str, ...] = ()
    """What a Literal field also takes besides `allowed`, in words (`a number`): `Literal['auto'] | float`."""


@cache
def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal right after its annotated assignment} in `cls`'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _walk(cls: type, prefix: str) -> list[FieldDoc]:
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    defaults = plain(cls())
    out = []
    for f in dataclasses.fields(cls):
        hint, path = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            out.append(FieldDoc(path, "a section", None, (), docs.get(f.name, "") or _class_doc(hint), section=True))
            out += _walk(hint, f"{path}.")
            continue
        allowed, others = _literal_values(hint), ()
        if allowed:  # a Literal among other types: those too (router_aux_loss_coef: 'auto' or a number)
            args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
            allowed += (True, False) * (bool in args) + (None,) * (type(None) in args)
            others = tuple(describe(a) for a in args if typing.get_origin(a) is not Literal and a not in (bool, type(None)))
        out.append(FieldDoc(path, describe(hint), _portable(defaults[f.name]), allowed, docs.get(f.name, ""),
                            open=others))
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple and typing.get_args(hint) else None
        if dataclasses.is_dataclass(item):  # a list of sections (data.sources): each item's fields
            out += _walk(item, f"{path}.")
    return out


def _portable(value: Any) -> Any:
    """A bundled asset's default as a config names it (`raypack/assets/...`), not this machine's path."""
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and value.startswith(str(ASSETS)):
        return ASSETS_PREFIX + value[len(str(ASSETS)) + 1:]
    return value


def _class_doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""


def _literal_values(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return tuple(v for a in typing.get_args(hint) for v in _literal_values(a))


@cache
def reference() -> tuple[FieldDoc, ...]:
    """Every section and field of the run config, in declaration order."""
    from raypack.config import Config

    return tuple(_walk(Config, ""))


def lookup(name: str) -> FieldDoc:
    """The entry for `name` (a field or a section); an unknown name is a ConfigError that
    suggests the nearest names."""
    entries = {e.path: e for e in reference()}
    if name in entries:
        return entries[name]
    close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; `raypack config` with no field lists every one"
    raise ConfigError(f"{name}: no such config field{hint}")


def nearest(name: str) -> str | None:
    """The one field name closest to a misspelt `name`, if any is close."""
    close = difflib.get_close_matches(name, [e.path for e in reference()], n=1, cutoff=0.6)
    return close[0] if close else None


def fields_of(section: str) -> list[FieldDoc]:
    """The entries directly or indirectly under `section` (`model` includes `model.peft.*`)."""
    return [e for e in reference() if e.path.startswith(section + ".")]
