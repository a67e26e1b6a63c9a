"""The adaptive scheduler: Libra's borrow/return thresholds, no flapping on noisy signals,
cooldown and warm-up, the plan rule (gain >= min_gain and saving > reconfiguration cost),
decisions logged with their reasons, and config contradictions named."""

import random

import pytest

from eddyrl.errors import ConfigError
from eddyrl.scheduler.adaptive import (AdaptiveConfig, AdaptiveScheduler, Change,
                                       GenerationPlan, Signals)

PLAN = GenerationPlan(concurrency=64, partial_rollout=False)
BETTER = GenerationPlan(concurrency=128, partial_rollout=True)


def _scheduler(predict=None, **overrides):
    config = AdaptiveConfig(**{"enabled": True, "window": 4, "cooldown_steps": 6,
                               "switch_partial_rollout": True, **overrides})
    config.validate("adaptive")
    return AdaptiveScheduler(config, PLAN, predict)


def _feed(scheduler, steps, ratio, pressure=0.3, rollout_s=10.0):
    for _ in range(steps):
        scheduler.observe(scheduler.step + 1, rollout_s, rollout_s * ratio, pressure, 1.0)


def _predictor(best_step_s, current_step_s=10.0, others_s=12.0):
    """Predicted (t_rollout, t_train): BETTER takes best_step_s, the current plan
    current_step_s, every other candidate others_s."""
    def predict(plan):
        step_s = {PLAN: current_step_s, BETTER: best_step_s}.get(plan, others_s)
        return step_s, step_s * 0.8
    return predict


def test_borrows_at_ratio_1_15_and_not_below():
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=1.14)
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.KEEP
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=1.15)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.BORROW
    assert decision.reason == "train/rollout ratio 1.150 >= borrow_ratio 1.15"


def test_returns_at_ratio_0_90_and_at_pressure_0_80():
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=0.91)
    assert scheduler.decide(can_borrow=True, can_return=True).change is Change.KEEP
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=0.90)
    decision = scheduler.decide(can_borrow=True, can_return=True)
    assert decision.change is Change.RETURN and "ratio 0.900 <= return_ratio 0.9" in decision.reason
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=1.5, pressure=0.8)  # training is the bottleneck, but rollout is full
    decision = scheduler.decide(can_borrow=True, can_return=True)
    assert decision.change is Change.RETURN
    assert decision.reason == "rollout pressure 0.80 >= return_pressure 0.8"


def test_nothing_to_return_or_borrow_keeps_and_says_why():
    scheduler = _scheduler()
    _feed(scheduler, 4, ratio=0.5)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.KEEP and "no borrowed worker to return" in decision.reason
    _feed(scheduler, 4, ratio=1.5)
    decision = scheduler.decide(can_borrow=False, can_return=False)
    assert decision.change is Change.KEEP and "no worker can be borrowed" in decision.reason
    _feed(scheduler, 4, ratio=1.5, pressure=0.9)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.KEEP and "it would be returned at once" in decision.reason


def test_warm_up_and_cooldown_hold_back_changes():
    scheduler = _scheduler()
    _feed(scheduler, 3, ratio=2.0)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.KEEP
    assert decision.reason == "warming up: 3/4 measurements since the last change"
    _feed(scheduler, 1, ratio=2.0)
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.BORROW  # step 4
    for step in range(5, 10):  # steps 5..9 are within the 6-step cooldown
        _feed(scheduler, 1, ratio=0.1)
        decision = scheduler.decide(can_borrow=True, can_return=True)
        assert decision.change is Change.KEEP and decision.reason.startswith("cooldown"), step
    _feed(scheduler, 1, ratio=0.1)
    assert scheduler.decide(can_borrow=True, can_return=True).change is Change.RETURN


def test_measurements_before_a_change_are_forgotten():
    scheduler = _scheduler(cooldown_steps=0)
    _feed(scheduler, 4, ratio=2.0)
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.BORROW
    assert scheduler.signals() is None
    _feed(scheduler, 4, ratio=1.0)
    assert scheduler.signals().ratio == 1.0


def _changes_on_noise(config, seed=1234, steps=500):
    """A train/rollout ratio drawn from [1.0, 1.2], each borrowed worker shortening training by
    12%, and rollout pressure drawn from [0.2, 0.9]: the decisions that changed something."""
    rng = random.Random(seed)
    scheduler = AdaptiveScheduler(config, PLAN)
    borrowed, changes = 0, []
    for step in range(1, steps + 1):
        ratio = rng.uniform(1.0, 1.2) * (1 - 0.12 * borrowed)
        scheduler.observe(step, 10.0, 10.0 * ratio, rng.uniform(0.2, 0.9), 1.0)
        decision = scheduler.decide(can_borrow=borrowed < 3, can_return=borrowed > 0)
        borrowed += {Change.BORROW: 1, Change.RETURN: -1}.get(decision.change, 0)
        if decision.change is not Change.KEEP:
            changes.append(decision)
    assert len(scheduler.decisions) == steps
    return changes


