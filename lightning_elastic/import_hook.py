"""Run a function right after a module is first imported (stdlib only).

The ``elastic_hvd`` strategy name must exist in Lightning's registry before a ``Trainer``
is built, and the registry lives in Lightning. Importing Lightning eagerly would cost every
plain-PyTorch worker a second or two, so registration waits for Lightning's own import:
this finder wraps the loader of the named module and calls back once it has executed.

It imports nothing from ``lightning_elastic`` so that the launcher's ``sitecustomize`` can
load it by path without importing torch at interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.Lock()


class _CallAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._resolving = False

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != self.name or self._resolving:
            return None
        self._resolving = True  # ask the other finders; do not find ourselves again
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is not self and hasattr(finder, "find_spec"):
                        spec = finder.find_spec(fullname, path, target)
                        if spec is not None:
                            break
        finally:
            self._resolving = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        hook = self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):  # type: ignore[no-untyped-def]
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                hook.remove()
                hook.callback(module)

        spec.loader = _Loader()
        return spec

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def call_after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` once ``name`` is imported: now if it already is, else right after."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        if any(isinstance(f, _CallAfterImport) and f.name == name and f.callback is callback for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _CallAfterImport(name, callback))
