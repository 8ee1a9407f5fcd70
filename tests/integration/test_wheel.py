"""The package as users get it: a wheel built from the checkout, installed (not editable)
into a fresh venv, run from a directory outside the checkout.

The venv is built once for the module (torch's CPU build by ``scripts/install-torch-cpu.sh``,
as ``scripts/setup-venv.sh`` gets it; Lightning from the machine's package index).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.integration.harness import REPO, Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "lightning_classifier.py"


def run(cmd: list[str | Path], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what git tracks: a build/ left in the checkout by an earlier
    # build would otherwise slip its stale files into the wheel.
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, source], cwd=out, timeout=300)
    (built,) = out.glob("lightning_elastic-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", root / "venv"], cwd=root, timeout=120)
    python = root / "venv" / "bin" / "python"
    run(["bash", REPO / "scripts" / "install-torch-cpu.sh", root / "venv"], cwd=root, timeout=900)
    # With the cli extra, as the README says for examples/lightning_cli.py (Ray stays out).
    run([python, "-m", "pip", "install", "-q", f"{wheel}[cli]"], cwd=root, timeout=900)
    return root / "venv"


def source_files() -> set[str]:
    """Every file of the package in the checkout, by the path it has once installed."""
    files = {str(p.relative_to(REPO)) for p in (REPO / "lightning_elastic").rglob("*") if p.is_file()}
    files |= {"lightning_elastic/launcher/" + str(p.relative_to(REPO / "launcher"))
              for p in (REPO / "launcher").rglob("*") if p.is_file()}
    return {f for f in files if "__pycache__" not in f and not f.endswith(".pyc")}


def test_the_wheel_holds_every_file_of_the_package_and_no_generic_top_level_name(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = source_files() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"lightning_elastic"}, top_level
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "lightning-elastic = lightning_elastic.launcher.cli:main" in entry_points


def test_the_installed_package_imports_lightning_and_registers_the_strategy(venv: Path, tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "import lightning_elastic.launcher.node.supervisor\n"
        "assert 'torch' not in sys.modules, 'the supervisor imported torch'\n"
        "import lightning_elastic as le\n"
        "import lightning.pytorch as pl\n"
        "assert 'elastic_hvd' in pl.strategies.StrategyRegistry, 'elastic_hvd not registered'\n"
        "assert le.ElasticCallback.__module__ == 'lightning_elastic.lightning.callbacks'\n"
        "print(le.__file__)\n"
    )
    result = run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, timeout=120)
    assert str(venv) in result.stdout, f"imported from {result.stdout.strip()}, not from the venv"


def test_the_core_install_says_how_to_get_ray(venv: Path, tmp_path: Path) -> None:
    hint = "Ray is not installed; install the extra with pip install 'lightning-elastic[ray]'"
    launched = subprocess.run([venv / "bin" / "lightning-elastic", "launch", "--ray", "auto", "-np", "2", "python",
                               "train.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert launched.returncode == 2
    assert launched.stderr.splitlines() == [f"lightning-elastic: error: --ray: {hint}"]
    probe = "from lightning_elastic.ray import ElasticRayExecutor\nElasticRayExecutor(min_np=1)\n"
    imported = subprocess.run([venv / "bin" / "python", "-c", probe], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
    assert imported.returncode == 1
    assert imported.stderr.splitlines()[-1] == f"ImportError: ElasticRayExecutor: {hint}"


def test_the_lightning_example_survives_a_killed_worker_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"  # a user's copy of the example, away from the checkout
    shutil.copy(EXAMPLE, script)
    job = Job(tmp_path, launcher=venv / "bin" / "lightning-elastic")
    job.set_hosts("127.0.0.1:1", "127.0.0.2:1")
    command = [str(venv / "bin" / "python"), str(script), "--events", str(job.events_dir),
               "--log-dir", str(tmp_path / "logs"), "--samples", "320", "--batch-size", "8", "--epochs", "2",
               "--commit-every", "2", "--step-delay", "0.03"]
    job.start(["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2",
               "-np", "2", "--min-np", "1"], command=command)
    try:
        job.wait_steps(5)
        victim = job.worker_pid("127.0.0.2")
        os.kill(victim, signal.SIGKILL)
        assert job.wait() == 0, job.stderr()[-3000:]
    finally:
        job.kill()
    assert job.world_sizes() == [2, 1]
    assert "was killed by SIGKILL" in job.stderr()
    assert "job succeeded" in job.reason()
    done = job.events("done")
    assert len(done) == 1 and done[0]["pid"] != victim
    assert not job.stray_processes()


def test_the_readmes_lightning_cli_command_runs_from_the_wheel_with_the_cli_extra(venv: Path, tmp_path: Path) -> None:
    # Issue 37, item 6: it failed where jsonargparse[signatures] was not installed.
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.replace("\\\n    ", "").splitlines()
                   if line.startswith("lightning-elastic launch ") and "examples/lightning_cli.py" in line)
    assert " python examples/lightning_cli.py fit " in command
    (tmp_path / "examples").mkdir()
    for name in ("lightning_cli.py", "lightning_classifier.py"):  # the first imports the second
        shutil.copy(REPO / "examples" / name, tmp_path / "examples" / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LIGHTNING_ELASTIC_")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # python and lightning-elastic: the venv's
    result = subprocess.run(command.split(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lightning-elastic: job succeeded" in result.stderr.splitlines()[-1]