def test_noisy_ratio_between_1_0_and_1_2_does_not_flap():
    changes = _changes_on_noise(AdaptiveConfig(enabled=True))
    assert len(changes) <= 2, [(d.step, d.change, d.reason) for d in changes]
    assert all(d.change is Change.BORROW for d in changes)
    # The same thresholds on raw signals, without cooldown, flap all the time.
    raw = _changes_on_noise(AdaptiveConfig(enabled=True, window=1, cooldown_steps=0))
    assert len(raw) > 50 and {d.change for d in raw} == {Change.BORROW, Change.RETURN}


def test_a_signal_alternating_across_both_thresholds_is_smoothed_away():
    for smoothing in ("ema", "median"):
        scheduler = _scheduler(smoothing=smoothing, cooldown_steps=0)
        for step in range(1, 201):
            ratio = 1.25 if step % 2 else 0.85
            scheduler.observe(step, 10.0, 10.0 * ratio, 0.3, 1.0)
            decision = scheduler.decide(can_borrow=True, can_return=True)
            assert decision.change is Change.KEEP, (smoothing, step, decision.reason)


def test_median_ignores_a_single_spike():
    scheduler = _scheduler(smoothing="median", window=5)
    for ratio in (1.0, 1.0, 3.0, 1.0, 1.0):
        _feed(scheduler, 1, ratio=ratio)
    assert scheduler.signals().ratio == 1.0
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.KEEP


def test_a_better_plan_is_applied_when_it_pays_for_itself():
    scheduler = _scheduler(_predictor(best_step_s=8.0))
    _feed(scheduler, 4, ratio=1.0)  # measured step: 10 s
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.SET_PLAN and decision.plan == BETTER == scheduler.plan
    assert "gain 20.0%, saving 40.0s over 20 steps, reconfiguration cost 15.0s" in decision.reason


def test_a_plan_gaining_under_5_percent_is_rejected():
    scheduler = _scheduler(_predictor(best_step_s=9.6))
    _feed(scheduler, 4, ratio=1.0)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.KEEP and scheduler.plan == PLAN
    assert "gain 4.0%" in decision.reason and "gain < min_gain 5%" in decision.reason


def test_a_plan_whose_saving_does_not_exceed_the_measured_cost_is_rejected():
    scheduler = _scheduler(_predictor(best_step_s=7.5))  # gain 25%
    _feed(scheduler, 4, ratio=1.0, rollout_s=3.0)  # 0.25 * 3 s * 20 steps = 15 s = the cost
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision.change is Change.KEEP
    assert decision.reason.endswith("saving does not exceed the cost")
    scheduler.record_reconfiguration_cost(20.0)
    scheduler.record_reconfiguration_cost(10.0)  # measured: 15 s on average, still too much
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.KEEP
    scheduler.record_reconfiguration_cost(2.0)  # now 32 / 3 s
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.SET_PLAN


def test_the_split_comes_first_one_change_per_decision():
    scheduler = _scheduler(_predictor(best_step_s=5.0), cooldown_steps=0)
    _feed(scheduler, 4, ratio=1.3)
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.BORROW
    assert scheduler.plan == PLAN
    _feed(scheduler, 4, ratio=1.0)
    assert scheduler.decide(can_borrow=True, can_return=False).change is Change.SET_PLAN


def test_every_decision_is_logged_with_inputs_and_reason():
    scheduler = _scheduler(_predictor(best_step_s=9.9))
    assert scheduler.decide(can_borrow=True, can_return=False).reason == \
        "warming up: 0/4 measurements since the last change"
    _feed(scheduler, 4, ratio=1.05, pressure=0.5)
    decision = scheduler.decide(can_borrow=True, can_return=False)
    assert decision == scheduler.decisions[-1] and len(scheduler.decisions) == 2
    assert decision.signals == Signals(rollout_s=10.0, train_s=10.5, pressure=0.5,
                                       staleness=1.0)
    assert decision.can_borrow and not decision.can_return and decision.step == 4
    assert decision.reason.startswith("ratio 1.050 within (0.9, 1.15); best plan")
    first = scheduler.decisions[0]
    assert first.change is Change.KEEP and first.signals is None
    disabled = AdaptiveScheduler(AdaptiveConfig(), PLAN)
    assert disabled.decide(can_borrow=True, can_return=True).reason == \
        "adaptive scheduling is disabled"


