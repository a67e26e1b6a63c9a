"""The package's import graph, read from the source (nothing is imported): which module
imports which, at import time or inside a function (a lazy import is still a dependency), but
not under `if TYPE_CHECKING:` (annotations only; never executed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "eddyrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool,
             modules: frozenset[str] = frozenset()) -> set[str]:
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            named = {f"{target}.{alias.name}" for alias in node.names}
            # `from . import x` / `from .pkg import module`: the submodule is the dependency;
            # `from . import a, b` of submodules only needs nothing of the package itself (an
            # ancestor, imported before the importing module anyway)
            if node.module is not None or not named <= modules:
                found.add(target)
            found.update(named)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the eddyrl modules it imports (names that are not modules are dropped)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in paths.items():
        raw = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py",
                       frozenset(paths))
        edges[name] = {target for target in raw if target in paths and target != name}
    return edges


def lines_matching(folder: str, pattern: re.Pattern[str]) -> list[str]:
    """`path:line: text` for each line of eddyrl/`folder`'s modules that `pattern` finds."""
    return [f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)]


def package_of(module: str) -> str:
    """`eddyrl.core.rollout` -> `core`; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph() -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for source, targets in graph().items():
        edges = packages.setdefault(package_of(source), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(source))
    return packages


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found
