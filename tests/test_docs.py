"""The documentation site builds with ``mkdocs build --strict``: every page, snippet of the
README and docstring reference resolves (a broken link or a missing section fails)."""

from __future__ import annotations

import os
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
