"""lightning_elastic/_autoload/sitecustomize.py in real interpreters: with two installs of the
package on PYTHONPATH (a Ray node's own and the driver's, two venvs), each copy chained to
the other until RecursionError ("Error in sitecustomize" in every worker)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning_elastic
from lightning_elastic import protocol as p

PACKAGE = Path(lightning_elastic.__file__).resolve().parent
COUNT_HOOKS = ("import sys; print(sum(type(f).__name__ == '_CallAfterImport' for f in sys.meta_path))")


def install_copy(root: Path) -> Path:
    """The files the autoload folder needs, as another install of the package; its _autoload."""
    (root / "lightning_elastic").mkdir(parents=True)
    shutil.copytree(PACKAGE / "_autoload", root / "lightning_elastic" / "_autoload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE / "import_hook.py", root / "lightning_elastic" / "import_hook.py")
    return root / "lightning_elastic" / "_autoload"


def users_sitecustomize(folder: Path, log: Path) -> Path:
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"open({str(log)!r}, 'a').write('ran\\n')\n")
    return folder


def run_python(pythonpath: list[Path], under_launcher: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != p.ENV_DRIVER_URL}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    if under_launcher:
        env[p.ENV_DRIVER_URL] = "http://127.0.0.1:9"  # never contacted: only read as "under the launcher"
    return subprocess.run([sys.executable, "-c", COUNT_HOOKS], env=env, capture_output=True, text=True, timeout=60)


def test_two_installs_on_the_path_run_once_each_and_hook_once(tmp_path):
    first, second = install_copy(tmp_path / "node"), install_copy(tmp_path / "driver")
    log = tmp_path / "user.log"
    user = users_sitecustomize(tmp_path / "user", log)
    # A folder twice, as a PYTHONPATH built by prepending can have it.
    for path in ([first, second, user], [second, first, user], [first, second, first, user]):
        log.unlink(missing_ok=True)
        result = run_python(path)
        assert "Error in sitecustomize" not in result.stderr, result.stderr
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "3"  # lightning.pytorch, pytorch_lightning, lightning.fabric: once each
        assert log.read_text() == "ran\n"  # the user's own sitecustomize still runs, once


def test_one_install_hooks_only_under_the_launcher_and_chains_to_the_users(tmp_path):
    log = tmp_path / "user.log"
    autoload = install_copy(tmp_path / "node")
    user = users_sitecustomize(tmp_path / "user", log)
    result = run_python([autoload, user])
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "3", "")
    result = run_python([autoload, user], under_launcher=False)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "0", "")
    assert log.read_text() == "ran\nran\n"
