"""The configuration reference is read from the dataclasses: every field documented, nothing invented."""

from __future__ import annotations

import dataclasses

import pytest

from raypack.config import ASSETS, Config, SourceConfig, TrainConfig
from raypack.config.reference import field_docstrings, lookup, reference
from raypack.errors import ConfigError
from raypack.typed import plain


def _all_fields(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            out += _all_fields(f.default_factory, f"{prefix}{f.name}.")
        elif f.name == "sources":  # a list of sections: its items' fields are listed under it
            out += _all_fields(SourceConfig, f"{prefix}{f.name}.")
    return out


def test_reference_lists_every_field_of_every_section_with_its_default():
    paths = [e.path for e in reference()]
    assert paths == _all_fields(Config)  # walked independently of reference()'s own walk
    defaults = Config().to_dict()
    for e in reference():
        if e.section:
            continue
        node = defaults
        if e.path.startswith("data.sources."):  # an item's field: its default in an item
            node = {"data": {"sources": plain(SourceConfig())}}
        for part in e.path.split("."):
            node = node[part]
        if e.path in ("data.paths", "tokenize.tokenizer"):  # shown as a config names the bundled assets
            node = [p.replace(str(ASSETS), "raypack/assets") for p in node] if isinstance(node, list) \
                else node.replace(str(ASSETS), "raypack/assets")
        assert e.default == node, e.path


def test_every_field_has_a_docstring():
    """A field added without one fails here (and would show up undocumented in the docs site)."""
    undocumented = [e.path for e in reference() if not e.doc.strip()]
    assert not undocumented, f"config fields without a docstring: {undocumented}"


def test_a_field_without_a_docstring_is_found():
    @dataclasses.dataclass(frozen=True)
    class Section:
        documented: int = 1
        """Says what it does."""
        bare: int = 2
        after: str = "x"
        """Belongs to `after`, not `bare`."""

    docs = field_docstrings(Section)
    assert docs == {"documented": "Says what it does.", "after": "Belongs to `after`, not `bare`."}


def test_docstrings_are_the_source_text():
    assert field_docstrings(TrainConfig)["lr"] == lookup("train.lr").doc
    entry = lookup("model.attention")
    assert entry.allowed == ("auto", "flash_attn", "torch_varlen", "sdpa_varlen", "sdpa")
    assert entry.default == "auto" and "backend" in entry.doc


def test_unknown_field_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"pack\.budgt: no such config field; did you mean pack\.budget"):
        lookup("pack.budgt")
    with pytest.raises(ConfigError, match="raypack config` with no field"):
        lookup("zzz.qqq")
