"""Shared fixtures (a tiny random Qwen3 + character tokenizer saved as an HF directory; the
subject fixtures of tests/support/fixtures_*.py) and the test tiers.

A test's tier is the folder it lives in, and nothing else:

- tests/fast/: pure logic: no model built, no Ray, no subprocess (`python -m pytest -q -m fast`,
  or `python -m pytest -q tests/fast`);
- tests/integration/, tests/faults/, tests/multinode/: the tiny model on the CPU, local Ray,
  CLI subprocesses, wheel builds, killed workers, network-namespace hosts (`-m integration`;
  `slow` is a subset of it);
- tests/hardware/: needs an accelerator and skips without one (`-m hardware`). A test anywhere
  else that runs on an accelerator platform (parametrized over `platform`, `accelerator` or
  `platform_name` with a non-CPU value, or marked `hardware`) is hardware too: the HAL
  contract tests run their `[cpu]` case in their own tier.

What is left of the old inference is a check (`tier_problems`, asserted by
tests/fast/project/test_tiers.py): a test under tests/fast/ whose code, fixtures or tests-tree
helpers name something in USES (builds a model, imports vLLM, uses Ray, starts a subprocess), or
that is marked `slow`, or a module outside the tier folders, is reported. `EDDY_TIER_CHECK=1`
also watches the fast tests as they run: one that imports or starts Ray, builds a
transformers/vLLM model or runs `eddy` in a subprocess fails, naming what it did.

Helpers shared by tests of several folders live in tests/support/ (on sys.path, so tests import
them by name: `from scripted_engine import ScriptedEngine`).
"""

