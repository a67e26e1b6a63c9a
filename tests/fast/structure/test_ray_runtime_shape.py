"""The Ray runtime's shape (issue 33): `RayRuntime` composes its parts instead of inheriting
them. It used to be `RayRuntime(RayCalls, WorkerReplacement)`, two mixins sharing private
state (the lost set, the incarnations, the worker factory) that `RayRuntime._start` created and
the recovery mixin changed. Now the rollout workers are one object (`RolloutActors`), and only
its module writes its state. Source read with ast: no Ray, no import of the package."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "eddyrl" / "runtime" / "ray"
ACTOR_SET = "RolloutActors"  # the class that owns the rollout actors' state
ACTOR_SET_MODULE = PACKAGE / "rollout_actors.py"
ALLOWED_BASES = {"object", "Protocol"}  # besides the protocols of eddyrl/runtime_protocol.py


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name}"
    return found[0]


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else ast.unparse(base)


def _modules() -> list[Path]:
    return sorted(PACKAGE.glob("*.py"))


def owned_state(cls: ast.ClassDef) -> set[str]:
    """The private attributes a class sets on itself (`self._name = ...`, in any method)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for element in ast.walk(target):
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) \
                        and element.value.id == "self" and element.attr.startswith("_"):
                    names.add(element.attr)
    return names


def touches(source: str, state: set[str]) -> list[tuple[int, str]]:
    """Each place `source` reaches one of `state`'s attributes on an object other than its own
    `self` (a write, a read, a method call on it, `setattr`/`getattr` by name): another module
    has no business with them at all, so this does not try to tell a read from a write. A
    class's `self._lost` is its own (no class of the package inherits another's: checked
    below), as `LocalRaySession`'s is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in state and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "getattr", "delattr", "hasattr") and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                node.args[1].value in state:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_check_finds_another_module_reaching_the_actor_sets_state():
    state = {"_handles", "_lost"}
    source = ("runtime.actors._lost.add(1)\nself.actors._handles[0] = h\n"
              "setattr(actors, '_lost', set())\nx = self._lostness\nself.actors.mark_lost(1)\n"
              "self._lost = set()\nprint(len(actors._handles))\n")
    assert [line for line, _ in touches(source, state)] == [1, 2, 3, 7]
    cls = ast.parse("class A:\n def __init__(self):\n  self._a, self.b = 1, 2\n"
                    "  self._c: int = 0\n def f(self, o):\n  o._d = 1\n  self._c += 1\n").body[0]
    assert owned_state(cls) == {"_a", "_c"}


def test_no_class_of_the_ray_runtime_inherits_from_another_of_its_classes():
    """Composition, not mixins: a class of the package inherits nothing of the package."""
    classes = {n.name for path in _modules() for n in _tree(path).body
               if isinstance(n, ast.ClassDef)}
    assert {"RayRuntime", ACTOR_SET} <= classes
    inherited = [f"{path.name}: {node.name}({_base_name(base)})" for path in _modules()
                 for node in _tree(path).body if isinstance(node, ast.ClassDef)
                 for base in node.bases if _base_name(base) in classes]
    assert not inherited, inherited


def test_ray_runtime_inherits_only_object_or_a_runtime_protocol():
    protocols = {n.name for n in _tree(ROOT / "eddyrl" / "runtime_protocol.py").body
                 if isinstance(n, ast.ClassDef)}
    runtime = _class(_tree(PACKAGE / "runtime.py"), "RayRuntime")
    bases = [_base_name(base) for base in runtime.bases]
    assert set(bases) <= ALLOWED_BASES | protocols, bases


def test_only_the_actor_set_reaches_its_own_state():
    state = owned_state(_class(_tree(ACTOR_SET_MODULE), ACTOR_SET))
    # what it owns: the handles, each worker's incarnation, the lost set (renamed: update here)
    assert {"_handles", "_incarnations", "_lost"} <= state, state
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text}"
                 for path in _modules() if path != ACTOR_SET_MODULE
                 for line, text in touches(path.read_text(), state)]
    assert not offenders, (f"only {ACTOR_SET_MODULE.name} reaches {ACTOR_SET}'s state "
                           f"{sorted(state)}; give it a method:\n" + "\n".join(offenders))
