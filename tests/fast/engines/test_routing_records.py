"""Rollout routing replay's pure parts: the compact record of each input token's experts
(engines/inference/routing.py, protocol.RoutedExperts), the gate weights recomputed over
replayed experts and the replayed experts laid out like each forward's input
(engines/training/routing_replay.py), the batch (core/batching.py), the replay buffer's
checkpoint (core/run_state.py) and the config key. The engines and the trainer on a model:
tests/integration/engines/test_routing_replay.py."""

import pickle
from array import array

import numpy as np
import pytest
import torch
from packing_cases import grouped_batch
from safetensors.torch import load_file, save_file

from eddyrl.core import run_state
from eddyrl.core.batching import build_train_batch
from eddyrl.engines.config import RolloutConfig
from eddyrl.engines.inference.routing import (as_routed, check_vllm_routing, from_vllm,
                                              id_typecode, input_rows, with_carried)
from eddyrl.engines.training.packing import micro_batches
from eddyrl.engines.training.routing_replay import (RoutingReplay, gate_weights, layout,
                                                    prompts_routed_alike)
from eddyrl.errors import ConfigError
from eddyrl.protocol import GenerationResult, Group, RoutedExperts, Trajectory


def _ids(rows: int, layers: int = 2, top_k: int = 2, experts: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, experts, (rows, layers, top_k), generator=gen,
                         dtype=torch.int16)


@pytest.mark.parametrize("experts, typecode, dtype", [(4, "b", torch.int8),
                                                      (128, "b", torch.int8),
                                                      (200, "h", torch.int16)])
def test_a_record_round_trips_in_one_byte_an_id_up_to_128_experts(experts, typecode,
                                                                  dtype):
    ids = _ids(7, experts=experts)
    ids[0, 0, 0] = experts - 1
    record = as_routed(ids, id_typecode(experts))
    assert record.ids.typecode == typecode and record.ids.itemsize == dtype.itemsize
    assert (record.num_tokens, record.layers, record.top_k) == (7, 2, 2)
    assert record.as_tensor().dtype == dtype
    assert torch.equal(record.as_tensor().long(), ids.long())
    assert torch.equal(record.head(3).as_tensor().long(), ids[:3].long())
    assert input_rows(5, 4) == 8 and input_rows(5, 1) == 5 and input_rows(5, 0) == 5
    result = GenerationResult("r", [1], [2], [0.0], [0], "stop", routed_experts=record)
    assert pickle.loads(pickle.dumps(result)) == result  # as Ray carries a worker's results


def test_carried_rows_come_first_even_past_what_was_recorded():
    recorded = _ids(6, seed=1)
    carried = as_routed(_ids(4, seed=2), "b")
    merged = with_carried(recorded, carried)
    assert torch.equal(merged[:4], carried.as_tensor().to(merged.dtype))
    assert torch.equal(merged[4:], recorded[4:])
    longer = with_carried(recorded[:2], carried)  # e.g. a segment whose output was lost
    assert longer.shape[0] == 4 and torch.equal(longer, carried.as_tensor().to(longer.dtype))
    assert torch.equal(with_carried(recorded, None), recorded)
    with pytest.raises(ValueError, match="3 layers"):
        with_carried(recorded, as_routed(_ids(2, layers=3), "b"))


def test_vllms_routed_experts_become_a_record_and_old_releases_are_refused():
    routed = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 4
    carried = as_routed(torch.full((2, 2, 2), 3, dtype=torch.int16), "b")
    record = from_vllm(routed, 4, carried)
    assert record.ids.typecode == "b"
    want = torch.tensor(routed, dtype=torch.int16)
    want[:2] = 3
    assert torch.equal(record.as_tensor().to(torch.int16), want)
    with pytest.raises(ValueError, match="expected"):
        from_vllm(np.zeros((5, 2)), 4)
    moe = {"model_type": "qwen3_moe", "num_experts": 4}
    assert check_vllm_routing("0.32.0", frozenset({"enable_return_routed_experts"}), moe) == 4
    with pytest.raises(ConfigError, match="vLLM 0.10.0 has no routed-experts output"):
        check_vllm_routing("0.10.0", frozenset({"model"}), moe)
    with pytest.raises(ConfigError, match="Model Runner V2, which needs Triton"):
        check_vllm_routing("0.32.0", frozenset({"enable_return_routed_experts"}), moe,
                           has_triton=False)
    with pytest.raises(ConfigError, match="'qwen3' has no experts"):
        check_vllm_routing("0.32.0", frozenset({"enable_return_routed_experts"}),
                           {"model_type": "qwen3"})


def _router(norm_topk_prob: bool = True):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    return router


