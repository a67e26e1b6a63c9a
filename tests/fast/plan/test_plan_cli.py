"""`eddy plan`: the bundled tiny default and a recipe planned offline (no weights), `--json`,
an unknown `--device`, a plan that does not fit and its fixes, and the rollout engine's KV cache
pinned to what the vLLM adapter asks for."""

import ast
import json
from pathlib import Path

import pytest

from eddyrl.cli import main
from eddyrl.config import load_config
from eddyrl.models.config import SHAPES, shipped_shapes

ROOT = Path(__file__).resolve().parents[3]
RECIPE = "recipes/qwen3_4b_dapo_math_gpu"


def plan(capsys, *args) -> tuple[int, str, str]:
    status = main(["plan", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_tiny_default_fits_a_datasheet_device(capsys):
    status, out, _ = plan(capsys, "--device", "H100")
    assert status == 0, out
    assert "train: 1 x H100" in out and "rollout: 1 x H100" in out
    for term in ("weights", "optimizer", "activations", "kv_cache", "**peak**", "margin"):
        assert term in out
    assert out.rstrip().endswith("fits")


def test_the_tiny_default_on_this_host_says_whose_memory(capsys):
    _, out, _ = plan(capsys, "platform=cpu")
    assert "host (every process)" in out and "host memory available now" in out


def test_json_parses_and_adds_up(capsys):
    status, out, _ = plan(capsys, "--device", "A800", "--json")
    result = json.loads(out)
    assert status == 0 and result["fits"] is True
    assert [d["label"] for d in result["devices"]] == ["train", "rollout"]
    for device in result["devices"]:
        (role,) = device["roles"]
        assert device["peak"] == role["peak"] and device["memory"]["bytes"] == 80 * 10**9
        assert device["margin"] == device["memory"]["bytes"] - device["peak"]
        assert role["peak"] >= max(role["terms"].values()) > 0


def test_a_recipe_plans_offline_without_its_weights(capsys):
    assert not Path("/path/to/Qwen3-4B").exists()
    status, out, _ = plan(capsys, RECIPE, "--device", "H100")
    assert status == 0, out
    assert "assets/shapes/Qwen3-4B/config.json" in out and "4.02 B parameters" in out


def test_an_unknown_device_is_refused_with_the_closest_name(capsys):
    status, _, err = plan(capsys, "--device", "H10")
    assert status == 2
    assert "--device 'H10'" in err and "did you mean 'H100'" in err


def test_no_shape_says_which_keys(capsys):
    status, _, err = plan(capsys, RECIPE, "model.shape=null", "--device", "H100")
    assert status == 2 and "model.shape" in err and "model.path" in err


def test_a_plan_over_memory_lists_fixes_that_make_it_fit(capsys):
    overrides = ["model.shape=Qwen3-8B", "model.path=/nowhere", "data.max_prompt_tokens=2048",
                 "rollout.max_new_tokens=14336", "train.micro_batch_size=4",
                 "train.logprob_chunk_tokens=0", "rollout.max_batch_size=64"]
    status, out, _ = plan(capsys, *overrides, "--device", "910B", "--json")
    result = json.loads(out)
    assert status == 1 and result["fits"] is False and result["fixes"]
    assert result["fixes"][-1]["fits"] is True
    peaks = [f["peak"] for f in result["fixes"] if f["role"] == "train"]
    assert peaks == sorted(peaks, reverse=True)  # each fix lowers the trainer's peak
    fixed = [f["override"] for f in result["fixes"]]
    status, out, _ = plan(capsys, *overrides, *fixed, "--device", "910B")
    assert status == 0 and out.rstrip().endswith("fits"), out


def test_config_show_reads_a_recipe_without_its_model(capsys):
    assert main(["config", "show", RECIPE]) == 0
    assert "/path/to/Qwen3-4B" in capsys.readouterr().out


def test_shipped_shapes_agree_with_the_datasheet():
    from eddyrl.plan.shapes import load_shape
    from eddyrl.scheduler.hardware import MODELS, model_from_hf_config

    # the recipes' models, and every simulator scenario's (eddy plan --cluster plans their
    # memory); the positions as each model card states them
    positions = {"Qwen3-0.6B": 40960, "Qwen3-30B-A3B": 40960, "Qwen3-4B": 40960,
                 "Qwen3-8B": 40960, "Qwen3-14B": 40960, "Qwen3-32B": 40960,
                 "Qwen2.5-7B": 131072, "Qwen2.5-32B": 131072, "Qwen2.5-Math-7B": 4096,
                 "DeepSeek-R1-Distill-Qwen-1.5B": 131072}
    assert shipped_shapes() == sorted(positions)
    for name in shipped_shapes():
        config = json.loads((SHAPES / name / "config.json").read_text())
        spec = model_from_hf_config(name, config)
        if name != "Qwen3-0.6B":  # not in the datasheet
            assert spec == MODELS[name]
        assert load_shape(SHAPES / name).parameters() == spec.total_params
        assert config["max_position_embeddings"] == positions[name]


def test_every_scenario_model_has_a_shipped_shape():
    import yaml

    from eddyrl.config.bundled_configs import bundled_root

    scenarios = sorted((bundled_root() / "sim").glob("*.yaml"))
    assert scenarios
    for path in scenarios:
        model = yaml.safe_load(path.read_text())["sim"]["model"]
        assert model in shipped_shapes(), f"{path.name}: sim.model {model!r} has no shape"


def test_a_shape_name_is_checked_case_aside():
    assert load_config(overrides=["model.shape=qwen3-4b"]).model.shape == "qwen3-4b"
    with pytest.raises(Exception, match="did you mean 'Qwen3-4B'"):
        load_config(overrides=["model.shape=Qwen3-4"])


def _adapter_kv_cache_bytes_for():
    """The vLLM adapter's `kv_cache_bytes_for`, taken from its source (importing the adapter
    imports vLLM: seconds)."""
    path = ROOT / "eddyrl" / "engines" / "inference" / "vllm" / "api.py"
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
               and n.name == "kv_cache_bytes_for"]
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["kv_cache_bytes_for"]


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("name", ["Qwen3-4B", "Qwen3-30B-A3B"])
def test_rollout_kv_cache_is_what_the_vllm_adapter_asks_for(name, dtype, size):
    from eddyrl.plan.rollout_memory import RolloutOptions, rollout_memory
    from eddyrl.plan.shapes import load_shape

    config = json.loads((SHAPES / name / "config.json").read_text())
    options = RolloutOptions(engine="vllm", max_batch_size=12, longest=22528,
                             prompt_tokens=2048, max_model_len=40960, dtype=dtype)
    memory = rollout_memory(load_shape(SHAPES / name), options)
    assert memory.kv_cache == _adapter_kv_cache_bytes_for()(config, 12, 40960, size)
    assert memory.concurrent_sequences == 12 * 40960 // 22528



def test_colocated_roles_take_turns_and_host_processes_add_up(capsys):
    status, out, _ = plan(capsys, RECIPE, "cluster.placement=colocated",
                          "rollout.num_workers=4", "--device", "H100", "--json")
    (device,) = json.loads(out)["devices"]
    assert device["sharing"] == "turns" and device["count"] == 4
    assert device["peak"] == max(role["peak"] for role in device["roles"])

    _, out, _ = plan(capsys, "platform=cpu", "train.num_workers=2", "--json")
    (host,) = json.loads(out)["devices"]  # on the CPU every process shares the host
    train, rollout = host["roles"]
    assert host["sharing"] == "shared" and host["processes"] == {"train": 2, "rollout": 1}
    assert host["peak"] == 2 * train["peak"] + rollout["peak"]