import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
# tests/support: helpers imported by name from any folder, and by the processes tests start
sys.path.insert(0, str(TESTS_DIR / "support"))
pytest_plugins = ["fixtures_engines", "fixtures_envs", "fixtures_hal"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from eddyrl.models.tiny import build_tiny_model, build_tokenizer

    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# --------------------------------------------------------------------------------- test tiers

TIERS = ("fast", "integration", "hardware")
# the tier of each top folder of tests/
FOLDER_TIERS = {"fast": "fast", "integration": "integration", "faults": "integration",
                "multinode": "integration", "hardware": "hardware"}

# Names a test under tests/fast/ may not use (the check): matched against the names a test's code,
# its fixtures' code and the tests-tree helpers they call refer to (globals, attributes,
# imports), and against the modules those names are bound to.
USES = {
    # builds a torch model: the tiny model, an HF checkpoint, an engine or trainer loading one
    "build_tiny_model": "builds a model",
    "AutoModelForCausalLM": "builds a model",
    "HFInferenceEngine": "builds a model",
    "VLLMInferenceEngine": "builds a model",
    "FSDPTrainEngine": "builds a model",
    "TrainerRank": "builds a model",
    "run_sft": "builds a model",
    # vLLM: importing it takes seconds
    "vllm": "imports vLLM",
    "VLLMApi": "imports vLLM",
    # Ray
    "ray": "uses Ray",
    "start_ray": "uses Ray",
    "RayRuntime": "uses Ray",
    # other processes (`eddy` on the command line, spawned ranks, the Python tool's sandbox)
    "subprocess": "starts a subprocess",
    "multiprocessing": "starts a subprocess",
    "torch.multiprocessing": "starts a subprocess",
    "PythonSandbox": "starts a subprocess",
}

PLATFORM_PARAMS = ("platform", "accelerator", "platform_name")
_RECORDS = pytest.StashKey[dict]()
_TIER = pytest.StashKey[str]()


_IN_TREE: dict[str, bool] = {}


def _in_tests_tree(filename: str) -> bool:
    if filename not in _IN_TREE:
        try:
            _IN_TREE[filename] = Path(filename).resolve().is_relative_to(TESTS_DIR)
        except (OSError, ValueError, TypeError):
            _IN_TREE[filename] = False
    return _IN_TREE[filename]


def _callables_of(value):
    """The code objects (with their globals) that a function or class of the tests tree runs."""
    if isinstance(value, type):
        for klass in value.__mro__:
            module = sys.modules.get(klass.__module__)
            if _in_tests_tree(getattr(module, "__file__", None) or ""):
                for member in vars(klass).values():
                    yield from _callables_of(getattr(member, "__func__", member))
        return
    if not callable(value):
        return
    function = inspect.unwrap(getattr(value, "__func__", value))
    code = getattr(function, "__code__", None)
    if isinstance(code, types.CodeType) and _in_tests_tree(code.co_filename):
        yield code, getattr(function, "__globals__", {})


def _use(name: str) -> str | None:
    return USES.get(name) or USES.get(name.split(".")[0])  # `import ray.util` names "ray.util"


_SIGNALS: dict[int, str | None] = {}  # by code object, for the whole session


def code_signal(code: types.CodeType, namespace: dict) -> str | None:
    """Why this code is integration by USES (following tests-tree helpers), or None."""
    if id(code) in _SIGNALS:
        return _SIGNALS[id(code)]
    _SIGNALS[id(code)] = None  # a helper calling back into this one adds nothing new
    why, follow = None, []
    for name in code.co_names:  # what this code names itself, before what it calls
        value = namespace.get(name)
        if _use(name):
            why = f"{_use(name)} ({name} in {code.co_name})"
        elif isinstance(value, types.ModuleType) and _use(value.__name__):
            why = f"{_use(value.__name__)} ({value.__name__} in {code.co_name})"
        elif value is not None and not isinstance(value, types.ModuleType):
            follow.append(value)
        if why:
            break
    follow += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    for value in follow if why is None else ():
        inner = [(value, namespace)] if isinstance(value, types.CodeType) else _callables_of(value)
        why = next(filter(None, (code_signal(c, n) for c, n in inner)), None)
        if why:
            break
    _SIGNALS[id(code)] = why
    return why


def _function_signal(function) -> str | None:
    return next(filter(None, (code_signal(c, n) for c, n in _callables_of(function))), None)


_PLATFORM_KINDS: dict[str, bool] = {}


def _is_accelerator(name: str) -> bool:
    if name not in _PLATFORM_KINDS:
        try:
            from eddyrl.hal import get_platform, known_platforms

            _PLATFORM_KINDS[name] = (name in known_platforms() and get_platform(
                name, require_available=False).device_type != "cpu")
        except Exception:  # the HAL does not import: go by the name
            _PLATFORM_KINDS[name] = "cpu" not in name
    return _PLATFORM_KINDS[name]


def folder_tier(path) -> str | None:
    """The tier of a test file's folder (None: outside the tier folders)."""
    path = Path(str(path)).resolve()
    if not path.is_relative_to(TESTS_DIR):
        return None
    return FOLDER_TIERS.get(path.relative_to(TESTS_DIR).parts[0])


def fast_test_uses(item) -> str | None:
    """What a test (its code, its fixtures', the tests-tree helpers they call) names from USES."""
    function = getattr(item, "function", None)
    why = _function_signal(function) if function is not None else None
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        if why:
            break
        for definition in definitions.get(name, ()):
            why = _function_signal(definition.func)
            if why:
                why = f"fixture {name} {why}"
                break
    return why


def classify(item) -> tuple[str, str]:
    """(the tier of a collected test, why)."""
    names = {mark.name for mark in item.iter_markers()}
    if "hardware" in names:
        return "hardware", "marked so"
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in PLATFORM_PARAMS:
        if isinstance(params.get(key), str) and _is_accelerator(params[key]):
            return "hardware", f"runs on {params[key]}"
    tier = folder_tier(item.path)
    return (tier, "its folder") if tier else ("none", "outside the tier folders")


def tier_problems(records: dict) -> list[str]:
    """What breaks the tier rules in {test id: (marker names, what a fast test uses)}: a test
    outside the tier folders, a tier mark that is not its folder's, a `slow` test or one that
    uses a model, Ray or a subprocess in the fast tier."""
    problems = []
    for nodeid, (names, uses) in records.items():
        tiers = [tier for tier in TIERS if tier in names]
        if len(tiers) != 1:
            problems.append(f"{nodeid}: {len(tiers)} tiers {tiers}, needs exactly one of {TIERS}"
                            " (tests/fast, tests/integration, ... decide it)")
        elif tiers == ["fast"] and "slow" in names:
            problems.append(f"{nodeid}: marked slow but under tests/fast")
        elif tiers == ["fast"] and uses:
            problems.append(f"{nodeid}: under tests/fast but {uses}: it belongs in "
                            "tests/integration")
    return problems


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    records = config.stash.setdefault(_RECORDS, {})
    for item in items:
        tier, why = classify(item)
        marked = {mark.name for mark in item.iter_markers()} & set(TIERS)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        item.stash[_TIER] = tier
        item.user_properties.append(("tier", f"{tier}: {why}"))
        names = {mark.name for mark in item.iter_markers()}
        if marked - {tier}:  # a mark that disagrees with the folder: two tiers, reported
            names |= marked
        records[item.nodeid] = (names, fast_test_uses(item) if tier == "fast" else None)


@pytest.fixture
def tier_rules(request):
    """The tier rules and what they made of this session's collected tests (all of them,
    whatever `-m` then selected)."""
    return types.SimpleNamespace(records=dict(request.config.stash.get(_RECORDS, {})),
                                 problems=tier_problems, classify=classify,
                                 code_signal=code_signal, tiers=TIERS,
                                 folder_tier=folder_tier, tests_dir=TESTS_DIR)


# ------------------------------------------------------ EDDY_TIER_CHECK=1: watch the fast tier

_CHECK = os.environ.get("EDDY_TIER_CHECK") == "1"
_seen_by_check: list[str] = []  # what the running fast test did that it should not
_watched = [0]


def _model_init(original):
    def __init__(self, *args, **kwargs):
        kinds = type(self).__mro__
        if any(k.__name__ == "PreTrainedModel" or k.__name__.endswith("ForCausalLM")
               for k in kinds):  # a transformers or vLLM model, not a torch.nn.Linear
            _seen_by_check.append(f"built a model ({type(self).__name__})")
        original(self, *args, **kwargs)
    return __init__


def _eddy_popen(original):
    def __init__(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        words = [os.fsdecode(a) for a in argv if isinstance(a, (str, bytes, os.PathLike))]
        if any("eddyrl.cli" in w for w in words) or (words and Path(words[0]).name == "eddy"):
            _seen_by_check.append(f"ran eddy in a subprocess ({' '.join(words)[:80]})")
        original(self, args, *rest, **kwargs)
    return __init__


def pytest_configure(config):
    if _CHECK:
        torch.nn.Module.__init__ = _model_init(torch.nn.Module.__init__)
        subprocess.Popen.__init__ = _eddy_popen(subprocess.Popen.__init__)


def _check_phase(item, phase):
    if not _CHECK or item.stash.get(_TIER, None) != "fast":
        return (yield)
    _seen_by_check.clear()
    _watched[0] += phase == "call"
    had_ray = "ray" in sys.modules
    result = yield
    if "ray" in sys.modules and not had_ray:
        _seen_by_check.append("imported ray")
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        _seen_by_check.append("started Ray")
    if _seen_by_check:
        found = "; ".join(dict.fromkeys(_seen_by_check))
        _seen_by_check.clear()
        pytest.fail(f"EDDY_TIER_CHECK: this fast test {found} in its {phase}: it belongs in "
                    "integration (see the tier rules in tests/conftest.py)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _check_phase(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _check_phase(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _check_phase(item, "teardown"))


def pytest_terminal_summary(terminalreporter, config):
    if _CHECK:
        terminalreporter.write_line(
            f"EDDY_TIER_CHECK: watched {_watched[0]} fast tests for Ray, models and eddy "
            f"subprocesses; ray {'is' if 'ray' in sys.modules else 'is not'} imported in this "
            "process (collection imports every test module, whatever -m selects)")
