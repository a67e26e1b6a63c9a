"""Names in the docs exist: a renamed or deleted module, class or test fails here, not in a
reader's head. Reads files only (ast, never an import), so it stays in the fast tier.

Where it looks: README.md, SECURITY.md, docs/*.md, the READMEs under eddyrl/, examples/ and
bench/results/, and the docstrings and comments of eddyrl/**/*.py. What it checks, each form
precisely (anything else is prose; a backticked bare `name` is not checked: most are config
values or other projects' names):

1. A path with a slash whose first folder is a repository root (`eddyrl/`, `bench/`, `tests/`,
   `examples/`, `docs/`) or a folder of eddyrl/ (`core/moves.py` is eddyrl/core/moves.py): it
   exists. A path with no file extension and no trailing slash is checked only from a root;
   a user's own file is written `./name.py`.
2. A backticked bare file name (`moves.py`): some file of eddyrl/, tests/, bench/ or examples/
   has that name. In docstrings and comments the file's own folder is tried first.
3. A dotted name `eddyrl.a.b`, `eddyrl.a.b.Name`, `eddyrl.a.b:Name`: the longest prefix that is
   a module or package exists, and the rest is a name defined at its top level (a def, class,
   assignment or import); one more part is looked up in that class. Entry-point group names
   (a module-level `*ENTRY_POINT*` string of eddyrl/) are not modules and are skipped.
4. `path.py::Name` and `path.py::Class::name` (pytest's node ids; the path by rules 1-2): the
   names are defined in that file.
5. A module named nearby: a backticked path to a .py file followed by backticked identifiers
   (`core/moves.py` (`restart`, `worker_lost`)): each is defined somewhere in that module (or
   is a string in it: a table's key); for a test file, each is part of a test's name, as
   `pytest -k` takes it.
6. `dir/module.name` (`runtime/placement.weight_channel_kind`): as 3 for that module.
7. A backticked `Class.member` whose Class is a class of eddyrl/: some class of that name (or
   one of its bases) defines the member, as a def, a class-level or `self.` assignment. A class
   that eddyrl/ does not define (`GRPOTrainer`) is someone else's and not checked.
"""

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "eddyrl"
ROOTS = ("eddyrl", "bench", "tests", "examples", "docs")
SEARCHED = ("eddyrl", "tests", "bench", "examples")  # where a bare file name may live
EXTENSION = re.compile(r"\.(py|md|yaml|yml|json|toml|sh|txt|jsonl|cfg)$")

PATH = re.compile(r"(?<![\w/.~-])((?:[\w-]+/)+(?:[\w.-]*[\w/])?)")
BARE = re.compile(r"`(\w+\.py)`")
DOTTED = re.compile(r"(?<![\w./-])(eddyrl(?:\.\w+)+(?::\w+(?:\.\w+)*)?)")
NODE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)((?:::\w+)+)")
NEARBY = re.compile(r"`((?:[\w-]+/)*\w+\.py)`\s*\(?\s*((?:`\w+`(?:,\s*|\s+and\s+)?)+)")
MODULE_ATTR = re.compile(
    r"(?<![\w./-])((?:[\w-]+/)+\w+)\.(?!(?:py|md|yaml|yml|json|toml|sh|txt|jsonl|cfg)\b)"
    r"([A-Za-z_]\w*)\b(?![./]\w)")
MEMBER = re.compile(r"`([A-Z]\w*)\.([A-Za-z_]\w*)(?:\(\))?`")


# ------------------------------------------------------------------------- what a file defines

@cache
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None


def _targets(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
    names = []
    for target in targets:
        for leaf in ast.walk(target):
            if isinstance(leaf, ast.Name):
                names.append(leaf.id)
    return names


def _body_names(body) -> set[str]:
    """Names a module or class body defines, through `if`/`try` blocks (TYPE_CHECKING, optional
    imports)."""
    names = set()
    for node in body:
        names.update(_targets(node))
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            handlers = [h.body for h in getattr(node, "handlers", [])]
            for block in (node.body, getattr(node, "orelse", []),
                          getattr(node, "finalbody", []), *handlers):
                names |= _body_names(block)
    return names


def top_level_names(path: Path) -> set[str]:
    tree = _tree(path)
    return _body_names(tree.body) if tree else set()


def names_anywhere(path: Path) -> set[str]:
    """Every def, class and assigned name or attribute in a module, at any depth, and its
    identifier-like strings (a table's keys: `scheduler/hardware.py` (`H100`))."""
    tree = _tree(path)
    names = set()
    for node in ast.walk(tree) if tree else ():
        names.update(_targets(node))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def defines_nearby(path: Path, name: str) -> bool:
    """Rule 5. In a test file a cited name is what `pytest -k` takes: part of a test's name."""
    names = names_anywhere(path)
    if "tests" in path.relative_to(ROOT).parts[:1]:
        return any(name in n for n in names if n.startswith("test"))
    return name in names


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of eddyrl/ by name (a name may be defined in more than one module)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(_tree(path) or ast.Module(body=[])):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
    return found


def class_defines(name: str, member: str, seen: frozenset = frozenset()) -> bool:
    for node in classes().get(name, []):
        members = _body_names(node.body)
        for leaf in ast.walk(node):
            if (isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store)
                    and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"):
                members.add(leaf.attr)
        if member in members:
            return True
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases]
        if any(b and b not in seen and class_defines(b, member, seen | {name}) for b in bases):
            return True
    return False


