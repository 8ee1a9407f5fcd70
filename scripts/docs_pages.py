"""Write the documentation pages that are sections of README.md, whole, into docs/.

The README is the one source of these pages' text (its sections between ``--8<--``
markers). They used to be included when the site was built (pymdownx.snippets), which left
docs/*.md as one-line stubs to whoever read them anywhere else (on GitHub, in an editor, a
checkout). Each page is now written out here, with a first line saying where it comes from:

    python scripts/docs_pages.py            # write every page from README.md
    python scripts/docs_pages.py --check    # exit 1, naming the pages, if one is out of date

``tests/test_docs.py`` runs the check: a README edit that leaves a page behind fails it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"


class Section(str):
    """A section of README.md by its marker's name: its lines between
    ``<!-- --8<-- [start:NAME] -->`` and ``<!-- --8<-- [end:NAME] -->``."""


# Each page: its parts in order, a Section or text of its own (a title, a picture).
PAGES: dict[str, tuple[str, ...]] = {
    "index.md": ("# lightning-elastic", Section("intro"), "## The two commands", Section("commands"),
                 "## Installing it", Section("install")),
    "quickstart/loop.md": ("# Quickstart: a hand-written loop", Section("loop")),
    "quickstart/lightning.md": ("# Quickstart: PyTorch Lightning", Section("lightning")),
    "quickstart/fabric.md": ("# Quickstart: Lightning Fabric", Section("fabric")),
    "cli.md": ("# CLI reference", Section("cli"),
               "![the demo's timeline: world size 2, then 1 after a SIGKILL, then 2 again when a host joins]"
               "(images/timeline.png)",
               Section("cli-after-timeline")),
    "multiple-machines.md": ("# Multiple machines", Section("machines")),
    "ray.md": ("# Running on Ray", Section("ray")),
    "slurm.md": ("# Running on Slurm", Section("slurm")),
    "kubernetes.md": ("# Running on Kubernetes", Section("kubernetes")),
    "faults.md": ("# Faults and how a job ends", Section("faults")),
}

HEADER = ("<!-- Written by scripts/docs_pages.py from the README's sections: edit README.md, then run "
          "python scripts/docs_pages.py. -->")


def section(readme: str, name: str) -> str:
    start = f"<!-- --8<-- [start:{name}] -->\n"
    end = f"<!-- --8<-- [end:{name}] -->"
    if readme.count(start) != 1 or readme.count(end) != 1:
        raise SystemExit(f"README.md: expected one section {name!r} (its start and end markers)")
    return readme[readme.index(start) + len(start):readme.index(end)].strip("\n")


def page(readme: str, parts: tuple[str, ...]) -> str:
    blocks = [section(readme, p) if isinstance(p, Section) else p for p in parts]
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


def pages(root: Path = ROOT) -> dict[Path, str]:
    """Every page's path and the text it must have."""
    readme = (root / README).read_text()
    return {root / "docs" / name: page(readme, parts) for name, parts in PAGES.items()}


def out_of_date(root: Path = ROOT) -> list[Path]:
    return [path for path, text in pages(root).items() if not path.exists() or path.read_text() != text]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are out of date (exit 1)")
    args = parser.parse_args(argv)
    if args.check:
        stale = out_of_date()
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not README.md's sections: run python scripts/docs_pages.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
