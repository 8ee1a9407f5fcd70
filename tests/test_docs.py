"""The documentation site builds with ``mkdocs build --strict``: every page, snippet of the
README and docstring reference resolves (a broken link or a missing section fails). The API
reference covers every public name, each with a description."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
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


# ----- the pages written from the README (issue 37, item 10) -----------------------------------


def _docs_pages_script():
    spec = importlib.util.spec_from_file_location("docs_pages", REPO / "scripts" / "docs_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_made_of_readme_sections_is_written_out_whole_and_up_to_date() -> None:
    # They were one-line snippet includes: empty to whoever read docs/ outside the built site.
    docs_pages = _docs_pages_script()
    stale = docs_pages.out_of_date()
    assert not stale, f"out of date with README.md: {[str(p.relative_to(REPO)) for p in stale]}: " \
                      "run python scripts/docs_pages.py"
    for path in docs_pages.pages():
        assert "--8<--" not in path.read_text(), f"{path.relative_to(REPO)} still includes a snippet"
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert set(nav) == pages, f"in the nav only: {set(nav) - pages}; in docs/ only: {pages - set(nav)}"


# ----- every option the CLI has is documented, and no other ---------------------------------------

OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from lightning_elastic.launcher import cli

    top = cli.build_parser()
    return {"lightning-elastic": top, "launch": cli.verb_parser(top, "launch"),
            "timeline": cli.verb_parser(top, "timeline"), "agent": cli.verb_parser(top, "agent")}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}  # noqa: SLF001


def _table_options(text: str, header: str) -> set[str]:
    """The options named in the first cell of each row of the table under ``header``."""
    lines = text[text.index(header + "\n"):].splitlines()[2:]
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines))
    return {o for row in rows for o in OPTION.findall(row.split(" | ")[0])}


LAUNCH_TABLE = "| option | meaning | default | environment |"
OTHER_TABLE = "| option | meaning | default |"


@pytest.mark.parametrize("document", ["README.md", "docs/cli.md"])
def test_every_cli_option_is_in_the_option_tables_and_every_option_there_is_the_clis(document: str) -> None:
    text = (REPO / document).read_text()
    parsers = _parsers()
    launch = _options(parsers["launch"]) - {"-h", "--help"}
    others = _options(parsers["lightning-elastic"]) | _options(parsers["timeline"]) | _options(parsers["agent"])
    in_launch_table, in_other_table = _table_options(text, LAUNCH_TABLE), _table_options(text, OTHER_TABLE)
    assert launch - in_launch_table == set(), f"{document}: launch options without a row"
    assert in_launch_table - launch == set(), f"{document}: rows for options launch does not have"
    assert others - in_other_table == set(), f"{document}: options of lightning-elastic or timeline without a row"
    assert in_other_table - others == set(), f"{document}: rows for options no command has"


def test_the_readmes_synopsis_names_every_launch_option_and_no_other() -> None:
    readme = (REPO / "README.md").read_text()
    synopsis = readme[readme.index("```\nlightning-elastic --version\n"):readme.index("COMMAND [ARGS...]\n```")]
    named = set(OPTION.findall(synopsis.replace("[ARGS...]", "")))
    parsers = _parsers()
    every = (_options(parsers["launch"]) | _options(parsers["timeline"]) | _options(parsers["lightning-elastic"])
             | _options(parsers["agent"]))
    assert named - every == set(), "the synopsis names options no command has"
    for action in parsers["launch"]._actions:  # noqa: SLF001
        if action.option_strings and action.dest != "help":
            assert set(action.option_strings) & named, f"the synopsis lacks {'/'.join(action.option_strings)}"
