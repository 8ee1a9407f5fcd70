"""``benchmarks/fleet/checkout_bootstrap.py``: the driver process of another checkout runs with
that checkout's code as ``lightning_elastic`` and its ``launcher/`` folder as
``lightning_elastic.launcher`` (as its pyproject.toml maps it), and a module the checkout
lacks is an ImportError, never this tree's (which the venv's editable install would give)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "benchmarks" / "fleet" / "checkout_bootstrap.py"

SCRIPT = '''
import json, sys
import lightning_elastic, lightning_elastic.launcher.driver.driver as driver
from benchmarks.fleet import gc_pauses
missing = []
for name in ("lightning_elastic.launcher.config", "lightning_elastic.client", "benchmarks.fleet.simulated_workers"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        missing.append(name)
print(json.dumps({"argv": sys.argv[1:], "name": __name__, "top": lightning_elastic.__file__,
                  "driver": driver.__file__, "gc_pauses": gc_pauses.__file__, "missing": missing}))
'''


def write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checkouts_own_tree_is_imported_and_nothing_else(tmp_path: Path) -> None:
    tree = tmp_path / "old"
    write(tree / "pyproject.toml", '[tool.setuptools.package-dir]\n"lightning_elastic.launcher" = "launcher"\n')
    write(tree / "lightning_elastic" / "__init__.py")
    write(tree / "launcher" / "__init__.py")
    write(tree / "launcher" / "driver" / "__init__.py")
    write(tree / "launcher" / "driver" / "driver.py")
    write(tree / "benchmarks" / "fleet" / "__init__.py")
    write(tree / "benchmarks" / "fleet" / "gc_pauses.py")
    write(tree / "benchmarks" / "fleet" / "driver_process.py", SCRIPT)

    done = subprocess.run([sys.executable, str(BOOTSTRAP), str(tree), str(tree / "benchmarks/fleet/driver_process.py"),
                           "--workers", "8"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["--workers", "8"] and seen["name"] == "__main__"
    assert seen["top"] == str(tree / "lightning_elastic" / "__init__.py")
    assert seen["driver"] == str(tree / "launcher" / "driver" / "driver.py")
    assert seen["gc_pauses"] == str(tree / "benchmarks" / "fleet" / "gc_pauses.py")
    # This tree has them all; the checkout does not: none may come from here.
    assert seen["missing"] == ["lightning_elastic.launcher.config", "lightning_elastic.client",
                               "benchmarks.fleet.simulated_workers"]
    assert f"lightning_elastic.launcher from {tree / 'launcher'}" in done.stderr
