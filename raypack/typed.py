"""YAML values into frozen dataclasses, and back, by the dataclasses' own type hints.

    section = build(TrainConfig, {"lr": "2e-5"}, "train.")   # TrainConfig(lr=2e-05)
    plain(section)                                           # {"lr": 2e-05, ...}: canonical values

`build` refuses an unknown key, a value of the wrong type and a non-finite number with a
`ConfigError` that names the dotted key and the expected form. `plain` is the one way a config
becomes plain data (YAML to save, JSON to hash, `train_loop_config` to travel): every value in
the type its field declares, so a float field written `8` reloads and hashes as `8.0` whichever
way the object was built, and `build(cls, plain(x)) == x` field for field, type for type.
Generic: nothing here knows raypack's sections (raypack/config.py declares them).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from raypack.errors import ConfigError


def check(ok: bool, name: str, expected: str, value: Any) -> None:
    """ConfigError `name: expected <expected>, got <value>` unless `ok`."""
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


def build(cls: type, raw: Any, prefix: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping of YAML values; `prefix` names it in errors."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), sorted(names), n=1, cutoff=0.6)
        guess = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; {guess}expected one of {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, value if value is not None else {}, f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(hint, value, f"{prefix}{name}")
    return cls(**kwargs)


def unused(obj: Any, prefix: str = "", root: Any = None) -> dict[str, str]:
    """{dotted name: why} for every field set away from its default in a section that is switched
    off (an adapter setting while `model.peft.method` is none, a W&B name while `run.wandb.mode` is
    disabled, a `dpo:` setting while `train.objective` is sft). Such a setting does nothing, which is
    what the user did not mean. Found from the dataclasses alone: a section is off when its
    `enabled` property is False (switched by its own Literal fields, whose values that turn it on
    are tried), or when the field its `SWITCHED_ON_BY` class attribute names, (dotted path from the
    root, the values that turn it on), holds another value; then every field keeps its default."""
    root = obj if root is None else root
    out: dict[str, str] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(unused(value, f"{prefix}{f.name}.", root))
    switches = _switches(obj, prefix, root)
    if switches is None:
        return out
    default = type(obj)()
    off = ", ".join(f"{name} is {current}" for name, (current, _) in switches.items()) or "it is off"
    on = " or ".join(f"{name} to {' or '.join(map(str, values))}" for name, (_, values) in switches.items())
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f"{prefix}{f.name}" not in switches and value != getattr(default, f.name):
            shown = list(value) if isinstance(value, tuple) else plain(value)
            out[f"{prefix}{f.name}"] = (f"set to {shown!r}, which does nothing while {off}; "
                                        f"{'set ' + on + ', or ' if on else ''}remove it")
    return out


def _switches(obj: Any, prefix: str, root: Any) -> dict[str, tuple[Any, list[Any]]] | None:
    """None while `obj`'s section is on; else {dotted switch: (its value, the values that turn the
    section on)}."""
    if (by := getattr(type(obj), "SWITCHED_ON_BY", None)) is not None:
        path, values = by
        current = root
        for part in path.split("."):
            current = getattr(current, part)
        return None if current in values else {path: (current, list(values))}
    if getattr(obj, "enabled", True) is not False:
        return None
    found = {}
    for name, hint in typing.get_type_hints(type(obj)).items():
        if typing.get_origin(hint) is Literal:
            values = []
            for option in typing.get_args(hint):
                try:
                    if dataclasses.replace(obj, **{name: option}).enabled:
                        values.append(option)
                except (ConfigError, TypeError, ValueError):
                    continue
            if values:
                found[f"{prefix}{name}"] = (getattr(obj, name), values)
    return found


def plain(obj: Any) -> Any:
    """A dataclass as nested dicts of plain values, each in its field's declared type (module doc)."""
    if not dataclasses.is_dataclass(obj):
        return obj
    hints = typing.get_type_hints(type(obj))
    return {f.name: _plain_value(hints[f.name], getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain_value(hint: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return plain(value)
    if isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        return [_plain_value(args[0] if args else Any, v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and _takes_float(hint):
        return float(value)
    return value


def _takes_float(hint: Any) -> bool:
    """A float field (or float | None) that holds no int alternative: an int there is a float."""
    if hint is float:
        return True
    args = typing.get_args(hint)
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and float in args and int not in args


def coerce(hint: Any, value: Any, name: str) -> Any:
    """`value` checked against (and converted to) the type `hint`, or a ConfigError naming `name`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(option, value, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: expected {describe(hint)}, got {value!r}")
    if origin is Literal:
        check(value in args, name, "one of " + ", ".join(map(repr, args)), value)
        return value
    if origin is tuple and dataclasses.is_dataclass(args[0]):  # a list of sections (data.sources)
        check(isinstance(value, (list, tuple)), name, describe(hint), value)
        return tuple(_element(args[0], v, name, i) for i, v in enumerate(value))
    if origin is dict:
        check(isinstance(value, dict), name, describe(hint), value)
        return {coerce(args[0], k, f"{name} key"): coerce(args[1], v, f"{name}.{k}") for k, v in value.items()}
    if origin is tuple:
        if isinstance(value, (str, int, float)):  # a single value where a list is allowed
            value = [value]
        check(isinstance(value, (list, tuple)), name, describe(hint), value)
        return tuple(coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        check(isinstance(value, bool), name, "true or false", value)
    elif hint is int:
        check(isinstance(value, int) and not isinstance(value, bool), name, "an integer", value)
    elif hint is float:
        if isinstance(value, str):  # PyYAML reads 2e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        check(isinstance(value, (int, float)) and not isinstance(value, bool), name, "a number", value)
        # inf passes every `> 0` check (train.lr=inf trains on NaNs) and nan any negated one.
        check(math.isfinite(value), name, "a finite number", value)
        return float(value)
    elif hint is str:
        check(isinstance(value, str), name, "a string", value)
    return value


def _element(cls: type, raw: Any, name: str, index: int) -> Any:
    """Item `index` of a list of sections; an error in it says which item, by the class's own
    `describe_raw(index, raw)` where it has one (a source: its paths)."""
    try:
        return build(cls, raw, f"{name}[{index}].")
    except ConfigError as e:
        where = getattr(cls, "describe_raw", None)
        if where is None:
            raise
        raise ConfigError(f"{e} ({where(index, raw)})") from None


def describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args and dataclasses.is_dataclass(args[0]):
        return "a list of mappings"
    if origin is dict:
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a list of {_PLURAL.get(args[0], describe(args[0]))}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


_PLURAL = {bool: "true or false values", int: "integers", float: "numbers", str: "strings"}
