"""Loaded at interpreter start in every worker ``lightning-elastic launch`` starts.

``lightning-elastic launch`` puts this folder first on ``PYTHONPATH`` so that a Lightning
(Trainer or Fabric) script resolves ``strategy="elastic_hvd"`` without importing
``lightning_elastic`` itself.
It costs nothing until Lightning is imported: then ``lightning_elastic`` is imported, which
registers the strategy. Any other ``sitecustomize`` on the path still runs afterwards, once.

Two installs of the package may both have their copy of this folder on the path (a Ray
node's own install and the driver's, two venvs): the first copy installs the hook, and
every copy that runs is recorded so that the chain never comes back to it. Without the
record each copy would take the other for the ``sitecustomize`` it shadows, and the two
would call each other until ``RecursionError``.
"""

import importlib.util
import os
import sys
import types

# One record per process, shared by every copy of this file that runs (each is loaded as a
# module of its own, so a module global would not be shared): the folders whose
# sitecustomize already ran, and whether the hook is installed.
_RECORD = "_lightning_elastic_autoload_record"


def _record() -> types.ModuleType:
    record = sys.modules.get(_RECORD)
    if record is None:
        record = types.ModuleType(_RECORD)
        record.ran = set()  # type: ignore[attr-defined]
        record.installed = False  # type: ignore[attr-defined]
        sys.modules[_RECORD] = record
    return record


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


def _run_next_sitecustomize(ran: set) -> None:
    # Only the first sitecustomize on sys.path is imported; chain to the first one that has
    # not run yet (another copy of this file included: it chains on in turn).
    for entry in sys.path:
        if not entry:
            continue
        folder = os.path.realpath(entry)
        if folder in ran:
            continue
        candidate = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(candidate):
            ran.add(folder)
            spec = importlib.util.spec_from_file_location("_lightning_elastic_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


def _main() -> None:
    record = _record()
    record.ran.add(os.path.realpath(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("LIGHTNING_ELASTIC_DRIVER_URL") and not record.installed:
        record.installed = True
        _install()
    _run_next_sitecustomize(record.ran)


_main()
