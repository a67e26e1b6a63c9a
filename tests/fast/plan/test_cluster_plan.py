"""`eddy plan --cluster`: the staged search on a stubbed evaluator (fast), the candidate configs
and memory fit it builds from a scenario (one real run of the command:
test_cluster_plan_run.py)."""

import json

import pytest

from eddyrl.config.bundled_configs import bundled_root
from eddyrl.errors import ConfigError
from eddyrl.modes import MODES as MODE_REGISTRY
from eddyrl.plan.cluster import (_relayout, candidate_config, format_cluster_plan, memory_fit,
                                 plan_cluster, space_of)
from eddyrl.plan.cluster_search import Candidate, Outcome, Space, search, split_order

MODES = ("sync", "colocated", "one_step", "partial", "bucket")
SPACE = Space(modes=MODES, rollout_devices=8, train_devices=8, rollout_tp=2, train_tp=4,
              batch_prompts=64)
K = {"sync": 0, "colocated": 0, "one_step": 1, "partial": 1, "bucket": 1}


class Stub:
    """A made-up cluster: samples/s by mode, best with 12 rollout devices and K = 2; the
    training role idles while rollout has fewer than 12 devices."""

    def __init__(self, speed=None, refuse=()):
        self.speed = speed or {"sync": 1.0, "colocated": 1.2, "one_step": 1.5, "partial": 2.0,
                               "bucket": 1.8}
        self.refuse, self.calls = refuse, []

    def __call__(self, c: Candidate, stage: str) -> Outcome:
        self.calls.append((c, stage))
        if c.mode in self.refuse:
            return Outcome(c, stage, error=f"{c.mode} cannot run here")
        k = K.get(c.mode, 1) if c.max_staleness is None else c.max_staleness
        rate = self.speed.get(c.mode, 1.0) * (1 - abs(c.rollout_devices - 12) / 32) * (
            1.1 if k == 2 else 1.0)
        idle = (0.4, 0.1) if c.rollout_devices < 12 else (0.1, 0.4)
        return Outcome(c, stage, step_s=64 / rate, samples_per_s=rate, train_idle=idle[0],
                       rollout_idle=idle[1], device_idle=0.2,
                       settings={"max_staleness": k, "inflight": c.inflight or 0,
                                 "batch_size": c.batch_size or 256,
                                 "long_workers": (c.long_workers or 2)
                                 if c.mode == "bucket" else None})


def test_splits_are_multiples_of_each_role_tp():
    assert SPACE.splits() == [(4, 12), (8, 8), (12, 4)]


def test_stages_run_in_order_modes_first_at_the_default_split():
    stub = Stub()
    result = search(SPACE, stub, budget=12)
    stages = [stage for _, stage in stub.calls]
    assert stages[:len(MODES)] == ["modes"] * len(MODES)
    assert [c.mode for c, _ in stub.calls[:len(MODES)]] == list(MODES)
    assert all(c.split == "8:8" for c, _ in stub.calls[:len(MODES)])
    assert stages == sorted(stages, key=["modes", "split", "tune"].index)
    assert "split" in stages and "tune" in stages
    # stage 2 tries the two best split modes, never colocated (it has no split)
    assert {c.mode for c, s in stub.calls if s == "split"} == {"partial", "bucket"}
    assert result.baseline.candidate == Candidate("partial", 8, 8)


def test_the_budget_counts_simulated_runs_and_refused_ones_cost_nothing():
    for budget in (5, 6, 9, 15):
        stub = Stub(refuse=("bucket",))
        result = search(SPACE, stub, budget=budget)
        assert result.runs <= budget
        assert len([o for o in result.outcomes if o.ok]) == result.runs
    stub = Stub()
    assert search(SPACE, stub, budget=len(MODES)).runs == len(MODES)
    assert {s for _, s in stub.calls} == {"modes"}


def test_a_budget_below_one_run_per_mode_is_refused():
    with pytest.raises(ConfigError, match="--budget 4 is too small.*5 runs"):
        search(SPACE, Stub(), budget=4)


@pytest.mark.parametrize("speed", [None, {"sync": 3.0, "colocated": 2.9, "one_step": 1.0,
                                          "partial": 1.0, "bucket": 1.0}])
def test_the_first_choice_is_at_least_the_best_mode_at_the_default_split(speed):
    result = search(SPACE, Stub(speed), budget=14)
    first, base = result.ranked()[0], result.baseline
    assert base.stage == "modes" and base.candidate.split == "8:8"
    assert all(base.samples_per_s >= o.samples_per_s for o in result.outcomes
               if o.stage == "modes")
    assert first.samples_per_s >= base.samples_per_s
    if speed is None:  # the stub is faster at 12:4 and K = 2: the search finds both
        assert first.candidate.split == "12:4" and first.settings["max_staleness"] == 2


