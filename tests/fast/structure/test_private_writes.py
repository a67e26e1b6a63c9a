"""One owner per piece of state in core/: no module writes another object's private attribute
(`other._name = ...`, `other._name[k] = ...`, `other._name += ...`, `setattr(other, "_name",
...)`) or changes it through its methods (`other._queue.append(...)`); an object's private state
changes only through its own methods (a checkpoint goes through `state()` / `restore()`, the
version assignment through `take_back`, ...)."""

import ast

from import_graph import ROOT

CORE = ROOT / "eddyrl" / "core"
OWN = ("self", "cls")  # an object's own attributes


def _private(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
        not node.attr.startswith("__")


def _others(node: ast.AST) -> bool:
    """`node` is a private attribute of an object other than this one."""
    return _private(node) and not (isinstance(node.value, ast.Name) and node.value.id in OWN)


def _written(target: ast.AST) -> list[ast.Attribute]:
    """The private attributes of another object that assigning to `target` changes."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for element in target.elts for a in _written(element)]
    if isinstance(target, ast.Starred):
        return _written(target.value)
    if isinstance(target, ast.Subscript):  # other._table[k] = ...: its contents change
        target = target.value
    if _others(target):
        return [target]
    return []


def private_writes(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "setattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and \
                str(node.args[1].value).startswith("_") and \
                not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN):
            found.append((node.lineno, ast.unparse(node.func) + f"(..., {node.args[1].value!r})"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                _others(node.func.value):  # other._queue.append(...): changed through it
            found.append((node.lineno, ast.unparse(node.func)))
        for target in targets:
            found += [(a.lineno, ast.unparse(a)) for a in _written(target)]
    return found


def test_the_check_finds_writes_to_another_objects_private_attributes():
    source = ("controller._ids = 1\nself.rollout._rows['g'] = []\na._n += 1\n"
              "setattr(other, '_x', 2)\nc._queue.append(g)\nself._mine = 3\n"
              "self._rows['g'] = []\nself._queue.append(g)\nt._asdict()\n")
    assert [line for line, _ in private_writes(source)] == [1, 2, 3, 4, 5]


def test_no_core_module_writes_another_objects_private_attributes():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for path in sorted(CORE.rglob("*.py"))
                 for line, name in private_writes(path.read_text())]
    assert not offenders, ("core/ modules write private attributes of other objects; give the "
                           "owner a method (state/restore, take_back, ...):\n" +
                           "\n".join(offenders))
