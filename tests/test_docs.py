"""The documentation site builds with ``mkdocs build --strict``: every page, snippet of the
README and docstring reference resolves (a broken link or a missing section fails). The API
reference covers every public name, each with a description."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(180)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=170, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in ("index.html", "quickstart/loop/index.html", "cli/index.html", "troubleshooting/index.html",
                 "api/index.html"):
        assert page in pages, sorted(pages)
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "DistributedDataParallel" in api and "TorchState" in api  # docstrings were rendered
    loop = (tmp_path / "site" / "quickstart" / "loop" / "index.html").read_text()
    assert "le.DistributedDataParallel" in loop  # the README's section was included


def test_every_export_has_an_entry_with_a_description_in_the_api_reference() -> None:
    import lightning_elastic as le

    # "::: lightning_elastic.api.rank": the name, and the module mkdocstrings reads it from.
    entries = {path.rpartition(".")[2]: path for path in
               re.findall(r"^::: (lightning_elastic(?:\.\w+)+)$", (REPO / "docs" / "api.md").read_text(), re.M)}
    missing = [name for name in le.__all__ if name not in entries]
    assert not missing, f"in lightning_elastic.__all__ but not in docs/api.md: {missing}"
    for name in le.__all__:
        module, _, attribute = entries[name].rpartition(".")
        documented = getattr(importlib.import_module(module), attribute)
        assert documented is getattr(le, name), f"docs/api.md documents {entries[name]}, not le.{name}"
        # A class's own docstring: an inherited one (torch's Sampler) describes something else.
        doc = documented.__dict__.get("__doc__") if isinstance(documented, type) else documented.__doc__
        assert doc and doc.strip(), f"le.{name} ({entries[name]}) has no docstring: its entry has no description"