def test_splits_give_devices_to_the_busier_role_first():
    trainer_waits = Outcome(Candidate("partial", 8, 8), "modes", train_idle=0.5,
                            rollout_idle=0.1)
    assert split_order(SPACE, trainer_waits)[0] == (12, 4)
    rollout_waits = Outcome(Candidate("partial", 8, 8), "modes", train_idle=0.1,
                            rollout_idle=0.5)
    assert split_order(SPACE, rollout_waits)[0] == (4, 12)
    wide = Space(modes=MODES, rollout_devices=768, train_devices=256, rollout_tp=4,
                 train_tp=8, batch_prompts=1024)
    order = split_order(wide, Outcome(Candidate("partial", 768, 256), "modes",
                                      train_idle=0.1, rollout_idle=0.5))
    assert order[:4] == [(640, 384), (512, 512), (704, 320), (384, 640)]  # 1/8, 1/4, 1/16, 3/8
    assert order[4:] == [(896, 128), (1016, 8), (832, 192)]  # 3/8 would pass the end


def test_tuning_leaves_k_of_synchronous_modes_alone_and_lays_out_buckets():
    stub = Stub({"sync": 3.0, "colocated": 0.5, "one_step": 0.5, "partial": 0.5,
                 "bucket": 0.5})
    search(SPACE, stub, budget=30)
    tuned = [c for c, s in stub.calls if s == "tune"]
    assert tuned and all(c.mode == "sync" and c.max_staleness is None
                         and c.inflight is None for c in tuned)
    stub = Stub({"sync": 0.5, "colocated": 0.5, "one_step": 0.5, "partial": 0.5,
                 "bucket": 3.0})
    search(SPACE, stub, budget=30)
    assert {c.long_workers for c, s in stub.calls if s == "tune"} >= {1, 3}


def test_the_space_is_the_scenario_and_k_what_the_run_can_show():
    from eddyrl.sim.config import load_scenario

    space = space_of(load_scenario("dora_64"), steps=3)
    assert (space.rollout_devices, space.train_devices) == (48, 16)
    assert (space.rollout_tp, space.train_tp, space.batch_prompts) == (4, 8, 512)
    assert space.modes == tuple(MODE_REGISTRY) and space.staleness_choices == (1, 2)
    assert space_of(load_scenario("dora_64"), steps=2).staleness_choices == (1,)
    assert (40, 24) in space.splits() and (44, 20) not in space.splits()


def test_relayout_moves_rollout_devices_between_buckets():
    hook = ["rollout.num_workers=4", "routing.buckets=[{name: short, max_tokens: 4800, "
            "workers: 2}, {name: long, max_tokens: 16000, workers: 2, parallelism: 2}]"]
    assert _relayout(hook, 1, 6, 1) == [
        "rollout.num_workers=5", "routing.buckets=[{max_tokens: 4800, name: short, workers: 4}, "
        "{max_tokens: 16000, name: long, parallelism: 2, workers: 1}]"]
    with pytest.raises(ConfigError, match="3 long instances of tp 2 leave 0 of 6"):
        _relayout(hook, 3, 6, 1)


def test_candidate_settings_override_the_mode_and_its_hook():
    config = candidate_config("reflow_8", [], Candidate("partial", 6, 2, max_staleness=2,
                                                        inflight=100, batch_size=64), 3)
    assert (config.sim.rollout.devices, config.sim.train.devices) == (6, 2)
    assert (config.window.max_staleness, config.window.max_inflight_prompts) == (2, 100)
    assert config.sim.rollout.max_batch_size == 64 and config.loop.steps == 3
    assert config.window.partial_rollout  # the mode's own setting stays
    bucket = candidate_config("reflow_8", [], Candidate("bucket", 6, 2, long_workers=1), 3)
    assert [(b.name, b.workers) for b in bucket.routing.buckets] == [("short", 4), ("long", 1)]


def test_memory_fit_plans_a_shipped_shape_and_says_why_not_otherwise():
    fit = memory_fit(candidate_config("reflow_8", [], Candidate("sync", 4, 4), 3))
    assert fit["planned"] and fit["shape"] == "Qwen3-4B"
    assert [d["devices"] for d in fit["devices"]] == ["train", "rollout"]
    assert fit["settings"]["rollout.engine"] == "vllm"
    fit = memory_fit(candidate_config("dora_64", ["sim.model=Qwen3-1.7B"],
                                      Candidate("sync", 48, 16), 3))
    assert not fit["planned"] and "Qwen3-1.7B" in fit["reason"]


