"""A stand-in for the `hyper_parallel` package (CPU/test-only; see the package docstring).

Every `hyper_parallel[.x.y]` module imports, and every name in it is a distinct class that takes any arguments, so that
MindFormers' module-level imports succeed. Anything that really uses one fails at that use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Anything:
    """Takes any arguments, so that module-level uses (placements in a table, decorators) succeed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __class_getitem__(cls, item: Any) -> type:
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Anything,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "hyper_parallel" or fullname.startswith("hyper_parallel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
