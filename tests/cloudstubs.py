"""Cloud SDKs that are not installed here (boto3, googleapiclient, ...) stood in for, so that Ray's
launcher modules import: any attribute of a stub module is a MagicMock. Only their import lines
need the SDKs; what the tests call in them (config checks, autodetection) uses none."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterable, Iterator
from unittest import mock


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []
        module.__spec__ = spec
        module.__version__ = "999"  # the providers assert a minimum SDK version
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def stub_sdks(roots: Iterable[str]) -> Iterator[None]:
    """Stub modules for the top-level packages `roots` while the block runs; every module imported
    meanwhile is dropped from sys.modules afterwards, so no other test sees a stub."""
    saved = dict(sys.modules)
    finder = _StubFinder({r.split(".")[0] for r in roots})
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - set(saved):
            del sys.modules[name]
        sys.modules.update(saved)