@pytest.mark.parametrize("normalize", [True, False])
def test_gate_weights_are_the_routers_own_where_unknown_and_over_the_replayed_elsewhere(
        normalize):
    router = _router(normalize)
    hidden = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    logits, own_weights, own = router(hidden)
    replayed = torch.tensor([[0, 1], [-1, -1], [3, 2], [2, -1], [1, 0]])
    weights, experts = gate_weights(logits, replayed, own, normalize)
    for row in (1, 3):  # unknown (wholly or partly): the router's own, exactly
        assert torch.equal(experts[row], own[row])
        assert torch.equal(weights[row], own_weights[row])
    probs = torch.softmax(logits.double(), -1)
    for row in (0, 2, 4):  # by hand: softmax over all experts, at the replayed, renormalised
        assert experts[row].tolist() == replayed[row].tolist()
        want = probs[row, replayed[row]]
        want = want / want.sum() if normalize else want
        torch.testing.assert_close(weights[row].double(), want, rtol=1e-6, atol=1e-7)


def test_the_replay_hook_routes_to_the_replayed_experts_and_the_router_still_learns():
    router = _router()
    parent = torch.nn.Module()
    parent.gate = router
    replay = RoutingReplay(parent)
    hidden = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    _, _, own = router(hidden)
    other = (own + 1) % 4  # every token elsewhere
    replay.use(other[:, None, :].to(torch.int8))
    _, weights, experts = router(hidden)
    assert torch.equal(experts, other)
    weights[:, 0].sum().backward()  # the weights come from the router's logits: a gradient
    assert router.weight.grad is not None and router.weight.grad.abs().max() > 0
    replay.use(None)
    assert torch.equal(router(hidden)[2], own)
    with pytest.raises(ValueError, match="2 layers"):
        replay.use(torch.zeros(4, 2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="expert id 7"):  # refused before any forward
        replay.use(torch.full((4, 1, 2), 7, dtype=torch.int8))
    with pytest.raises(ConfigError, match="has no expert router"):
        RoutingReplay(torch.nn.Linear(2, 2)).use(torch.zeros(1, 1, 2, dtype=torch.int8))


def _with_experts(batch):
    """Experts a function of (token, position): rows sharing a prompt route it alike."""
    ids, positions = batch.input_ids, torch.arange(batch.input_ids.shape[1])
    base = (ids * 7 + positions) % 100
    batch.routed_experts = torch.stack([base, base + 1, base + 2, base + 3], -1).view(
        *ids.shape, 2, 2).to(torch.int8)
    return batch


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("how", ["rows", "shared", "varlen"])
def test_each_position_of_the_forward_takes_the_experts_of_its_input_token(seed, how):
    batch = _with_experts(grouped_batch(seed))
    parts = micro_batches(batch, 64 if how != "rows" else 3, share_prompts=how == "shared",
                          varlen=how == "varlen")
    if how != "rows" and seed == 0:  # seed 0's batch has prompts to share
        assert any(m.packed is not None for m in parts)
    for micro in parts:
        out = layout(micro)
        rows = micro.batch
        source = (micro.packed.source if micro.packed is not None else
                  torch.arange(rows.input_ids.numel()).view(rows.input_ids.shape) - 1)
        size = (micro.packed.input_ids if micro.packed is not None else rows.input_ids).numel()
        assert out.shape == (size, 2, 2)
        covered = torch.zeros(size, dtype=torch.bool)
        for i, end in enumerate(rows.attention_mask.sum(1).tolist()):
            for t in range(1, end):  # token t is predicted where token t - 1 is the input
                assert torch.equal(out[source[i, t]], rows.routed_experts[i, t - 1])
                covered[source[i, t]] = True
        assert torch.all(out[~covered] == -1)  # last tokens, padding: the model's own
    assert prompts_routed_alike(batch)


def test_rows_whose_prompt_was_routed_differently_do_not_share_its_forward():
    batch = _with_experts(grouped_batch(0))
    assert prompts_routed_alike(batch)
    p = int(batch.prompt_lengths[1])
    batch.routed_experts[1, p - 1] += 1
    same = [i for i in range(len(batch)) if int(batch.prompt_lengths[i]) == p and torch.equal(
        batch.input_ids[i, :p], batch.input_ids[1, :p])]
    assert prompts_routed_alike(batch) == (len(same) == 1)
    batch.routed_experts = None
    assert prompts_routed_alike(batch)


def _result(rid: str, prompt: list[int], tokens: int, experts: RoutedExperts | None,
            loss_mask=None) -> GenerationResult:
    return GenerationResult(rid, prompt, list(range(3, 3 + tokens)), [-0.5] * tokens,
                            [0] * tokens, "stop", loss_mask=loss_mask, routed_experts=experts)


def _groups() -> list[Group]:
    prompt = [1, 9, 8]
    a = as_routed(_ids(len(prompt) + 4 - 1, seed=3), "b")
    b = as_routed(_ids(len(prompt) + 2 - 1, seed=4), "b")
    return [Group("g0", "q", "a", prompt, 0, [
        Trajectory(_result("r0", prompt, 4, a), reward=1.0),
        Trajectory(_result("r1", prompt, 2, b, loss_mask=[1, 0]), reward=0.0),
        Trajectory(_result("r2", prompt, 3, None), reward=0.5)])]


def test_the_batch_aligns_each_rows_experts_with_its_input_ids():
    groups = _groups()
    batch = build_train_batch(groups, pad_id=0)
    assert batch.routed_experts.shape == (3, 7, 2, 2)
    assert batch.routed_experts.dtype == torch.int8  # 4 experts: a byte an id, 28 B a token
    for i, trajectory in enumerate(groups[0].trajectories):
        experts = trajectory.result.routed_experts
        n = 0 if experts is None else experts.num_tokens
        if n:
            assert torch.equal(batch.routed_experts[i, :n], experts.as_tensor())
        assert torch.all(batch.routed_experts[i, n:] == -1)  # last token, padding, unknown
    part = batch.select([1, 0]).select_columns(4)
    assert torch.equal(part.routed_experts, batch.routed_experts[[1, 0], :4])
    wide = as_routed(_ids(6, experts=200), "h")
    groups[0].trajectories[2].result.routed_experts = wide
    assert build_train_batch(groups, pad_id=0).routed_experts.dtype == torch.int16
    groups[0].trajectories[2].result.routed_experts = as_routed(_ids(6, layers=3), "b")
    with pytest.raises(ValueError, match="different shapes"):
        build_train_batch(groups, pad_id=0)
    assert build_train_batch([Group("g", "", "", [1], 0, [Trajectory(_result(
        "x", [1], 2, None))])], pad_id=0).routed_experts is None


def test_the_replay_buffers_checkpoint_keeps_the_experts_exactly(tmp_path):
    groups = _groups()
    groups[0].trajectories[2].result.routed_experts = as_routed(_ids(5, experts=200), "h")
    metas, tensors = run_state._pack_groups(groups)
    save_file(tensors, tmp_path / "t.safetensors")
    back = run_state._unpack_groups(metas, load_file(tmp_path / "t.safetensors"))
    for saved, restored in zip(groups[0].trajectories, back[0].trajectories):
        assert restored.result == saved.result  # RoutedExperts compares ids and typecode
    # a checkpoint written before routing replay: no experts anywhere
    old = {k: v for k, v in tensors.items() if "routed_experts" not in k}
    metas = [{**m, "trajectories": [{k: v for k, v in t.items() if k != "experts"}
                                    for t in m["trajectories"]]} for m in metas]
    assert all(t.result.routed_experts is None
               for t in run_state._unpack_groups(metas, old)[0].trajectories)


def test_the_config_key_reaches_only_an_engine_that_records(monkeypatch):
    from eddyrl.engines import registry

    on = RolloutConfig(routing_replay=True)
    on.validate("rollout")
    assert on.engine_options(64)["record_routing"] is True
    assert "record_routing" not in RolloutConfig().engine_options(64)
    monkeypatch.setitem(registry.INFERENCE_ENGINES, "other", "x:Y")
    with pytest.raises(ConfigError, match="'rollout.routing_replay' = true needs an engine"):
        RolloutConfig(routing_replay=True, engine="other").validate("rollout")
    assert array("b", [1]) == array("b", [1])  # what RoutedExperts equality rests on


def test_a_vllm_trajectory_reports_the_experts_of_its_input_tokens():
    from eddyrl.engines.inference.vllm.trajectory import Trajectory as VLLMTrajectory
    from eddyrl.protocol import GenerationRequest, SamplingParams

    carried = as_routed(torch.full((3, 2, 2), 3, dtype=torch.int16), "b")
    request = GenerationRequest("r", [1, 5, 6], SamplingParams(), resume_ids=[7],
                                resume_logprobs=[-1.0], resume_versions=[0],
                                resume_experts=carried)
    trajectory = VLLMTrajectory(request)
    assert trajectory.result("abort").routed_experts is carried  # no segment finished yet
    trajectory.tokens += [8, 9, 10]
    trajectory.logprobs += [-1.0] * 3
    trajectory.versions += [0] * 3
    # vLLM's rows: prompt + tokens but the last (3 + 4 - 1), the first 3 carried over
    trajectory.keep_experts(np.arange(6 * 4).reshape(6, 2, 2) % 4, 4)
    got = trajectory.result("stop").routed_experts.as_tensor()
    assert got.shape == (6, 2, 2) and torch.all(got[:3] == 3)
    assert torch.equal(got[3:].long(), torch.tensor(np.arange(24).reshape(6, 2, 2) % 4)[3:])
    assert trajectory.result("progress", 2).routed_experts.num_tokens == 4  # cut with it


def test_a_later_vllm_segment_keeps_the_rows_of_the_earlier_ones():
    from eddyrl.engines.inference.vllm.trajectory import Trajectory as VLLMTrajectory
    from eddyrl.protocol import GenerationRequest, SamplingParams

    trajectory = VLLMTrajectory(GenerationRequest("r", [1, 5], SamplingParams()))
    trajectory.tokens += [7, 8]  # first segment: rows of 1, 5, 7
    trajectory.keep_experts(np.zeros((3, 1, 2)), 4)
    trajectory.tokens += [9, 10]  # after a weight switch: all rows routed again, as 1s
    trajectory.keep_experts(np.ones((5, 1, 2)), 4)
    got = trajectory.result("stop").routed_experts.as_tensor()
    assert got[:, 0, 0].tolist() == [0, 0, 0, 1, 1]