def test_bad_measurements_and_predictions_are_named():
    scheduler = _scheduler(lambda plan: (0.0, 0.0))
    with pytest.raises(ValueError, match="rollout_s = -1.0 at step 1"):
        scheduler.observe(1, -1.0, 1.0, 0.0, 0.0)
    _feed(scheduler, 4, ratio=1.0)
    with pytest.raises(ValueError, match="observe\\(step=4\\) after step 4"):
        scheduler.observe(4, 1.0, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="predictor returned .* for GenerationPlan"):
        scheduler.decide(can_borrow=True, can_return=False)


@pytest.mark.parametrize("overrides,message", [
    ({"return_ratio": 1.2}, r"adaptive.return_ratio \(1.2\) >= adaptive.borrow_ratio \(1.15\)"),
    ({"borrow_ratio": 1.0}, r"'adaptive.borrow_ratio' = 1.0 is out of range"),
    ({"return_pressure": 1.5}, r"'adaptive.return_pressure' = 1.5"),
    ({"min_gain": 1.0}, r"'adaptive.min_gain' = 1.0"),
    ({"smoothing": "mean"}, r"'adaptive.smoothing' = 'mean' is not allowed"),
    ({"window": 0}, r"'adaptive.window' = 0"),
    ({"concurrency_choices": []}, r"adaptive.concurrency_choices is empty"),
    ({"concurrency_choices": [8, 0]}, r"'adaptive.concurrency_choices\[1\]' = 0"),
])
def test_config_errors_name_the_keys(overrides, message):
    AdaptiveConfig().validate("adaptive")
    with pytest.raises(ConfigError, match=message):
        AdaptiveConfig(**overrides).validate("adaptive")


def test_bucket_layouts_one_worker_away_are_candidates_and_chosen_when_they_pay():
    from eddyrl.scheduler.adaptive import neighbour_layouts

    assert sorted(neighbour_layouts((3, 1))) == [(2, 2)]
    assert sorted(neighbour_layouts((2, 1, 1))) == [(1, 1, 2), (1, 2, 1)]
    current = GenerationPlan(64, False, (3, 1))
    wanted = GenerationPlan(64, False, (2, 2))

    def predict(plan):  # only the layout matters here
        return (7.0 if plan.layout == (2, 2) else 10.0), 5.0

    config = AdaptiveConfig(enabled=True, window=4, cooldown_steps=6)
    scheduler = AdaptiveScheduler(config, current, predict)
    assert wanted in scheduler.candidates()
    assert all(p.layout == (3, 1) or (p.concurrency, p.partial_rollout) == (64, False)
               for p in scheduler.candidates())  # one dimension at a time
    _feed(scheduler, 4, ratio=0.95)
    decision = scheduler.decide(can_borrow=False, can_return=False)
    assert decision.change is Change.SET_PLAN and decision.plan == wanted
    assert "layout=(2, 2)" in decision.reason
    # the next layout step (1, 3) predicts no better: after the cooldown nothing changes
    _feed(scheduler, 10, ratio=0.95)
    assert scheduler.decide(can_borrow=False, can_return=False).change is Change.KEEP


def test_plans_keep_the_runs_partial_rollout_unless_they_may_switch_it():
    """Partial rollout changes the algorithm (trajectories span versions): by default no
    candidate plan turns it on or off, so a plan predicted faster only by it is not taken."""
    def predict(plan):  # partial rollout would halve the rollout
        return (5.0 if plan.partial_rollout else 10.0), 4.0
    keeping = _scheduler(predict, switch_partial_rollout=False)
    assert {p.partial_rollout for p in keeping.candidates()} == {False}
    _feed(keeping, 4, ratio=1.0)
    assert keeping.decide(can_borrow=False, can_return=False).change is Change.KEEP
    switching = _scheduler(predict)
    assert {p.partial_rollout for p in switching.candidates()} == {False, True}
    _feed(switching, 4, ratio=1.0)
    decision = switching.decide(can_borrow=False, can_return=False)
    assert decision.change is Change.SET_PLAN and decision.plan.partial_rollout


def test_with_nothing_else_to_choose_the_plan_is_kept():
    scheduler = _scheduler(lambda plan: (10.0, 4.0), concurrency_choices=[64],
                           switch_partial_rollout=False)
    _feed(scheduler, 4, ratio=1.0)
    decision = scheduler.decide(can_borrow=False, can_return=False)
    assert decision.change is Change.KEEP and "no other plan" in decision.reason
