"""The mode registry (eddyrl/modes.py): each mode is defined once, its file is generated from it,
and the same name gives the same settings in a real run (its mode file or its overrides), in
bench/modes.py and in `eddy bench sim`'s policy, apart from the simulator's named scenario
hook, which is subtracted here explicitly."""

import dataclasses
import functools
import importlib.util
from pathlib import Path

import pytest

from eddyrl import modes
from eddyrl.cli import build_parser, main
from eddyrl.config import bundled, bundled_names, load_config
from eddyrl.sim.config import load_scenario
from eddyrl.sim import policies

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ["sim/dora_64", "sim/libra_48", "sim/reflow_8"]  # libra_48 routes, reflow_8 replays


@functools.cache
def _scenario(name: str):
    return load_scenario(name)


def _bench_modes():
    spec = importlib.util.spec_from_file_location("bench_modes", ROOT / "bench" / "modes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return [_plain(v) for v in value] if isinstance(value, list) else value


def _value(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return _plain(config)


def _view(config, keys) -> dict:
    """The config's values at `keys`; a value that a mode sets by reference (one_step's
    `${loop.batch_prompts}`) shows as the reference when it holds."""
    view = {}
    for key in sorted(keys):
        value, raw = _value(config, key), ALL_SETTINGS.get(key)
        if isinstance(raw, str) and raw.startswith("${") and \
                value == _value(config, raw[2:-1]):
            value = raw
        view[key] = value
    return view


def _matches(value, raw) -> bool:
    """A config value against a setting as written (a bucket written with some of its fields)."""
    if isinstance(raw, str) and raw.startswith("${"):
        return value == raw  # _view shows a reference that holds as the reference
    if isinstance(raw, list) and raw and isinstance(raw[0], dict):
        return len(value) == len(raw) and all(r.items() <= v.items() for v, r in zip(value, raw))
    return value == raw


ALL_SETTINGS = {k: v for mode in modes.MODES.values() for k, v in mode.settings().items()}


def test_every_mode_has_its_generated_file_and_every_file_a_mode():
    assert set(bundled_names("modes")) == set(modes.MODES)
    assert modes.stale() == [], "run python -m eddyrl.modes --write"
    for name, mode in modes.MODES.items():
        assert bundled(f"modes/{name}").read_text() == modes.render(mode), name
    assert modes.main(["--check"]) == 0


def test_the_check_names_a_file_that_differs_or_has_no_mode(tmp_path):
    modes.write(tmp_path)
    assert modes.stale(tmp_path) == []
    (tmp_path / "replay.yaml").write_text("algorithm:\n  max_staleness: 0\n")
    (tmp_path / "fast.yaml").write_text("")
    (tmp_path / "sync.yaml").unlink()
    assert modes.stale(tmp_path) == ["fast.yaml (no such mode)", "replay.yaml", "sync.yaml"]
    assert modes.write(tmp_path) == ["fast.yaml (no such mode)", "replay.yaml", "sync.yaml"]
    assert modes.stale(tmp_path) == []
    assert not (tmp_path / "fast.yaml").exists()


def test_each_mode_is_a_list_of_overrides_with_a_description_and_when_to_use_it():
    for name, mode in modes.MODES.items():
        keys = [item.partition("=")[0] for item in mode.overrides]
        assert len(keys) == len(set(keys)), name  # each key once
        assert mode.description and mode.when and "\n" not in mode.description + mode.when
        assert mode.scenario is None or mode.scenario in modes.SCENARIO_HOOKS, name
    # the simulator implements exactly the hooks the registry names
    assert set(policies.SCENARIO_HOOKS) == set(modes.SCENARIO_HOOKS)
    assert set(policies.POLICIES) == set(modes.MODES)
    with pytest.raises(Exception, match="unknown mode 'fast'"):
        modes.get("fast")


def test_base_is_the_built_in_defaults():
    """The simulator resets a scenario with BASE; a real run starts from the defaults: the same."""
    defaults = load_config()
    for key, value in modes.settings(modes.BASE).items():
        assert _value(defaults, key) == value, key


@pytest.mark.parametrize("name", list(modes.MODES))
def test_a_mode_file_holds_the_registrys_overrides(name):
    mode = modes.MODES[name]
    from_file = load_config(f"modes/{name}")
    assert from_file == load_config(None, list(mode.overrides))
    written = {**modes.settings(modes.BASE), **mode.settings()}
    view = _view(from_file, written)
    for key, raw in written.items():
        assert _matches(view[key], raw), (name, key)


@pytest.mark.parametrize("name", list(modes.MODES))
def test_a_mode_name_gives_the_same_settings_everywhere(name):
    """Real run (the mode file), bench/modes.py, and `eddy bench sim`'s policy on scenarios
    that chose otherwise: every key the mode or BASE sets agrees, except those the mode's named
    scenario hook sets, which the simulator alone adds (and which are checked on their own)."""
    mode = modes.MODES[name]
    keys = set(modes.settings(modes.BASE)) | set(mode.settings())
    real = load_config(f"modes/{name}")
    bench = _bench_modes().mode_config(name, [])
    assert _view(bench, keys) == _view(real, keys)
    for scenario in SCENARIOS:
        sim = policies.policy_config(scenario, [], name)
        hook = policies.SCENARIO_HOOKS.get(mode.scenario)
        added = modes.settings(hook(_scenario(scenario)) if hook else [])
        if mode.scenario is None:
            assert added == {}
        else:  # the hook sets only what the registry says it sets, and the simulator has it
            assert set(added) <= set(modes.SCENARIO_HOOKS[mode.scenario].keys), (name, added)
            for key, raw in added.items():
                assert _matches(_value(sim, key), raw), (name, scenario, key)
        same = keys - set(added)
        assert _view(sim, same) == _view(real, same), (name, scenario)


def test_the_scenario_hooks_are_what_they_say():
    dora = _scenario("sim/dora_64")
    assert modes.settings(policies.scenario_overrides("sim/dora_64", [], "partial")) == {
        "window.max_staleness": dora.window.max_staleness,
        "window.max_inflight_prompts": round(dora.loop.batch_prompts * 1.5)}
    assert policies.scenario_overrides("sim/dora_64", ["rollout.num_workers=6"], "elastic") \
        == ["rollout.num_workers=6"]
    sized = policies.policy_config("sim/dora_64", [], "all").routing.buckets
    unsized = policies.policy_config("sim/dora_64", [], "all_elastic").routing.buckets
    assert sized[-1].max_batch_size and all(b.max_batch_size is None for b in unsized)


def test_one_step_has_one_batch_in_flight_whatever_the_batch():
    one_step = load_config("modes/one_step", ["loop.batch_prompts=6"])
    assert one_step.window.max_inflight_prompts == 6
    assert policies.policy_config("sim/dora_64", [], "one_step").window.max_inflight_prompts == \
        _scenario("sim/dora_64").loop.batch_prompts


def test_the_commands_take_the_registrys_names(capsys):
    default = build_parser().parse_args(["bench", "sim", "x"]).policies.split(",")
    assert set(default) <= set(modes.MODES)
    assert set(_bench_modes().MODES) <= set(modes.MODES)
    assert main(["config", "show", "modes/one_step", "loop.batch_prompts=8"]) == 0
    out = capsys.readouterr().out
    assert "max_staleness: 1" in out and "max_inflight_prompts: 8" in out
