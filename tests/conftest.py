"""Shared fixtures: a tiny random Qwen3 + character tokenizer saved as an HF directory.

And the test tiers, decided here and nowhere else (test modules carry no tier marks of their
own unless they want to overrule these rules). Every collected test gets exactly one of

- `fast`: pure logic: no model built, no Ray, no subprocess (`python -m pytest -q -m fast`);
- `integration`: the tiny model on the CPU, local Ray, CLI subprocesses, wheel builds
  (`-m integration`; `slow` is a subset of it);
- `hardware`: needs an accelerator and skips without one (`-m hardware`).

The rules, first match wins (`classify`):

1. a tier mark the test sets itself (`@pytest.mark.fast`, `pytestmark = pytest.mark.hardware`);
2. a module under tests/hardware/ -> hardware;
3. a test parametrized over a platform (`platform`, `accelerator`, `platform_name`) that is not
   a CPU one -> hardware (the HAL contract tests: `[cpu]` goes on through these rules);
4. `slow` -> integration;
5. the test, a helper of the tests tree that it calls, or one of its fixtures (transitively:
   `tiny_model_dir` builds a model) names something in USES -> integration;
6. a module whose file name matches INTEGRATION_MODULES -> integration;
7. everything else -> fast.

`EDDY_TIER_CHECK=1` checks the fast tests as they run: one that imports or starts Ray, builds
a transformers/vLLM model or runs `eddy` in a subprocess fails, naming what it did.
"""

import fnmatch
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch


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
TESTS_DIR = Path(__file__).resolve().parent

# Names whose use makes a test integration (rule 5): matched against the names a test's code,
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

# Rule 6, for modules no better signal covers: fnmatch patterns on the test file's name (not
# its folder, so that moving a file keeps its tier). Each says why.
INTEGRATION_MODULES = {
    "test_e2e_*": "end-to-end runs of `eddy train` on the tiny model",
    "test_eval_cli.py": "`eddy eval` loads the shipped warm-start checkpoint",
    "test_wheel*": "builds and installs the wheel",
    # Pure logic, but whole simulated runs of the controller (seconds each): together they
    # would take half of the fast tier's 30 s. The simulator's parts (engine, clock, sequences,
    # policies, cost model) stay fast.
    "test_simulator.py": "whole simulated runs",
    "test_sim_cli.py": "`eddy sim` and `eddy bench sim` runs",
    "test_resume.py": "simulated runs checkpointed and resumed",
    "test_run_report.py": "`eddy report` draws every plot of a run (matplotlib)",
    # Pure logic too, but it loads every mode in every scenario and source: about 6 s on two
    # cores even at ~23 ms a load_config (the schema built once), a fifth of the fast budget.
    "test_modes.py": "every mode's settings in real runs, bench and the simulator",
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


def classify(item) -> tuple[tuple[str, ...], str]:
    """(the tiers of a collected test, why): one tier unless the test marks itself with two."""
    names = {mark.name for mark in item.iter_markers()}
    explicit = tuple(tier for tier in TIERS if tier in names)
    if explicit:
        return explicit, "marked so"
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(TESTS_DIR) and path.relative_to(TESTS_DIR).parts[0] == "hardware":
        return ("hardware",), "under tests/hardware"
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in PLATFORM_PARAMS:
        if isinstance(params.get(key), str) and _is_accelerator(params[key]):
            return ("hardware",), f"runs on {params[key]}"
    if "slow" in names:
        return ("integration",), "marked slow"
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
    if why:
        return ("integration",), why
    for pattern, reason in INTEGRATION_MODULES.items():
        if fnmatch.fnmatch(path.name, pattern):
            return ("integration",), f"module {pattern}: {reason}"
    return ("fast",), "pure logic"


def tier_problems(records: dict) -> list[str]:
    """What breaks the tier rules in {test id: marker names}: a test with no tier or with
    two, a `slow` test in the fast tier (slow ones are integration, or hardware)."""
    problems = []
    for nodeid, names in records.items():
        tiers = [tier for tier in TIERS if tier in names]
        if len(tiers) != 1:
            problems.append(f"{nodeid}: {len(tiers)} tiers {tiers}, needs exactly one of {TIERS}")
        elif "slow" in names and tiers == ["fast"]:
            problems.append(f"{nodeid}: marked slow but in the fast tier")
    return problems


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    records = config.stash.setdefault(_RECORDS, {})
    for item in items:
        tiers, why = classify(item)
        for tier in tiers:
            item.add_marker(getattr(pytest.mark, tier))
        item.stash[_TIER] = tiers[0] if len(tiers) == 1 else "/".join(tiers)
        item.user_properties.append(("tier", f"{item.stash[_TIER]}: {why}"))
        records[item.nodeid] = {mark.name for mark in item.iter_markers()}


@pytest.fixture
def tier_rules(request):
    """The tier rules and what they made of this session's collected tests (all of them,
    whatever `-m` then selected)."""
    return types.SimpleNamespace(records=dict(request.config.stash.get(_RECORDS, {})),
                                 problems=tier_problems, classify=classify,
                                 code_signal=code_signal, tiers=TIERS)


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
