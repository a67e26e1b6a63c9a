"""The stability governor (core/governor.py) driven by scripted signals: trouble lowers K (halving
the lag trained), calm raises it back one at a time after the hysteresis, the bounds hold, a
missing signal is never acted on; and driven together with the version window, as the
controller and the simulator drive it."""

import random

import pytest

from eddyrl.config import load_config
from eddyrl.core.config import WindowConfig
from eddyrl.core.governor import Governor, Limit, Signals
from eddyrl.core.version_window import VersionWindow
from eddyrl.errors import ConfigError

LIMITS = [Limit("mismatch_kl", 0.01, upper=True),
          Limit("correction_masked_fraction", 0.05, upper=True),
          Limit("is_ess", 0.5, upper=False)]


def calm(lag=1):
    return {"mismatch_kl": 0.001, "correction_masked_fraction": 0.0, "is_ess": 0.9,
            "staleness_counts": {str(lag): 4}}


def trouble(lag, **signals):
    return {**calm(lag), "mismatch_kl": 0.05, **signals}


def test_a_scripted_climb_lowers_k_and_calm_raises_it_back_within_the_bounds():
    governor = Governor(k=4, lowest=1, highest=4, calm_steps=3, limits=LIMITS)
    script = [
        (calm(4), "hold", 4),
        (trouble(4), "lower", 2),  # halve the lag trained: 4 // 2
        (trouble(4), "hold", 2),  # lag 4 was admitted before K fell: wait for the new K
        (trouble(2, mismatch_kl=0.001, correction_masked_fraction=0.2), "lower", 1),
        (trouble(1), "hold", 1),  # governor_min_staleness
        *[(calm(1), "hold", 1)] * 2, (calm(1), "raise", 2),
        *[(calm(2), "hold", 2)] * 2, (calm(2), "raise", 3),
        (calm(3), "hold", 3), (trouble(3, mismatch_kl=0.001, is_ess=0.2), "lower", 1),
        *[(calm(1), "hold", 1)] * 2, (calm(1), "raise", 2),
        *[(calm(2), "hold", 2)] * 2, (calm(2), "raise", 3),
        *[(calm(3), "hold", 3)] * 2, (calm(3), "raise", 4),
        *[(calm(4), "hold", 4)] * 5,  # governor_max_staleness
    ]
    for i, (metrics, action, k) in enumerate(script):
        decision = governor.decide(Signals.of(metrics))
        assert (decision.action, decision.k) == (action, k), (i, decision)
    assert governor.k == 4


def test_reasons_name_the_signal_its_value_and_the_limit():
    governor = Governor(k=3, lowest=0, highest=3, calm_steps=2, limits=LIMITS)
    decision = governor.decide(Signals.of(trouble(3, is_ess=0.25)))
    assert decision.metrics() == {
        "governor_k": 1, "governor_action": "lower",
        "governor_reason": "mismatch_kl 0.05 > 0.01, is_ess 0.25 < 0.5 at lag 3",
        "governor_correction_scale": 1.0}
    assert "admitted before K was lowered to 1" in governor.decide(
        Signals.of(trouble(3))).reason
    assert "calm 1/2" == governor.decide(Signals.of(calm())).reason


def test_missing_signals_are_never_acted_on():
    governor = Governor(k=2, lowest=0, highest=3, calm_steps=2, limits=LIMITS)
    governor.decide(Signals.of(calm()))  # calm 1/2
    for metrics in ({}, {"reward_mean": 0.3, "staleness_counts": {"2": 8}},
                    {"mismatch_kl": float("nan")}, {"is_ess": None}, {"mismatch_kl": True}):
        decision = governor.decide(Signals.of(metrics))
        assert (decision.action, decision.k) == ("hold", 2), metrics
        assert decision.reason.startswith("no signal")
    # the calm count neither grew nor reset across the missing steps: one more calm step raises
    assert governor.decide(Signals.of(calm())).action == "raise"
    # judged on what is present: ESS alone, below its floor, is trouble
    assert governor.decide(Signals.of({"is_ess": 0.1, "staleness_counts": {"3": 2}})).k == 1


