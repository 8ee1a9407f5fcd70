"""Report import circles among the project's own modules, read from their source with ``ast``.

Every ``import`` and ``from ... import`` statement counts, wherever it stands: at module
level, inside a function, under ``if TYPE_CHECKING:`` (a circle of types is still a
circle of design). Not counted: the implicit import of a module's parent packages, and
modules named by string (``importlib.import_module("...")``). ``from package import name``
is an edge to ``package.name`` when that is a module of ours, else to ``package`` itself.

    python scripts/import_cycles.py                 # lightning_elastic/, the driver left out
    python scripts/import_cycles.py --launcher      # the driver too (launcher/ as lightning_elastic.launcher)

Prints each circle (a strongly connected set of modules and one loop through it) and
exits 1 if there is any, 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_elastic"
LAUNCHER = f"{PACKAGE}.launcher"


def modules(root: Path = ROOT, launcher: bool = False) -> dict[str, Path]:
    """Every module of ours by dotted name: lightning_elastic/ and, with ``launcher``, launcher/."""
    found = dict(_modules_under(root / PACKAGE, PACKAGE))
    if launcher:
        found.update(_modules_under(root / "launcher", LAUNCHER))
    return found


def _modules_under(folder: Path, dotted: str) -> Iterable[tuple[str, Path]]:
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join([dotted, *parts]), path


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_ours(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else _ours(submodule, known))
    found.discard("")
    found.discard(name)
    return found


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)


def _ours(dotted: str, known: set[str]) -> str:
    """The longest prefix of ``dotted`` that is a module of ours ("" if none; "" too for the
    driver's modules when they were left out, rather than the package they sit in)."""
    if LAUNCHER not in known and (dotted == LAUNCHER or dotted.startswith(LAUNCHER + ".")):
        return ""
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return ""


def graph(root: Path = ROOT, launcher: bool = False) -> dict[str, set[str]]:
    found = modules(root, launcher)
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        result.append(sorted(members))
    return result


def loop_through(members: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One shortest loop from the first member back to itself, inside the circle."""
    inside = set(members)
    start = members[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(edges[node] & inside):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    return members


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", action="store_true",
                        help="include the driver (launcher/, as lightning_elastic.launcher)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository's root")
    args = parser.parse_args(argv)
    edges = graph(args.root, args.launcher)
    found = circles(edges)
    scope = "lightning_elastic and its launcher" if args.launcher else "lightning_elastic (launcher left out)"
    for members in found:
        print(f"circle of {len(members)} modules: {' -> '.join(loop_through(members, edges))}")
    print(f"{len(edges)} modules of {scope}, {sum(map(len, edges.values()))} imports: "
          f"{len(found)} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
