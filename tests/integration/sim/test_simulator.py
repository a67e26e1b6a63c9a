"""The simulator runs the real controller: a sync step computed by hand, determinism for a
seed, the same classes as a Ray run, and a multi-version run keeping C1–C3 and the ledger."""

import pytest

from eddyrl.sim.config import load_scenario as load_config
from eddyrl.sim.runtime import build, simulate
from eddyrl.scheduler.cost_model import CostModel, Efficiency

SMALL = ["sim.model=Qwen3-4B", "sim.rollout.accelerator=H100", "sim.train.accelerator=H100",
         "sim.workload.eval_prompts=4", "loop.eval_every=0", "algorithm.dynamic_sampling=false"]


# One instance, one prompt, two responses of exactly 1,000 tokens (sigma = 0).
BY_HAND = [*SMALL, "sim.rollout.devices=1", "sim.train.devices=1",
           "sim.workload.prompt_tokens=500", "sim.workload.mean_response_tokens=1000",
           "sim.workload.length_sigma=0", "sim.workload.max_response_tokens=4000",
           "loop.batch_prompts=1", "rollout.n_samples=2"]


def _by_hand() -> tuple[float, float, float]:
    """(rollout, train, sync) seconds of a BY_HAND step, summed token by token: two prefills
    and 1,000 decode steps of batch 2; the cost model's step over both rows; one weight
    transfer."""
    cost = CostModel("H100", "Qwen3-4B")
    rollout = 2 * cost.prefill_seconds(500) + sum(cost.decode_step_seconds(2, 500 + i)
                                                  for i in range(1000))
    train = cost.train_step_seconds(2 * 1500, dp=1, sequence_length=1500)
    sync = cost.weights_bytes / cost.accelerator.inter_node_bandwidth / \
        cost.efficiency.comm_efficiency
    return rollout, train, sync


def test_a_sync_step_equals_the_hand_computed_time():
    summary = simulate(load_config(overrides=[*BY_HAND, "loop.steps=2"]))
    rollout, train, sync = _by_hand()
    for step in summary["history"][1:]:
        assert step["rollout_s"] == pytest.approx(rollout, rel=0.01)
        assert step["train_s"] == pytest.approx(train, rel=0.01)
        assert step["step_s"] == pytest.approx(rollout + train + sync, rel=0.01)


def test_one_batch_in_flight_overlaps_generation_with_training():
    """Textbook one-step off-policy (K = 1, window.max_inflight_prompts = the batch): the next
    batch generates while the current one trains, so a steady step takes max(rollout,
    train + sync), and every batch is exactly one version old."""
    summary = simulate(load_config(overrides=[
        *BY_HAND, "loop.steps=4", "window.max_staleness=1", "window.max_inflight_prompts=1"]))
    rollout, train, sync = _by_hand()
    steps = summary["history"][1:]
    assert [m["staleness_max"] for m in steps] == [0, 1, 1, 1]
    assert all(m["inflight_groups"] <= 1 for m in steps)
    for step in steps[1:]:
        assert step["step_s"] == pytest.approx(max(rollout, train + sync), rel=0.01)
    assert steps[1]["step_s"] < 0.9 * (rollout + train + sync)  # it does overlap


def test_a_colocated_step_takes_turns_and_pays_the_hand_overs():
    """One device holding both roles: generation, a hand-over to training (engine weights out,
    trainer state in, over the host link), training, the hand-over back, and a weight sync
    through host memory (a device cannot broadcast to itself: device -> host, then the
    engine's load host -> device, which the engine waits for), all in sequence."""
    summary = simulate(load_config(overrides=[*BY_HAND, "loop.steps=2",
                                              "cluster.placement=colocated"]))
    rollout, train, _ = _by_hand()
    cost = CostModel("H100", "Qwen3-4B")
    host = 25e9  # sim.host_link_bandwidth's default
    switch = (cost.weights_bytes + cost.model.total_params * 16) / host
    sync = cost.weight_sync_seconds(cost.weights_bytes, host) + cost.weights_bytes / host
    for step in summary["history"][1:]:
        assert step["rollout_s"] == pytest.approx(rollout, rel=0.01)
        assert step["train_s"] == pytest.approx(switch + train, rel=0.01)
        assert step["sync_s"] == pytest.approx(switch + sync, rel=0.01)
    assert summary["devices"] == 1
    # the one device idles only while the reward is scored (instantaneous here): never
    assert summary["device_idle_steady"] == pytest.approx(0.0, abs=1e-6)


