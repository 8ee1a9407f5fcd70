"""What the demo command installs runs every example command of the README (issue 37, item 6).

``bash scripts/demo.sh`` sets up ``.venv`` with ``scripts/setup-venv.sh demo``: the project
with the demo's extras. ``examples/lightning_cli.py`` (a README command) uses Lightning's
``LightningCLI``, which needs ``jsonargparse[signatures]``: not a dependency of Lightning,
and it was only in the ``test`` extra, so the command failed from the demo's set-up.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def demo_extras() -> list[str]:
    text = (REPO / "scripts" / "setup-venv.sh").read_text()
    return re.search(r'^\s*demo\) extras="([^"]*)"', text, re.M).group(1).split(",")


def demo_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"]] + [
        Requirement(r) for name in demo_extras() for r in extras[name]]


def readme_examples() -> list[Path]:
    """The example scripts a README command runs (``python examples/NAME.py``)."""
    names = re.findall(r"python (examples/\w+\.py)", (REPO / "README.md").read_text())
    return sorted({REPO / name for name in names})


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def lightning_cli_requirement() -> Requirement:
    """What Lightning's ``lightning.pytorch.cli`` asks for, read from its source (no import)."""
    spec = importlib.util.find_spec("lightning")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "pytorch" / "cli.py").read_text()
    return Requirement(re.search(r'_JSONARGPARSE_SIGNATURES_AVAILABLE = RequirementCache\("([^"]+)"\)', source).group(1))


def test_the_readme_runs_the_lightning_cli_example():
    assert REPO / "examples" / "lightning_cli.py" in readme_examples()


def test_every_readme_example_that_uses_lightning_cli_runs_from_what_the_demo_installs():
    needed = lightning_cli_requirement()  # jsonargparse[signatures]>=4.27.7 for Lightning 2.6
    users = [p for p in readme_examples() if "lightning.pytorch.cli" in imports(p)]
    assert users, "no README example uses LightningCLI any more: this test has nothing to check"
    given = [r for r in demo_requirements() if r.name == needed.name]
    assert given, f"{[p.name for p in users]} need {needed}, which the demo's extras {demo_extras()} do not install"
    (requirement,) = given
    assert needed.extras <= requirement.extras, f"the demo installs {requirement}, Lightning needs {needed}"
    # The versions the demo may install are ones Lightning accepts.
    lowest = min((Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")), default=None)
    assert lowest is not None and lowest in needed.specifier, f"the demo allows {requirement}, Lightning needs {needed}"


def test_the_cli_extra_is_what_users_install_for_it():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [Requirement(r).name for r in extras["cli"]] == ["jsonargparse"]
    assert "cli" in demo_extras()
