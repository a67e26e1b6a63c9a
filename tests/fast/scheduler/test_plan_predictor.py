"""Plan predictions for the adaptive scheduler: the cost model's shape, the run's scale."""

import pytest

from eddyrl.scheduler.adaptive import GenerationPlan
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.scheduler.plan_predictor import PlanPredictor, StepObservation, rollout_cost_model

QWEN3_4B = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560,
            "intermediate_size": 9728, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
CURRENT = GenerationPlan(concurrency=64, partial_rollout=False)


def _predictor(max_length=8000.0, mean_length=2000.0, requests=256.0):
    predictor = PlanPredictor(CostModel("H100", "Qwen3-4B"), CURRENT)
    predictor.observe(StepObservation(requests_per_worker=requests, mean_length=mean_length,
                                      max_length=max_length, mean_context=1500.0,
                                      rollout_s=300.0, train_s=120.0), CURRENT)
    return predictor


def test_the_current_plan_predicts_what_was_measured():
    assert _predictor()(CURRENT) == pytest.approx((300.0, 120.0))


def test_partial_rollout_pays_for_the_mean_length_instead_of_the_tail():
    predictor = _predictor(max_length=8000.0, mean_length=2000.0)
    t_partial, _ = predictor(GenerationPlan(concurrency=64, partial_rollout=True))
    assert t_partial == pytest.approx(300.0 * 2000 / 8000)
    flat = _predictor(max_length=2000.0, mean_length=2000.0)  # no tail: nothing to gain
    assert flat(GenerationPlan(64, True))[0] == pytest.approx(300.0)


def test_with_staleness_the_tail_overlaps_the_next_prompts_and_partial_rollout_buys_nothing():
    predictor = PlanPredictor(CostModel("H100", "Qwen3-4B"), CURRENT, tail_bounds_step=False)
    predictor.observe(StepObservation(requests_per_worker=256.0, mean_length=2000.0,
                                      max_length=8000.0, mean_context=1500.0,
                                      rollout_s=300.0, train_s=120.0), CURRENT)
    assert predictor(GenerationPlan(64, True))[0] == pytest.approx(300.0)
    # concurrency still counts: fewer, wider waves while decode is memory-bound
    assert predictor(GenerationPlan(256, False))[0] < 300.0


def test_more_concurrency_means_fewer_waves_while_decode_is_memory_bound():
    predictor = _predictor(requests=256.0)
    assert predictor(GenerationPlan(256, False))[0] < predictor(GenerationPlan(64, False))[0]
    assert predictor(GenerationPlan(32, False))[0] > 300.0


def test_no_observation_is_an_error_and_cost_models_are_chosen_by_name_or_measured():
    with pytest.raises(ValueError, match="no step observed"):
        PlanPredictor(CostModel("H100", "Qwen3-4B"), CURRENT)(CURRENT)
    assert rollout_cost_model("H100", "cuda", QWEN3_4B).accelerator.name == "H100"
    assert rollout_cost_model("auto", "cuda", QWEN3_4B) is None  # cannot name it: no guess
    assert rollout_cost_model("auto", "cpu", QWEN3_4B).accelerator.name == "cpu-measured"


def test_a_bucket_layout_is_predicted_by_its_slowest_bucket():
    """Short bucket: 3 workers share 96 short requests; long bucket: 1 worker has 32 long
    ones and sets the step time. One worker moved short -> long shortens the step; the other
    way lengthens it; the current layout still predicts what was measured."""
    from eddyrl.scheduler.plan_predictor import BucketLoad

    current = GenerationPlan(64, False, (3, 1))
    predictor = PlanPredictor(CostModel("H100", "Qwen3-4B"), current)
    predictor.observe(StepObservation(
        requests_per_worker=32.0, mean_length=1500.0, max_length=8000.0, mean_context=1500.0,
        rollout_s=300.0, train_s=120.0,
        buckets=(BucketLoad(96, 500.0, 1000.0), BucketLoad(32, 4500.0, 8000.0))), current)
    assert predictor(current) == pytest.approx((300.0, 120.0))
    assert predictor(GenerationPlan(64, False, (2, 2)))[0] < 300.0
    assert predictor(GenerationPlan(64, False, (3, 1)))[0] == pytest.approx(300.0)
    with pytest.raises(ValueError, match="has 3 buckets"):
        predictor(GenerationPlan(64, False, (1, 1, 2)))