def test_colocated_roles_need_the_same_devices():
    from eddyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sim.rollout has 1 x H100 and sim.train 2 x H100"):
        build(load_config(overrides=[*BY_HAND, "sim.train.devices=2",
                                     "cluster.placement=colocated"]))


def test_the_colocated_policy_gives_each_role_every_device():
    from eddyrl.sim.policies import policy_config

    split = policy_config(None, [*SMALL, "sim.rollout.devices=4", "sim.train.devices=2"], "sync")
    shared = policy_config(None, [*SMALL, "sim.rollout.devices=4", "sim.train.devices=2"],
                           "colocated")
    assert (split.cluster.placement, split.sim.rollout.devices, split.sim.train.devices) == \
        ("split", 4, 2)
    assert (shared.cluster.placement, shared.sim.rollout.devices, shared.sim.train.devices) == \
        ("colocated", 6, 6)
    assert shared.window.max_staleness == 0


@pytest.mark.parametrize("inflight", [0, 24])
def test_streaming_refill_keeps_c3_and_the_ledger(inflight):
    """Groups dispatched as others finish (DORA's top-up to its rollout batch size): never
    more in flight than allowed, staleness within K, every group trained once."""
    config = load_config(overrides=[
        *SMALL, "sim.rollout.devices=4", "sim.train.devices=4", "loop.steps=6",
        "loop.batch_prompts=16", "rollout.n_samples=4", "window.max_staleness=2",
        "window.fill_legacy=true", "sim.workload.max_response_tokens=8000",
        "window.refill=stream", f"window.max_inflight_prompts={inflight}"])
    summary = simulate(config)
    steps = summary["history"][1:]
    assert max(m["staleness_max"] for m in steps) <= 2
    assert max(m["inflight_groups"] for m in steps) <= (inflight or 3 * 16)
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0
    assert summary["samples_trained"] == 6 * 16 * 4


def _summary(seed, steps=3):
    config = load_config(overrides=[
        *SMALL, "sim.rollout.devices=4", "sim.train.devices=4", f"seed={seed}",
        f"loop.steps={steps}", "loop.batch_prompts=16", "rollout.n_samples=4",
        "window.max_staleness=2", "window.fill_legacy=true",
        "sim.workload.max_response_tokens=8000"])
    return simulate(config)


def test_a_seed_fixes_the_whole_run():
    a, b, c = _summary(1), _summary(1), _summary(2)
    strip = lambda s: [{k: v for k, v in m.items() if k != "wall_s"} for m in s["history"]]
    assert strip(a) == strip(b) and a["simulated_s"] == b["simulated_s"]
    assert strip(a) != strip(c)


def test_multiversion_in_the_simulator_keeps_c3_and_the_ledger():
    summary = _summary(0, steps=6)
    steps = summary["history"][1:]
    assert max(m["staleness_max"] for m in steps) <= 2
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0
    assert summary["samples_trained"] == 6 * 16 * 4


def test_the_simulator_drives_the_classes_a_ray_run_uses():
    import eddyrl.launch as real_launch
    import eddyrl.sim.runtime as sim_runtime
    from eddyrl.core import controller, rollout, version_assignment, version_window
    from eddyrl.scheduler import buckets

    config = load_config(overrides=[*SMALL, "sim.rollout.devices=2", "sim.train.devices=2",
                                    "rollout.num_workers=2",
                                    "routing.policy=bucket", "routing.buckets=[{name: s, "
                                    "max_tokens: 2000}, {name: l, max_tokens: 30000}]"])
    sim_controller, _ = build(config)
    assert type(sim_controller) is controller.Controller
    assert type(sim_controller.rollout) is rollout.StreamingRollout
    assert type(sim_controller.window) is version_window.VersionWindow
    assert type(sim_controller.rollout.assignment) is version_assignment.VersionAssignment
    assert type(sim_controller.rollout.router) is buckets.BucketRouter
    # `eddy train` (Ray) and `eddy sim` build their controller from the same class
    assert real_launch.Controller is sim_runtime.Controller is controller.Controller


