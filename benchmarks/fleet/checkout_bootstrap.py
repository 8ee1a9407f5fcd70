"""Run a script with another checkout's code as ``lightning_elastic`` (and ``benchmarks``).

    python benchmarks/fleet/checkout_bootstrap.py CHECKOUT SCRIPT [ARG ...]

Used by ``benchmarks/fleet_sim.py --checkouts`` to run each checkout's own
``benchmarks/fleet/driver_process.py`` against the same simulated workers. A ``PYTHONPATH``
is not enough: the project maps the repository's ``launcher/`` folder to
``lightning_elastic.launcher`` (``[tool.setuptools.package-dir]`` in pyproject.toml), and the
venv's editable install answers that name, and its direct children, from the tree the venv
was made for. So before the script runs, a finder is put first on ``sys.meta_path`` that
owns every module under ``lightning_elastic`` and ``benchmarks`` (the latter only if CHECKOUT
has ``benchmarks/fleet/``; else it comes from ``sys.path``): each comes from CHECKOUT
(its own folders, mapped as that checkout's pyproject.toml says), and a module the checkout
lacks is an ImportError, never a quiet fall-back to another tree's. Then SCRIPT runs as
``python SCRIPT ARG ...`` would (``__main__``, its folder first on ``sys.path``, CHECKOUT
next). One line on stderr says where the driver's code came from.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Sequence

OWNED = ("lightning_elastic", "benchmarks")


def package_dirs(checkout: Path) -> dict[str, Path]:
    """Package name -> folder, for the names the checkout's pyproject.toml maps elsewhere than
    their own path (``[tool.setuptools.package-dir]``; none if it has no such table)."""
    try:
        project = tomllib.loads((checkout / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    declared = project.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {name: (checkout / folder).resolve() for name, folder in declared.items()
            if name and name.split(".")[0] in OWNED}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Every module under ``OWNED`` from one checkout, or an ImportError."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = checkout.resolve()
        self.owned = tuple(top for top in OWNED if top != "benchmarks" or (self.checkout / "benchmarks" / "fleet").is_dir())
        self.mapped = package_dirs(self.checkout)

    def _inside(self, spec: importlib.machinery.ModuleSpec) -> bool:
        places = [spec.origin] if spec.origin not in (None, "namespace") else list(spec.submodule_search_locations or ())
        return bool(places) and all(Path(p).resolve().is_relative_to(self.checkout) for p in places)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.owned:
            return None
        if fullname in self.mapped:
            folder = self.mapped[fullname]
            init = folder / "__init__.py"
            if not init.is_file():
                raise ModuleNotFoundError(f"{fullname}: no {init} in the checkout", name=fullname)
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])
        if "." not in fullname:
            path = [str(self.checkout)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not self._inside(spec):
            raise ModuleNotFoundError(f"No module named {fullname!r} in the checkout {self.checkout}", name=fullname)
        return spec


def install(checkout: Path) -> CheckoutFinder:
    stale = [name for name in sys.modules if name.split(".")[0] in OWNED]
    for name in stale:  # nothing is imported before the bootstrap; but never keep another tree's
        del sys.modules[name]
    finder = CheckoutFinder(checkout)
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    return finder


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: checkout_bootstrap.py CHECKOUT SCRIPT [ARG ...]")
    checkout, script = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    finder = install(checkout)
    # As `python SCRIPT` would: its folder first (not this bootstrap's), the checkout next.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]
    sys.path[0:0] = [str(script.parent), str(checkout)]
    import lightning_elastic.launcher as launcher

    print(f"fleet checkout {checkout}: lightning_elastic.launcher from {Path(launcher.__file__).parent}"
          f" (mapped: {', '.join(f'{k}={v}' for k, v in sorted(finder.mapped.items())) or 'none'}), running {script}",
          file=sys.stderr, flush=True)
    sys.argv = [str(script), *argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
