"""The training step's parts (scheduler/train_cost.py), each against a hand computation from
the published figures it cites: compute, collectives inside and between nodes, the optimizer
step, the overlap of compute with communication, and how they scale."""

import math

import pytest

from eddyrl.errors import ConfigError
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.scheduler.hardware import GB, Accelerator, lookup_accelerator, lookup_model
from eddyrl.scheduler.collectives import NIC_SHARE_BY_PAYLOAD, collective_seconds, nic_share
from eddyrl.scheduler.train_cost import (
    ADAMW_BYTES_PER_PARAM, RankRows, TrainCost, TrainLayout, published_train_mfu)

H20, H100 = lookup_accelerator("H20"), lookup_accelerator("H100")
QWEN7B = lookup_model("Qwen2.5-7B")  # P = 7,070,619,136 matmul weights, A = 401,408, 28 layers
P, A = 7_070_619_136, 401_408
NVLINK_AG = 900e9 * 173 / 400  # H20/H100 NVLink figure × A800's measured all_gather share
NIC = 50e9  # 400 Gb/s per accelerator


def cost(layout: TrainLayout, accelerator=H20, model=QWEN7B, mfu=0.4) -> TrainCost:
    return TrainCost(accelerator, model, layout, mfu)


# -- compute -------------------------------------------------------------------------------------

def test_a_rows_training_compute_is_three_forwards_over_the_groups_peak():
    one = cost(TrainLayout(dp=1, tp=2))
    s = 4000
    forward = 2 * P * s + A * s * s / 2
    assert one.forward_flops(s) == pytest.approx(forward)
    step = one.step([RankRows(((s,),))])
    assert step.compute_s == pytest.approx(3 * forward / (148e12 * 0.4 * 2))


@pytest.mark.parametrize("checkpointing, extra", [
    ("none", lambda s: 0), ("full", lambda s: 2 * P * s + A * s * s / 2),
    ("selective", lambda s: 2 * P * s)])
def test_checkpointing_recomputes_the_forward_or_its_matmuls(checkpointing, extra):
    plain = cost(TrainLayout(dp=1)).training_flops(8000)
    assert cost(TrainLayout(dp=1, checkpointing=checkpointing)).training_flops(8000) == \
        pytest.approx(plain + extra(8000))


def test_each_optimizer_step_waits_for_its_slowest_rank():
    two = cost(TrainLayout(dp=2))
    rows = RankRows(((1000, 1000), (3000,)))
    step = two.step([rows, rows])
    slowest = two.training_flops(3000) / (148e12 * 0.4)
    mean = (2 * two.training_flops(1000) + two.training_flops(3000)) / 2 / (148e12 * 0.4)
    assert step.compute_s == pytest.approx(2 * slowest)
    assert step.imbalance == pytest.approx(slowest / mean)


def test_published_mfu_by_accelerator_and_model_kind():
    assert published_train_mfu(lookup_accelerator("A100"), QWEN7B) == 0.56  # torchtitan [C5]
    assert published_train_mfu(H100, QWEN7B) == 0.40
    assert published_train_mfu(H100, lookup_model("Qwen3-30B-A3B")) == 0.25
    assert CostModel("A800", "Qwen2.5-7B").efficiency.train_mfu == 0.56


# -- collectives ---------------------------------------------------------------------------------

def test_nic_share_is_the_measured_table_log_linear_between_points():
    for size, share in NIC_SHARE_BY_PAYLOAD:
        assert nic_share(size) == pytest.approx(share)
    between = math.sqrt(2**29 * 2**30)  # half-way (in log) from 512 MiB to 1 GiB
    assert nic_share(between) == pytest.approx((0.633 + 0.701) / 2)
    assert nic_share(1) == 0.125 and nic_share(2**40) == 0.739


def test_an_all_gather_inside_a_node_runs_at_the_measured_nvlink_share():
    payload = 1e9
    assert collective_seconds(H20, "all_gather", payload, 8, 8) == pytest.approx(
        7 / 8 * payload / NVLINK_AG)
    assert collective_seconds(H20, "all_reduce", payload, 8, 8) == pytest.approx(
        2 * 7 / 8 * payload / NVLINK_AG)
    assert collective_seconds(H20, "reduce_scatter", payload, 1, 8) == 0


