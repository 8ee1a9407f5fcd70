"""No import circle anywhere in the product (scripts/import_cycles.py, read with ``ast``):
not among the worker's modules, not in the driver (``lightning_elastic.launcher``), not
between them.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "import_cycles.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_circle_among_the_worker_modules() -> None:
    cycles = _script()
    edges = cycles.graph(REPO, launcher=False)
    assert "lightning_elastic.membership.worker" in edges  # the script found the package
    found = cycles.circles(edges)
    assert found == [], [" -> ".join(cycles.loop_through(members, edges)) for members in found]


def test_no_circle_with_the_driver_included() -> None:
    cycles = _script()
    edges = cycles.graph(REPO, launcher=True)
    assert "lightning_elastic.launcher.job.step" in edges  # the script found the driver's rooms
    found = cycles.circles(edges)
    assert found == [], [" -> ".join(cycles.loop_through(members, edges)) for members in found]


def test_the_script_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "lightning_elastic"
    (package / "room").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "room" / "__init__.py").write_text("")
    (package / "room" / "a.py").write_text("from lightning_elastic.room import b\n")
    (package / "room" / "b.py").write_text("def f():\n    from lightning_elastic.room.a import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (package / "d.py").write_text("from lightning_elastic import c\n")
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lightning_elastic.room.a -> lightning_elastic.room.b -> lightning_elastic.room.a" in result.stdout
    assert "lightning_elastic.c -> lightning_elastic.d -> lightning_elastic.c" in result.stdout
    assert "2 circle(s)" in result.stdout
