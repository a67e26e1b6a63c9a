"""How the simulator's policies are set: partial rollout as verl's fully asynchronous trainer
runs it, and Libra's buckets sized by decode work (the response-length model's moments)."""

import random

import pytest

from eddyrl.sim.config import load_scenario as load_config
from eddyrl.sim.policies import _long_work_share, policy_config
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.sim.workload import ResponseLengths

DORA = "sim/dora_64"  # the bundled eddyrl/configs/sim/dora_64.yaml


def test_partial_streams_with_partial_rollout_half_a_batch_ahead_within_the_scenarios_k():
    scenario = load_config(DORA)
    partial = policy_config(DORA, [], "partial")
    assert partial.window.partial_rollout and partial.window.refill == "stream"
    assert partial.window.max_staleness == scenario.window.max_staleness == 3
    ahead = scenario.sim.staleness_threshold  # verl's default 0.5: half a batch ahead
    assert partial.window.max_inflight_prompts == round(512 * (1 + ahead)) == 768
    assert partial.window.max_started_per_sync == 0  # DORA's scenario: Eddy's bound
    # a synchronous scenario still gets one step of lag to overlap with
    assert policy_config(DORA, ["window.max_staleness=0"], "partial") \
        .window.max_staleness == 1


def _sample(lengths: ResponseLengths, n: int = 200_000) -> list[float]:
    rng = random.Random(7)
    return [min(rng.lognormvariate(lengths.mu, lengths.sigma), lengths.cap) for _ in range(n)]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_capped_log_normal_moments_match_a_sample(k):
    lengths = ResponseLengths(2400, 1.0, 30000)
    sample = _sample(lengths)
    for t in (1e-9, 4800, 20000):
        measured = sum(x ** k for x in sample if x > t) / len(sample)
        assert lengths.moment_above(k, t) == pytest.approx(measured, rel=0.03), (k, t)


def test_long_responses_take_their_share_of_decode_bytes_not_of_tokens():
    lengths, cost = ResponseLengths(2400, 1.0, 30000), CostModel("H800", "Qwen2.5-32B", tp=8)
    kv = cost.model.kv_bytes_per_token(cost.dtype_bytes)
    sample = _sample(lengths, 50_000)

    def read(length):  # bytes one response reads over its decode, position by position
        return (cost.weights_bytes / 256 + kv * 300) * length + kv * length ** 2 / 2
    measured = sum(read(x) for x in sample if x > 4800) / sum(read(x) for x in sample)
    share = _long_work_share(lengths, 4800, cost, batch=256, prompt_tokens=300)
    tokens = lengths.moment_above(1, 4800) / lengths.moment_above(1, 1e-9)
    assert share == pytest.approx(measured, rel=0.05)
    assert share > tokens + 0.2  # 0.67 of the bytes, 0.42 of the tokens


def test_dora_64_buckets_give_the_long_responses_most_of_the_devices():
    routing = policy_config(DORA, [], "bucket").routing
    short, long = routing.buckets
    assert (short.workers * 4, long.workers * long.parallelism) == (16, 32)


def test_all_elastic_adds_the_elastic_pool_and_leaves_the_batch_to_the_adaptive_scheduler():
    everything = policy_config(DORA, [], "all_elastic")
    assert everything.elastic.enabled and everything.adaptive.enabled
    assert not everything.adaptive.switch_partial_rollout  # DORA's one version per trajectory
    assert everything.window.fill_legacy and everything.replay.max_fraction == 0.25
    assert all(b.max_batch_size is None for b in everything.routing.buckets)
    assert policy_config(DORA, [], "all").routing.buckets[-1].max_batch_size is not None
