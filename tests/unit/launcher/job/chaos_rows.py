"""The chaos matrix's cases (scripts/chaos_matrix.py renders docs/reliability.md from them),
for the table tests of exit classification and liveness to check their coverage against:
every case is either covered by a row or named with what decides it instead."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

CHAOS_MATRIX = Path(__file__).resolve().parents[4] / "scripts" / "chaos_matrix.py"


@cache
def matrix_cases() -> dict[int, str]:
    """Case number (as in docs/reliability.md) -> its fault."""
    spec = importlib.util.spec_from_file_location("_chaos_matrix", CHAOS_MATRIX)
    assert spec is not None and spec.loader is not None, CHAOS_MATRIX
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {number: fault for number, (_, _, fault, _, _) in module.all_cases()}


def coverage_gaps(covered: set[int], elsewhere: dict[int, str]) -> dict[str, list[int]]:
    """What is wrong with a table's account of the matrix (empty when nothing is)."""
    cases = set(matrix_cases())
    return {name: sorted(numbers) for name, numbers in {
        "neither covered nor said to be decided elsewhere": cases - covered - set(elsewhere),
        "both covered and said to be decided elsewhere": covered & set(elsewhere),
        "not cases of the matrix": (covered | set(elsewhere)) - cases,
    }.items() if numbers}