def test_the_elastic_pool_and_adaptive_scheduler_run_in_the_simulator():
    """A training-bound cluster (4 rollout devices, 1 training device): the adaptive scheduler
    borrows a rollout worker, which pays its cold start, joins as a replica (training steps get
    shorter) and is given back when the ratio turns; C3 and the ledger hold."""
    config = load_config("sim/reflow_8", [
        "sim.rollout.devices=4", "sim.train.devices=1", "window.max_staleness=1",
        "elastic.enabled=true", "adaptive.enabled=true", "adaptive.window=2",
        "adaptive.cooldown_steps=2", "loop.steps=10", "loop.batch_prompts=32",
        "sim.workload.max_response_tokens=3000", "sim.workload.eval_prompts=4"])
    summary = simulate(config)
    events = summary["elastic"]["events"]
    assert not [e for e in events if e.get("failed") or e.get("refused")]
    assert any(e.get("decision") == "borrow" for e in events)
    states = [t["to_state"] for t in summary["elastic"]["timeline"]]
    assert {"fetching_state", "zero_sync", "activating", "active"} <= set(states)
    steps = summary["history"][1:]
    joined = [m["train_s"] for m in steps if m["replicas_joined"]]
    alone = [m["train_s"] for m in steps[1:] if not m["replicas_joined"]]
    assert joined and max(joined) < min(alone)  # a replica's devices shorten the step
    assert max(m["staleness_max"] for m in steps) <= 1
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0


def test_calibrated_efficiency_factors_reach_the_cost_model():
    base = [*SMALL, "sim.rollout.devices=1", "sim.train.devices=1", "loop.steps=1",
            "loop.batch_prompts=1", "rollout.n_samples=2", "sim.workload.length_sigma=0",
            "sim.workload.mean_response_tokens=1000", "sim.workload.max_response_tokens=4000"]
    default = simulate(load_config(overrides=base))["history"][1]
    slower = simulate(load_config(overrides=[
        *base, "sim.efficiency.decode_bandwidth_efficiency=0.5"]))["history"][1]
    # half the bandwidth efficiency doubles the bytes' time, not the engine's step overheads
    by_hand = []
    for efficiency in (Efficiency(), Efficiency(decode_bandwidth_efficiency=0.5)):
        cost = CostModel("H100", "Qwen3-4B", efficiency)
        by_hand.append(2 * cost.prefill_seconds(512) + sum(
            cost.decode_step_seconds(2, 512 + i) for i in range(1000)))
    assert slower["rollout_s"] / default["rollout_s"] == pytest.approx(
        by_hand[1] / by_hand[0], rel=0.01)
    assert slower["rollout_s"] > 1.3 * default["rollout_s"]
    assert slower["train_s"] == pytest.approx(default["train_s"])
    with pytest.raises(Exception, match="sim.efficiency.train_mfu"):
        load_config(overrides=["sim.efficiency.train_mfu=1.5"])


def test_buckets_may_give_their_instances_their_own_parallelism():
    """Libra's wider instances for long requests: each bucket's instances are built with its
    tensor-parallel degree (its KV cache and step times follow); the devices must add up."""
    from eddyrl.errors import ConfigError

    routing = ["routing.policy=bucket", "rollout.num_workers=3",
               "routing.buckets=[{name: short, max_tokens: 4000, workers: 2}, "
               "{name: long, max_tokens: 8000, workers: 1, parallelism: 4}]"]
    base = [*SMALL, "sim.rollout.tp=2", "sim.train.devices=2", "loop.steps=1",
            "loop.batch_prompts=4", "rollout.n_samples=2",
            "sim.workload.max_response_tokens=8000"]
    controller, runtime = build(load_config(overrides=[*base, "sim.rollout.devices=8",
                                                       *routing]))
    assert [engine.cost.tp for engine in runtime.workers] == [2, 2, 4]
    short, long = runtime.workers[0], runtime.workers[2]
    assert long.kv_capacity_tokens > 2 * short.kv_capacity_tokens  # 2x devices, same weights
    assert long.cost.decode_step_seconds(8, 1000) < short.cost.decode_step_seconds(8, 1000)
    with pytest.raises(ConfigError, match=r"use 8 rollout devices .* sim.rollout.devices = 6"):
        build(load_config(overrides=[*base, "sim.rollout.devices=6", *routing]))
    # a bucket layout change would move an instance without its width: the adaptive scheduler
    # plans layouts only over buckets of one parallelism
    adaptive = ["elastic.enabled=true", "adaptive.enabled=true", "adaptive.accelerator=H100"]
    wide, _ = build(load_config(overrides=[*base, "sim.rollout.devices=8", *routing, *adaptive]))
    assert wide.elastic.adaptive.plan.layout == ()
    alike = ["routing.policy=bucket", "rollout.num_workers=3",
             "routing.buckets=[{name: short, max_tokens: 4000, workers: 2}, "
             "{name: long, max_tokens: 8000, workers: 1}]"]
    same, _ = build(load_config(overrides=[*base, "sim.rollout.devices=6", *alike, *adaptive]))
    assert same.elastic.adaptive.plan.layout == (2, 1)