def test_hccs_reaches_less_of_its_link_in_a_small_group():
    ascend = lookup_accelerator("910B2")
    assert collective_seconds(ascend, "all_gather", 1e9, 2, 8) == pytest.approx(
        1 / 2 * 1e9 / 38e9)  # 38 GB/s on 2 cards [A13]
    assert collective_seconds(ascend, "all_gather", 1e9, 8, 8) == pytest.approx(
        7 / 8 * 1e9 / 149e9)


def test_a_collective_spanning_nodes_is_bound_by_each_accelerators_nic():
    payload = 2**30  # nic_share 0.701
    inside = 7 / 8 * payload / NVLINK_AG
    between = 15 / 16 * payload / 8 / (NIC * 0.701)  # 16 nodes of 8
    assert between > inside
    assert collective_seconds(H20, "all_gather", payload, 128, 8) == pytest.approx(between)
    # two nodes: only half the bytes cross, NVLink stays the bound
    assert collective_seconds(H20, "all_gather", payload, 16, 8) == pytest.approx(inside)


def test_collectives_switch_from_nvlink_to_the_nic_when_the_group_spans_nodes():
    slow_nic = Accelerator(name="slow-nic", peak_flops=1e15, hbm_bytes=80 * GB,
                           hbm_bandwidth=3e12, intra_node_bandwidth=900 * GB,
                           inter_node_bandwidth=1 * GB, devices_per_node=8, source="test")
    payload = 2**30
    in_node = collective_seconds(slow_nic, "all_gather", payload, 8, 8)
    across = collective_seconds(slow_nic, "all_gather", payload, 16, 8)
    assert in_node == pytest.approx(7 / 8 * payload / NVLINK_AG)
    assert across == pytest.approx(1 / 2 * payload / 8 / (1e9 * 0.701))
    assert across > 10 * in_node


def test_fsdp_moves_two_gathers_and_a_reduce_scatter_per_micro_batch():
    layout = TrainLayout(dp=8)
    train = cost(layout)
    layer = QWEN7B.total_params / 28
    gather = 28 * collective_seconds(H20, "all_gather", layer * 2, 8, 8)
    scatter = 28 * collective_seconds(H20, "reduce_scatter", layer * 4, 8, 8)
    assert train.all_gather_seconds() == pytest.approx(gather)
    assert train.gradient_sync_seconds() == pytest.approx(scatter)
    step = train.step([RankRows(((100,),) * 8, micro_batches=3)])
    assert step.communication_s == pytest.approx(3 * (2 * gather + scatter))


def test_hsdp_all_reduces_each_shard_across_the_replicas():
    train = cost(TrainLayout(dp=16, tp=2, shard=2))  # 32 devices, shard groups of 2
    layer = QWEN7B.total_params / 28
    scatter = 28 * collective_seconds(H20, "reduce_scatter", layer * 4, 2, 8)
    # 16 replicas of each shard, 4 on a node, 4 nodes
    replicas = 28 * collective_seconds(H20, "all_reduce", layer * 4 / 2, 16, 4)
    assert train.gradient_sync_seconds() == pytest.approx(scatter + replicas)
    with pytest.raises(ConfigError, match="shard = 3"):
        TrainLayout(dp=16, tp=2, shard=3)


def test_tensor_parallelism_gathers_only_its_slice_over_the_dp_ranks():
    train = cost(TrainLayout(dp=4, tp=8, tp_splits_weights=True))  # 32 devices, 4 nodes
    layer = QWEN7B.total_params / 8 / 28
    assert train.all_gather_seconds() == pytest.approx(
        28 * collective_seconds(H20, "all_gather", layer * 2, 4, 1))


