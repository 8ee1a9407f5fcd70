"""The integration for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` is the same code as ``lightning.pytorch`` under another name, with
its own classes: a ``lightning.pytorch`` strategy fails its type checks. Lightning ships the
two packages by renaming imports; this module does the same to our integration modules at
import time, so both packages are served by one source.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

_PACKAGE = "lightning_elastic.lightning"
_MIRROR = "lightning_elastic.lightning._for_pytorch_lightning"
_MODULES = ("compat", "capture", "commit", "callbacks", "environment", "sampling", "resumed_logs", "fit_launcher",
            "strategy", "pristine", "sharded_commit", "sharded_snapshot", "fsdp")  # dependency order
_RENAMES = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    (_PACKAGE + ".", _MIRROR + "."),
    (f"from {_PACKAGE} import", f"from {_MIRROR} import"),
)


@functools.cache
def load_for_standalone_package() -> SimpleNamespace:
    here = Path(__file__).parent
    package = ModuleType(_MIRROR)
    package.__path__ = []  # a namespace for the renamed modules only
    sys.modules[_MIRROR] = package
    loaded = {}
    for name in _MODULES:
        source = (here / f"{name}.py").read_text()
        for old, new in _RENAMES:
            source = source.replace(old, new)
        spec = importlib.util.spec_from_loader(f"{_MIRROR}.{name}", loader=None, origin=str(here / f"{name}.py"))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(source, spec.origin or name, "exec"), module.__dict__)
        setattr(package, name, module)
        loaded[name] = module
    return SimpleNamespace(**loaded)
