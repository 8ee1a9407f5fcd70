"""``lightning_elastic/__init__.py`` says twice where each public name lives: in ``_EXPORTS``
(what ``le.NAME`` loads at run time) and in the ``TYPE_CHECKING`` imports (what type
checkers and IDEs read). Nothing runs the second at run time, so a name imported there from
the wrong module went unnoticed; no type checker is installed here, hence this check."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import lightning_elastic as le

INIT = Path(le.__file__)


def type_checking_imports() -> dict[str, str]:
    """Name -> the module the ``if TYPE_CHECKING:`` block imports it from."""
    tree = ast.parse(INIT.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
                found.update({alias.name: str(statement.module) for alias in statement.names})
    return found


def test_the_type_checking_imports_name_the_modules_the_exports_load_from() -> None:
    imports = type_checking_imports()
    assert imports == le._MODULE_OF  # noqa: SLF001 - the table itself is what is checked
    assert sorted(imports) == sorted(le.__all__)


def test_every_type_checking_import_exists_where_it_is_imported_from() -> None:
    for name, module in type_checking_imports().items():
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