def test_sequence_parallel_groups_exchange_q_k_v_and_the_output_every_layer():
    train = cost(TrainLayout(dp=2, tp=4, checkpointing="full"))  # Ulysses, sp 4
    tokens = 60_000  # one micro-batch of the group
    local = tokens / 4 * (2 * 28 + 2 * 4) * 128 * 2  # q, out: 28 heads; k, v: 4; bf16
    per_layer = collective_seconds(H20, "all_gather", local, 4, 4)
    assert train.activation_exchange_seconds(tokens, 3) == pytest.approx(3 * 28 * per_layer)
    step = train.step([RankRows(((tokens,), (tokens,)))])
    assert step.activation_exchange_s == pytest.approx(3 * 28 * per_layer)  # fwd, bwd, redo
    assert step.update_s == pytest.approx(step.compute_s + step.activation_exchange_s
                                          + step.exposed_communication_s + step.optimizer_s)
    assert cost(TrainLayout(dp=8)).activation_exchange_seconds(tokens, 3) == 0


def test_tensor_parallel_groups_all_reduce_the_hidden_state_twice_a_layer():
    train = cost(TrainLayout(dp=1, tp=8, tp_splits_weights=True))
    per_layer = 2 * collective_seconds(H20, "all_reduce", 1000 * 3584 * 2, 8, 8)
    assert train.activation_exchange_seconds(1000, 2) == pytest.approx(2 * 28 * per_layer)


# -- the optimizer and the overlap ---------------------------------------------------------------

def test_adamw_streams_the_shard_at_hbm_bandwidth():
    assert cost(TrainLayout(dp=4, tp=2)).optimizer_seconds() == pytest.approx(
        QWEN7B.total_params / 8 * ADAMW_BYTES_PER_PARAM / 4.0e12)


def test_a_pass_costs_the_larger_of_compute_and_communication_plus_one_layer():
    train = cost(TrainLayout(dp=8))
    communication = 2 * train.all_gather_seconds() + train.gradient_sync_seconds()
    short, long = RankRows(((10,),) * 8), RankRows(((30_000,),) * 8)
    compute_long = train.training_flops(30_000) / (148e12 * 0.4)
    assert compute_long > communication > train.training_flops(10) / (148e12 * 0.4)
    hidden = train.step([long])
    assert hidden.exposed_communication_s == pytest.approx(communication / 28)
    exposed = train.step([short])
    assert exposed.compute_s + exposed.exposed_communication_s == pytest.approx(
        communication * (1 + 1 / 28))


def test_log_prob_passes_are_forwards_with_one_gather():
    train = cost(TrainLayout(dp=8))
    rows = RankRows(((30_000,),) * 8)
    step = train.step([rows], [("old", rows), ("reference", rows)])
    forward = train.forward_flops(30_000) / (148e12 * 0.4)
    for role in ("old", "reference"):
        assert step.logprob_s[role] == pytest.approx(forward + train.all_gather_seconds() / 28)
    assert step.total_s == pytest.approx(step.update_s + 2 * step.logprob_s["old"])


# -- scaling -------------------------------------------------------------------------------------

def test_doubling_devices_does_not_halve_a_communication_bound_step():
    """Qwen2.5-32B on H100 nodes, 64 short rows a step: the collectives dominate, so twice
    the devices (more nodes, same bytes per rank) barely shortens the step; a large batch of
    long rows is compute-bound and halves."""
    def step(dp: int, rows: int, tokens: int) -> float:
        train = cost(TrainLayout(dp=dp), H100, lookup_model("Qwen2.5-32B"))
        share = RankRows(((tokens,) * (rows // dp),) * dp)
        return train.step([share]).total_s

    assert step(64, 64, 500) > 0.8 * step(32, 64, 500)
    assert step(64, 4096, 8000) < 0.55 * step(32, 4096, 8000)


def test_the_cost_models_uniform_step_is_the_same_parts():
    model = CostModel("H100", "Qwen3-8B", tp=2)
    train = TrainCost(model.accelerator, model.model,
                      TrainLayout(dp=4, tp=2, tp_splits_weights=True), model.efficiency.train_mfu)
    parts = train.uniform_step(10**6, 2048)
    assert model.train_step_seconds(10**6, dp=4, sequence_length=2048) == pytest.approx(
        parts.total_s)
    assert parts.compute_s == pytest.approx(
        3 * (2 * model.model.matmul_params + model.model.attention_flops_per_context_token
             * 1024) * 10**6 / (989e12 * 0.4 * 8))