def test_trouble_at_lag_0_holds_and_unknown_lags_halve_k():
    governor = Governor(k=3, lowest=0, highest=3, calm_steps=1, limits=LIMITS)
    decision = governor.decide(Signals.of(trouble(0)))
    assert (decision.action, decision.k) == ("hold", 3) and "lag 0" in decision.reason
    decision = governor.decide(Signals.of({"mismatch_kl": 1.0}))  # no staleness_counts
    assert (decision.action, decision.k) == ("lower", 1)
    # lags under K: halve the lag actually trained, not K
    governor = Governor(k=4, lowest=0, highest=4, calm_steps=1, limits=LIMITS)
    assert governor.decide(Signals.of(trouble(1))).k == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_signals_keep_k_in_bounds_and_move_it_only_by_the_rules(seed):
    rng = random.Random(seed)
    lowest, highest = rng.randrange(3), rng.randrange(3, 7)
    governor = Governor(k=highest, lowest=lowest, highest=highest, calm_steps=rng.randrange(1, 4),
                        limits=LIMITS)
    moves = 0
    for _ in range(2000):
        metrics = {name: rng.choice([None, rng.random() * 0.02, rng.random()])
                   for name in ("mismatch_kl", "correction_masked_fraction", "is_ess")}
        metrics["staleness_counts"] = {str(rng.randrange(highest + 2)): 1} \
            if rng.random() < 0.8 else {}
        before = governor.k
        decision = governor.decide(Signals.of(metrics))
        assert lowest <= decision.k <= highest and decision.k == governor.k
        if decision.action == "raise":
            assert decision.k == before + 1
        elif decision.action == "lower":
            assert decision.k <= before // 2 or decision.k == lowest
            assert decision.k < before
        else:
            assert decision.k == before
        moves += decision.action != "hold"
    assert moves > 50


def test_state_round_trips_and_a_resume_keeps_k_within_its_own_bounds():
    governor = Governor(k=4, lowest=0, highest=4, calm_steps=3, limits=LIMITS)
    governor.decide(Signals.of(trouble(4)))
    governor.decide(Signals.of(calm(2)))
    resumed = Governor(k=4, lowest=0, highest=4, calm_steps=3, limits=LIMITS)
    resumed.restore(governor.state())
    assert resumed.state() == governor.state() == {"k": 2, "calm": 1, "scale": 1.0}
    narrower = Governor(k=3, lowest=3, highest=3, calm_steps=3, limits=LIMITS)
    narrower.restore(governor.state())
    assert narrower.k == 3


def test_the_window_section_builds_the_governor_it_describes():
    governor = Governor.from_config(WindowConfig(max_staleness=3, governor=True,
                                                 governor_min_staleness=1))
    assert (governor.k, governor.lowest, governor.highest, governor.calm_steps) == (3, 1, 3, 5)
    assert [(limit.signal, limit.threshold, limit.upper) for limit in governor.limits] == [
        ("mismatch_kl", 0.01, True), ("correction_masked_fraction", 0.05, True),
        ("is_ess", 0.5, False)]  # the limits that default to None judge nothing
    governor = Governor.from_config(WindowConfig(
        max_staleness=2, governor=True, governor_max_staleness=5, governor_min_entropy=0.1,
        governor_max_mismatch_kl=None))
    assert governor.highest == 5 and governor.k == 2
    assert {limit.signal for limit in governor.limits} == {
        "correction_masked_fraction", "is_ess", "entropy"}


@pytest.mark.parametrize("overrides,message", [
    (["window.max_staleness=1", "window.governor=true", "window.governor_min_staleness=2"],
     "window.max_staleness (1) is where the governor starts; it must lie within "
     "[window.governor_min_staleness, window.governor_max_staleness] = [2, 1]"),
    (["window.max_staleness=3", "window.governor=true", "window.governor_max_staleness=2"],
     "= [0, 2]"),
    (["window.governor_min_ess=1.5"], "'window.governor_min_ess' = 1.5"),
    (["window.governor_max_mismatch_kl=-0.1"], "'window.governor_max_mismatch_kl' = -0.1"),
    (["window.governor_calm_steps=0"], "'window.governor_calm_steps' = 0"),
])
def test_bad_governor_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["loop.steps=10", *overrides])
    assert message in str(error.value)


def test_governor_bounds_are_not_checked_while_it_is_off():
    config = load_config(overrides=["window.max_staleness=0", "window.governor_min_staleness=2"])
    assert not config.window.governor