@cache
def entry_point_groups() -> frozenset[str]:
    groups = set()
    for path in PACKAGE.rglob("*.py"):
        for node in (_tree(path) or ast.Module(body=[])).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and "ENTRY_POINT" in t.id
                            for t in node.targets)):
                groups.add(node.value.value)
    return frozenset(groups)


# ----------------------------------------------------------------------------- resolving names

@cache
def _files_named(name: str) -> tuple[Path, ...]:
    return tuple(p for top in SEARCHED for p in (ROOT / top).rglob(name)
                 if "__pycache__" not in p.parts)


def resolve_path(text: str, here: Path | None = None) -> list[Path] | None:
    """The files a cited path may mean, [] when it is checkable and names nothing, None when it
    is not a path this checker reads (rules 1-2)."""
    text = text.rstrip(".")
    if "/" not in text:  # a bare file name
        if not text.endswith(".py"):
            return None
        local = [here / text] if here and (here / text).exists() else []
        return local or list(_files_named(text))
    first, last = text.split("/")[0], text.rstrip("/").split("/")[-1]
    if text.rstrip("/") == first or "." in last and not EXTENSION.search(last):
        return None  # one word and a slash (prose), or `dir/module.name` (rule 6)
    if first in ROOTS:
        base = ROOT
    elif first in package_folders() and (EXTENSION.search(last) or text.endswith("/")):
        base = PACKAGE
    else:
        return None
    path = base / text
    return [path] if path.exists() else []