def test_memory_fit_splits_the_model_as_the_scenario_does():
    """dora_64: rollout instances of tp 4 over 48 devices, a trainer of 16 under Ulysses 8 with
    FSDP over all 16; each device's bytes are a share of the model's."""
    fit = memory_fit(candidate_config("dora_64", [], Candidate("partial", 48, 16), 3))
    assert fit["planned"] and fit["shape"] == "Qwen2.5-32B"
    assert fit["parallel"] == {"rollout_tp": [4], "train_sequence_parallel": 8,
                               "train_fsdp_group": 16}
    assert [(d["devices"], d["count"]) for d in fit["devices"]] == [
        ("train", 16), ("rollout (tp 4)", 48)]
    # what the simulator timed is what is planned: the scenario's own trainer settings
    assert fit["settings"]["train.activation_checkpointing"] == "selective"
    assert fit["settings"]["train.max_tokens_per_micro_batch"] == 121200


def test_plan_json_shape_on_a_stub():
    stub = Stub({"partial": 2.0})
    plan = plan_cluster("reflow_8", [], budget=13, steps=3, top=3, evaluate=stub)
    json.dumps(plan)  # machine-readable as it is
    assert plan["default_split"] == "4:4" and plan["runs"] == 13 and plan["budget"] == 13
    assert plan["baseline"]["mode"] == "partial" and plan["baseline"]["split"] == "4:4"
    assert len(plan["choices"]) == 3 and len(plan["evaluated"]) == 13
    first = plan["choices"][0]
    assert first["samples_per_s"] >= plan["baseline"]["samples_per_s"]
    assert {"mode", "split", "stage", "step_s", "samples_per_s", "device_idle", "settings",
            "memory", "error"} <= set(first)
    assert first["memory"]["planned"] and first["memory"]["fits"] in (True, False)


def test_refuses_fewer_than_two_steps():
    with pytest.raises(ConfigError, match="--steps 1"):
        plan_cluster("reflow_8", [], budget=20, steps=1, top=3)


def test_the_command_names_a_bad_budget_or_device(capsys):
    from eddyrl.cli import main

    assert main(["plan", "--cluster", "reflow_8", "--budget", "3"]) == 2
    assert "--budget 3 is too small" in capsys.readouterr().err
    assert main(["plan", "--cluster", "reflow_8", "--device", "H100"]) == 2
    assert "--device and --cluster" in capsys.readouterr().err
    assert main(["plan", "--cluster", "no_such_scenario"]) == 2
    assert "no_such_scenario" in capsys.readouterr().err


def test_the_fastest_that_fit_come_first():
    """At a 70,000-token budget Qwen3-4B's trainer fits 4 H100 but not 3: the stub's faster
    5:3 split is listed after the 4:4 one that fits, and the plan says it did so."""
    stub = Stub({"partial": 2.0})
    plan = plan_cluster("reflow_8", ["train.max_tokens_per_micro_batch=70000"], budget=13,
                        steps=3, top=3, evaluate=stub)
    assert [c["memory"]["fits"] for c in plan["choices"]] == [True] * 3
    assert plan["choices"][0]["split"] == "4:4" and plan["faster_not_fitting"] == 2
    assert "2 faster candidate(s) are planned not to fit" in format_cluster_plan(plan)
    # when fewer than --top fit, the ones that do not come last, still listed
    plan = plan_cluster("reflow_8", ["train.max_tokens_per_micro_batch=70000"], budget=13,
                        steps=3, top=13, evaluate=Stub({"partial": 2.0}))
    fits = [c["memory"]["fits"] for c in plan["choices"]]
    assert fits == [True] * 11 + [False] * 2
    assert {c["split"] for c in plan["choices"][-2:]} == {"5:3"}


@pytest.mark.parametrize("scenario", sorted(
    p.stem for p in (bundled_root() / "sim").glob("*.yaml")))
def test_the_plan_runs_on_every_bundled_scenario(scenario):
    """Every bundled scenario: its search space, every mode's candidate config (hooks
    included), the memory plan of the choices (each planned and fitting); the simulated runs
    stubbed (the simulator's own tests run the scenarios)."""
    plan = plan_cluster(scenario, [], budget=len(MODE_REGISTRY) + 2, steps=3, top=3,
                        evaluate=Stub())
    assert plan["baseline"] is not None and plan["choices"]
    assert plan["choices"][0]["samples_per_s"] >= plan["baseline"]["samples_per_s"]
    for choice in plan["choices"]:
        assert choice["memory"]["planned"] and choice["memory"]["fits"], choice["memory"]
    assert "not planned" not in format_cluster_plan(plan)


def test_an_idle_share_below_zero_by_rounding_prints_as_zero():
    from eddyrl.plan.cluster import _percent

    assert (_percent(-1e-9), _percent(0.104), _percent(None)) == ("0%", "10%", "-")