def test_driving_the_window_with_synthetic_mismatch_settles_k_and_trains_every_group_once():
    """A sans-IO loop like the controller's: dispatch what the window admits, collect, take a
    batch, report a mismatch that grows with the lag trained (0.006 per version: over the 0.01
    limit from lag 2), let the governor set K. K falls from 4 to where the mismatch is under
    the limit, stays there with the calm raises probing back up, and every group is trained
    once within the K of its dispatch."""
    b = 2
    window = VersionWindow(max_staleness=4, batch_groups=b, max_concurrent=5 * b)
    governor = Governor(k=4, lowest=0, highest=4, calm_steps=4, limits=LIMITS)
    rng = random.Random(0)
    ids, bound, born, trained, ks = iter(range(10**6)), {}, {}, [], []
    for _ in range(200):
        while window.capacity():
            group = f"g{next(ids)}"
            born[group] = window.dispatch(group)
            bound[group] = window.max_staleness
        batch = window.take_batch()
        while batch is None:  # the rollout finishes groups in random order
            window.collect(rng.choice(window.running_groups()))
            batch = window.take_batch()
        lags = [window.version - born[g] for g in batch]
        assert all(lag <= bound[g] for lag, g in zip(lags, batch))
        trained += batch
        window.advance()
        counts = {str(lag): lags.count(lag) for lag in set(lags)}
        decision = governor.decide(Signals.of({"mismatch_kl": 0.006 * max(lags),
                                               "staleness_counts": counts}))
        window.set_max_staleness(decision.k)
        ks.append(decision.k)
    assert len(trained) == len(set(trained)) == 200 * b
    # K = 1 keeps the mismatch (0.006) under the limit; the calm raises probe K = 2 (0.012:
    # over it), which is lowered again once data at lag 2 is trained
    assert ks[0] == 4 and set(ks[-100:]) == {1, 2}
    assert sum(k == 1 for k in ks[-100:]) > 50


def test_the_bounds_narrow_where_k_cannot_help_and_widen_back_before_k_rises():
    governor = Governor(k=1, lowest=0, highest=1, calm_steps=2, limits=LIMITS, min_scale=0.25)
    script = [
        (trouble(1), "lower", 0, 1.0),  # K first
        (trouble(0), "narrow", 0, 0.5),  # on-policy: the numerics, K cannot help
        (trouble(0), "narrow", 0, 0.25),
        (trouble(0), "hold", 0, 0.25),  # governor_min_correction_scale
        # masking alone, from the governor's own narrowing: widen, never narrow further
        (trouble(0, mismatch_kl=0.001, correction_masked_fraction=0.2), "widen", 0, 0.5),
        (calm(0), "hold", 0, 0.5), (calm(0), "widen", 0, 1.0),  # the bounds come back first
        (calm(0), "hold", 0, 1.0), (calm(0), "raise", 1, 1.0),
    ]
    for step, (signals, action, k, scale) in enumerate(script):
        decision = governor.decide(Signals.of(signals))
        assert (decision.action, decision.k, decision.correction_scale) == (action, k, scale), \
            (step, decision)
        assert decision.metrics()["governor_correction_scale"] == scale


def test_with_the_default_minimum_scale_the_bounds_never_move():
    governor = Governor(k=0, lowest=0, highest=2, calm_steps=1, limits=LIMITS)
    for _ in range(5):
        decision = governor.decide(Signals.of(trouble(0)))
        assert (decision.action, decision.correction_scale) == ("hold", 1.0)
    masked = governor.decide(Signals.of(trouble(0, mismatch_kl=0.001,
                                                correction_masked_fraction=0.2)))
    assert masked.action == "hold" and masked.correction_scale == 1.0


def test_a_checkpoint_keeps_the_scale_within_the_resumed_runs_minimum():
    governor = Governor(k=1, lowest=0, highest=1, calm_steps=2, limits=LIMITS, min_scale=0.25)
    for signals in (trouble(1), trouble(0), trouble(0)):
        governor.decide(Signals.of(signals))
    assert governor.state()["scale"] == 0.25
    resumed = Governor(k=1, lowest=0, highest=1, calm_steps=2, limits=LIMITS, min_scale=0.5)
    resumed.restore(governor.state())
    assert resumed.scale == 0.5
    older = Governor(k=1, lowest=0, highest=1, calm_steps=2, limits=LIMITS, min_scale=0.25)
    older.restore({"k": 0, "calm": 0})  # a checkpoint from before the scale
    assert older.scale == 1.0
