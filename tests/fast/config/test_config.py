"""Config: defaults, YAML, overrides, and errors that name the key, the value and what is allowed."""

import pytest

from eddyrl.cli import main
from eddyrl.config import load_config, parse_overrides
from eddyrl.errors import ConfigError


def test_defaults_validate():
    config = load_config()
    assert config.platform == "auto" and config.rollout.engine == "hf"
    assert config.rollout.platform is None and config.train.platform is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("platform: cpu\nseed: 3\nrollout:\n  num_workers: 2\n")
    config = load_config(path, ["seed=7", "train.platform=cpu", "cluster.timeout_s=30"])
    assert (config.platform, config.seed, config.rollout.num_workers) == ("cpu", 7, 2)
    assert config.train.platform == "cpu" and config.cluster.timeout_s == 30.0


def test_override_values_are_typed():
    tree = parse_overrides(["a.b=1", "a.c=0.5", "d=null", "e=true", "f=text"])
    assert tree == {"a": {"b": 1, "c": 0.5}, "d": None, "e": True, "f": "text"}


@pytest.mark.parametrize("overrides, fragments", [
    (["rollout.engin=hf"], ["unknown config key 'rollout.engin'", "did you mean 'rollout.engine'"]),
    (["num_workers=2"], ["unknown config key 'num_workers'", "'train.num_workers'"]),
    (["rolout.engine=hf"], ["unknown config key 'rolout'", "did you mean 'rollout'"]),
    (["platform=tpu"], ["'platform' = 'tpu'", "'cpu'", "'cuda'", "'npu'"]),
    (["rollout.platform=gpu"], ["'rollout.platform' = 'gpu'", "'cuda'"]),
    (["rollout.engine=sglang"], ["'rollout.engine' = 'sglang'", "'hf'"]),
    (["rollout.num_workers=0"], ["'rollout.num_workers' = 0", "out of range"]),
    (["rollout.num_workers=abc"], ["'rollout.num_workers'", "'abc'", "Integer"]),
    (["cluster.timeout_s=-1"], ["'cluster.timeout_s' = -1", "(0"]),
    (["seed=-2"], ["'seed' = -2"]),
    (["rollout=3"], ["'rollout'", "is a section"]),
    (["platform"], ["'platform' is not of the form key=value"]),
    (["replay.max_fraction=1.0"], ["contradictory", "leaves no fresh group"]),
    (["replay.max_fraction=0.25", "replay.max_lag=0"], ["contradictory", "max_lag = 0"]),
    (["algorithm.clip_high=0.1"], ["contradictory", "clip_high"]),
    (["window.max_staleness=2", "algorithm.max_refill_rounds=1"],
     ["contradictory", "max_refill_rounds"]),
    (["algorithm.dual_clip=0.5"], ["'algorithm.dual_clip' = 0.5"]),
    (["rollout.num_workers=2", "elastic.enabled=true", "adaptive.enabled=true",
      "adaptive.switch_partial_rollout=true", "window.fill_legacy=true"],
     ["contradictory", "switch_partial_rollout", "one policy version"]),
    (["data.prompt_overflow=cut"], ["'data.prompt_overflow' = 'cut'", "'truncate'"]),
    (["data.train_path=/x.jsonl"], ["contradictory", "given together"]),
    (["model.path=builtin:nope"], ["no built-in model 'nope'", "tiny_warmstart"]),
    (["=cpu"], ["is not of the form key=value"]),
])
def test_bad_overrides_are_named(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("text, fragments", [
    ("platform: cpu\nrollout: [1, 2]\n", ["'rollout'", "is a section"]),
    ("- a\n- b\n", ["must hold a mapping"]),
    ("platform: [cpu\n", ["not valid YAML", "line"]),
    ("train:\n  enigne: fsdp\n", ["unknown config key 'train.enigne'", "'train.engine'"]),
])
def test_bad_files_are_named(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    for fragment in [*fragments]:
        assert fragment in str(err.value), (fragment, str(err.value))
    assert "bad.yaml" in str(err.value) or "'rollout'" in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == load_config()


def test_config_show_prints_the_resolved_tree(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 11\n")
    assert main(["config", "show", str(path), "rollout.num_workers=3"]) == 0
    out = capsys.readouterr().out
    assert "seed: 11" in out and "num_workers: 3" in out


def test_cli_errors_are_one_line_without_traceback(capsys):
    assert main(["config", "show", "platform=tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eddy: error: ") and "Traceback" not in err


def test_shipped_configs_load():
    from eddyrl.config import bundled_root
    from eddyrl.sim.config import load_scenario

    configs = sorted(bundled_root().rglob("*.yaml"))
    assert configs, "eddyrl/configs/ holds no YAML file"
    for path in configs:
        if path.parent.name == "sim":  # scenarios: `eddy sim` reads them, with their section
            load_scenario(path)
        elif path.parent.name != "recipes":  # they name model files: test_recipes.py does
            load_config(path)


def test_tiny_cpu_yaml_spells_out_the_defaults():
    """`eddy train` with no argument and `eddy train tiny_cpu` (eddyrl/configs/tiny_cpu.yaml)
    must be the same run."""
    from eddyrl.config import bundled

    path = bundled("tiny_cpu")
    assert load_config(path) == load_config(overrides=["platform=cpu"])


@pytest.mark.parametrize("overrides,message", [
    (["routing.policy=bucket"], "routing.buckets give 3 worker(s) (short: 1, medium: 1, long: 1) "
                                "but rollout.num_workers = 1"),
    (["routing.policy=off"], "'routing.policy' = 'False' (YAML read a bare off/on/no/yes as a "
                             "boolean) is not allowed"),
    (["rollout.num_workers=2", "routing.policy=bucket", "elastic.enabled=true",
      "adaptive.enabled=true",
      "routing.buckets=[{name: s, max_tokens: 8, max_batch_size: 4}, {name: l, max_tokens: 24}]"],
     "routing.buckets ['s'] set their own max_batch_size while adaptive.enabled"),
])
def test_routing_settings_that_cannot_work_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert message in str(error.value)


def test_routing_is_off_by_default_and_a_bucket_layout_loads():
    assert load_config().routing.policy == "none"
    config = load_config(overrides=[
        "rollout.num_workers=3", "routing.policy=bucket",
        "routing.buckets=[{name: s, max_tokens: 8, workers: 2}, {name: l, max_tokens: 24}]"])
    from eddyrl.scheduler.buckets import bucket_instances, worker_batch_size

    assert bucket_instances(config.routing) == {"s": [0, 1], "l": [2]}
    assert [worker_batch_size(config.routing, w, 256) for w in range(3)] == [256] * 3
