"""Loaded at interpreter start in every worker ``lightning-elastic launch`` starts.

``lightning-elastic launch`` puts this folder first on ``PYTHONPATH`` so that a Lightning
(Trainer or Fabric) script resolves ``strategy="elastic_hvd"`` without importing
``lightning_elastic`` itself.
It costs nothing until Lightning is imported: then ``lightning_elastic`` is imported, which
registers the strategy. Any other ``sitecustomize`` on the path still runs afterwards.
"""

import importlib.util
import os
import sys


def _install() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    package_dir = os.path.dirname(here)
    spec = importlib.util.spec_from_file_location(
        "_lightning_elastic_import_hook", os.path.join(package_dir, "import_hook.py")
    )
    if spec is None or spec.loader is None:
        return
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    def register(_module):  # type: ignore[no-untyped-def]
        import lightning_elastic  # noqa: F401  (registers the strategy on import)

    hook.call_after_import("lightning.pytorch", register)
    hook.call_after_import("pytorch_lightning", register)
    hook.call_after_import("lightning.fabric", register)


def _run_next_sitecustomize() -> None:
    # Only the first sitecustomize on sys.path is imported; chain to the one we shadow.
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_lightning_elastic_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("LIGHTNING_ELASTIC_DRIVER_URL"):
    _install()
_run_next_sitecustomize()