@cache
def package_folders() -> frozenset[str]:
    return frozenset(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")


def check_dotted(name: str) -> str | None:
    """Why `eddyrl.a.b[:Name]` names nothing, or None (rule 3)."""
    if name in entry_point_groups():
        return None
    module_part, _, attr_part = name.partition(":")
    parts = module_part.split(".")
    attrs = attr_part.split(".") if attr_part else []
    for cut in range(len(parts), 0, -1):
        base = PACKAGE.parent.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else (
            base / "__init__.py" if (base / "__init__.py").is_file() else None)
        if module is not None:
            return check_attrs(module, parts[cut:] + attrs, name)
    return f"{name}: no module eddyrl"


def check_attrs(module: Path, attrs: list[str], cited: str) -> str | None:
    if not attrs:
        return None
    if attrs[0] not in top_level_names(module):
        return f"{cited}: {attrs[0]} is not defined in {module.relative_to(ROOT)}"
    if len(attrs) > 1 and attrs[0] in classes() and not class_defines(attrs[0], attrs[1]):
        return f"{cited}: {attrs[0]} has no {attrs[1]}"
    return None


# ----------------------------------------------------------------------------- checking a text

def problems_in(text: str, source: str, here: Path | None = None) -> list[str]:
    """Every citation in `text` that names nothing, as 'source: what'. `here` is the folder of
    the file the text comes from (a docstring's module), tried first for bare file names."""
    found = []

    def missing(what: str):
        found.append(f"{source}: {what}")

    for match in PATH.finditer(text):
        cited = match.group(1)
        if resolve_path(cited, here) == []:
            missing(f"{cited} does not exist")
    for cited in BARE.findall(text):
        if resolve_path(cited, here) == []:
            missing(f"{cited} does not exist")
    for cited in DOTTED.findall(text):
        if (why := check_dotted(cited.rstrip("."))) is not None:
            missing(why)
    for path_text, names in NODE.findall(text):  # a bare name may mean several files: any one
        parts = names.strip(":").split("::")
        whys = [check_attrs(m, parts, path_text + names) for m in resolve_path(path_text, here)
                or [] if m.suffix == ".py"]
        if whys and all(whys):
            missing(whys[0])
    for path_text, names in NEARBY.findall(text):
        modules = [m for m in resolve_path(path_text, here) or [] if m.suffix == ".py"]
        for name in re.findall(r"`(\w+)`", names):
            if modules and not any(defines_nearby(m, name) for m in modules):
                missing(f"{name} is not defined in {path_text}")
    for path_text, name in MODULE_ATTR.findall(text):
        modules = resolve_path(path_text + ".py", here)
        if modules and (why := check_attrs(modules[0], [name], f"{path_text}.{name}")):
            missing(why)
    for cls, member in MEMBER.findall(text):
        if cls in classes() and not class_defines(cls, member):
            missing(f"{cls}.{member}: {cls} has no {member}")
    return found


def docstrings_and_comments(path: Path) -> str:
    tree = _tree(path)
    parts = []
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    try:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        parts += [t.string for t in tokens if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        pass
    return "\n".join(parts)


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(PACKAGE.rglob("README.md")), ROOT / "bench" / "results" / "README.md",
            *sorted((ROOT / "examples").rglob("README.md"))]


# ---------------------------------------------------------------------------------- the tests

def test_paths_and_names_cited_in_the_docs_exist():
    found = []
    for page in pages():
        found += problems_in(page.read_text(), str(page.relative_to(ROOT)), page.parent)
    assert not found, "the docs cite what is not there:\n" + "\n".join(found)


def test_paths_and_names_cited_in_docstrings_and_comments_exist():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += problems_in(docstrings_and_comments(path), str(path.relative_to(ROOT)),
                             path.parent)
    assert not found, "docstrings and comments cite what is not there:\n" + "\n".join(found)


def test_the_architecture_map_names_every_package_and_module():
    """A new module or package is placed on the map when it is added: every folder of eddyrl/
    that holds code (and each top-level one) is named `name/`, every module `name.py`, in the
    package map's block (by name: the map's layout is for readers, not parsed)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Package map", 1)[1].split("```")[1]
    missing = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts or path.name == "__init__.py":
            continue
        if path.is_dir() and (len(rel.parts) == 1 or any(path.glob("*.py"))):
            if not re.search(rf"(?<![\w-]){re.escape(path.name)}/", block):
                missing.append(f"eddyrl/{rel}/")
        elif path.suffix == ".py" and not re.search(rf"(?<![\w-]){re.escape(path.name)}", block):
            missing.append(f"eddyrl/{rel}")
    assert not missing, "docs/architecture.md's package map leaves out:\n" + "\n".join(missing)


def test_the_checker_catches_planted_bad_references():
    planted = {
        "`eddyrl/core/no_such_module.py`": "no_such_module.py does not exist",
        "see core/nowhere.py for it": "core/nowhere.py does not exist",
        "`tests/fast/core/` and `eddyrl/no_folder/`": "eddyrl/no_folder/ does not exist",
        "`not_a_module_anywhere.py`": "not_a_module_anywhere.py does not exist",
        "`eddyrl.core.no_such.thing`": "no_such is not defined in eddyrl/core/__init__.py",
        "`eddyrl.core.controller:NoSuchName`": "NoSuchName is not defined",
        "`eddyrl.core.controller.Controller.no_such_method`": "Controller has no no_such_method",
        "`tests/fast/project/test_docs.py::test_that_was_never_written`": "test_that_was_never_written",
        "`core/moves.py` (`restart`, `vanished_method`)": "vanished_method is not defined",
        "`tests/fast/project/test_docs.py` (`readme_is_at_most`, `no_such_test`)": "no_such_test",
        "`runtime/placement.no_such_function`": "no_such_function is not defined",
        "`Controller.no_such_step`": "Controller has no no_such_step",
    }
    for text, expected in planted.items():
        found = problems_in(text, "fixture")
        assert len(found) == 1 and expected in found[0], (text, found)


def test_the_checker_passes_good_references_and_leaves_prose_alone():
    good = ("`eddyrl/core/controller.py`, `core/moves.py` (`restart`, `worker_lost`), "
            "`eddyrl.tasks.math_reward:reward`, `eddyrl.core.controller.Controller.step`, "
            "`tests/fast/project/test_docs.py::test_the_readme_is_at_most_12_kb`, `Controller.step`, "
            "`eddyrl.platforms` entry points, `runtime/placement.weight_channel_kind`, "
            "`moves.py`, `eddyrl/configs/modes/`.\n"
            # prose that looks like a path or a name but is not one of the forms above
            "train/rollout balance, `window.max_staleness`, `GRPOTrainer.train`, runs/<date>/, "
            "https://github.com/x/y/blob/main/train.py, `rollout.engine=vllm`, and/or, "
            "a user's `./myreward.py`, eddyrl/assets/tiny_warmstart/model.safetensors.\n")
    assert problems_in(good, "fixture") == []
