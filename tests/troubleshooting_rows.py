"""Ties a message the code really prints to its row in ``docs/troubleshooting.md``.

A row's message cell (the first cell, in backticks) writes the values a run fills in as
NAMES (``T``, ``N``, ``PATH``) and leaves tails out as ``...``; a message is documented when
some row's cell, read that way, matches it whole. The integration tests of the CLI's own
lines (``tests/integration/test_bad_inputs.py``) compare cells exactly; this looser reading
is for the worker's messages, whose rows elide the parts that vary more.
"""

from __future__ import annotations

import re
from pathlib import Path

TROUBLESHOOTING = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


def _pattern(cell: str) -> re.Pattern[str]:
    parts = re.split(r"(\.\.\.|\b[A-Z][A-Z_]*\b)", cell)
    return re.compile("".join(".*" if part == "..." else ".+?" if re.fullmatch(r"[A-Z][A-Z_]*", part)
                              else re.escape(part) for part in parts if part), re.S)


def documented_row(message: str) -> str | None:
    """The message cell of the first row that documents ``message``, or None."""
    for line in TROUBLESHOOTING.read_text().splitlines():
        match = re.match(r"\| `(.+?)` \|", line)
        if match and _pattern(match.group(1)).fullmatch(message):
            return match.group(1)
    return None


def assert_documented(message: str) -> None:
    assert documented_row(message), f"docs/troubleshooting.md has no row for {message!r}: add one"
