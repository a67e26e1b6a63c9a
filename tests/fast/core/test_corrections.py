"""The off-policy correction presets (core/corrections.py, core/losses.py) against values worked
out by hand, and the mismatch signals every step reports.

One batch for every preset. The log-probs are the proximal ones (r = 1, the clip inactive) and
every advantage is 1, so loss = -sum_t w_t / N and d loss / d logpi_t = -w_t / N: the gradient
reads back each token's weight. Position 0 of each row is the prompt; row 1 ends in padding
whose proximal log-prob is -inf. With rho_t = prox_t / behaviour_t on the N = 5 trained tokens:

    row 0: rho = 4, 1/4, 3/2   S = 3/2   G = (3/2)^(1/3) = 1.1447
    row 1: rho = 3, 2          S = 6     G = 6^(1/2)     = 2.4495
"""

import math

import pytest
import torch

from eddyrl.core.corrections import resolve_correction
from eddyrl.core.losses import effective_sample_size, make_policy_loss
from eddyrl.core.update import with_ess
from eddyrl.metric_kinds import is_maximum
from eddyrl.errors import ConfigError
from eddyrl.protocol import TrainBatch

RHO = [[None, 4.0, 0.25, 1.5, None], [None, 3.0, 2.0, None, None]]
MASK = [[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]]
BEHAVIOUR = [[0.0, -2.0, -1.0, -3.0, 0.0], [0.0, -1.5, -2.5, 0.0, 0.0]]
N = 5


def _prox():
    return [[b + (math.log(r) if r is not None else 0.0) for b, r in zip(brow, rrow)]
            for brow, rrow in zip(BEHAVIOUR, RHO)]


def _batch(prox=True) -> TrainBatch:
    mask = torch.tensor(MASK)
    proximal = torch.tensor(_prox())
    proximal[1, 3] = float("-inf")  # padding may hold any log-prob
    return TrainBatch(input_ids=torch.zeros(mask.shape, dtype=torch.long),
                      attention_mask=torch.ones(mask.shape, dtype=torch.long), loss_mask=mask,
                      old_logprobs=torch.tensor(BEHAVIOUR), advantages=mask.clone(),
                      sample_weights=torch.ones(2), versions=torch.zeros(mask.shape,
                                                                         dtype=torch.long),
                      prox_logprobs=proximal if prox else None)


def _run(prox=True, **settings):
    logprobs = torch.tensor(_prox(), requires_grad=True)
    loss, metrics = make_policy_loss(**settings)(logprobs, _batch(prox), N)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    weights = (-logprobs.grad * N)[torch.tensor(MASK) > 0]  # row 0's three, then row 1's two
    return loss.item(), weights.tolist(), metrics


# preset (and bounds): the weights of the five trained tokens, masked and truncated fractions
CASES = {
    # no correction: the decoupled weight rho itself
    "none": ({}, [4, 0.25, 1.5, 3, 2], 0.0, 0.0),
    # min(rho, 2): 4 and 3 truncated (2 is not above the bound)
    "token_tis": ({}, [2, 0.25, 1.5, 2, 2], 0.0, 2 / 5),
    # min(S, 2) per row: row 0 keeps 1.5, row 1's 6 -> 2 on both its tokens
    "seq_tis": ({}, [1.5, 1.5, 1.5, 2, 2], 0.0, 2 / 5),
    # rho in [0.5, 2] kept, bounds included: 4, 1/4 and 3 masked
    "token_mask": ({}, [0, 0, 1.5, 0, 2], 3 / 5, 0.0),
    # S in [0.5, 2]: row 0 (1.5) keeps S on its tokens, row 1 (6) is masked whole
    "seq_mask": ({}, [1.5, 1.5, 1.5, 0, 0], 2 / 5, 0.0),
    # rho in [0.5, 5]: only 1/4 masked
    "icepop": ({}, [4, 0, 1.5, 3, 2], 1 / 5, 0.0),
    # G in [0.999, 1.001] (verl's default): neither row
    "geo_mask": ({}, [0, 0, 0, 0, 0], 1.0, 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_preset_weighs_masks_and_truncates_as_worked_by_hand(name):
    bounds, weights, masked, truncated = CASES[name]
    loss, got, metrics = _run(correction=name, **bounds)
    assert got == pytest.approx(weights, abs=1e-5)
    assert loss == pytest.approx(-sum(weights) / N, abs=1e-5)
    assert metrics["correction_masked_fraction"] == pytest.approx(masked)
    assert metrics["correction_truncated_fraction"] == pytest.approx(truncated)
    assert metrics["tis_truncated_fraction"] == metrics["correction_truncated_fraction"]
    assert metrics["tis_weight_mean"] == pytest.approx(sum(weights) / N, abs=1e-5)


def test_geometric_mask_with_wider_bounds_keeps_row_0_at_weight_one():
    # G0 = 1.1447 in [0.5, 2]: kept with weight 1 (Geo-RS has no IS weight); G1 = 2.449 masked
    loss, weights, metrics = _run(correction="geo_mask", correction_low=0.5,
                                  correction_high=2.0)
    assert weights == pytest.approx([1, 1, 1, 0, 0], abs=1e-6)
    assert loss == pytest.approx(-3 / 5, abs=1e-6)
    assert metrics["correction_masked_fraction"] == pytest.approx(2 / 5)


def test_bounds_override_the_defaults():
    # icepop on [0.3, 3.5]: 4 and 1/4 masked -> 1.5 + 3 + 2
    loss, weights, _ = _run(correction="icepop", correction_low=0.3, correction_high=3.5)
    assert weights == pytest.approx([0, 0, 1.5, 3, 2], abs=1e-5)
    # seq_tis at 10: neither row reaches it
    _, weights, metrics = _run(correction="seq_tis", correction_high=10.0)
    assert weights == pytest.approx([1.5, 1.5, 1.5, 6, 6], abs=1e-5)
    assert metrics["correction_truncated_fraction"] == 0.0


def test_a_preset_without_proximal_logprobs_takes_the_current_ones():
    # prox = logpi.detach() (the trainer's own log-probs, as tis_cap did): the same rho
    for name, (bounds, weights, masked, _) in CASES.items():
        if name == "none":
            continue  # none without prox is the coupled objective: w = 1
        _, got, metrics = _run(prox=False, correction=name, **bounds)
        assert got == pytest.approx(weights, abs=1e-5), name
        assert metrics["correction_masked_fraction"] == pytest.approx(masked)
    # none without prox is the coupled objective: w = 1 and the clip on r = rho (0.2 each
    # side, A = 1): min(rho, clip(rho)) = 1.2, 0.25, 1.2, 1.2, 1.2; only 0.25 has a gradient
    loss, got, _ = _run(prox=False)
    assert got == pytest.approx([0, 0.25, 0, 0, 0], abs=1e-6)
    assert loss == pytest.approx(-5.05 / 5, abs=1e-6)


def test_tis_cap_is_token_tis_bit_for_bit():
    a, b = (torch.tensor(_prox(), requires_grad=True) for _ in range(2))
    old, _ = make_policy_loss(tis_cap=2.0)(a, _batch(), N)
    new, _ = make_policy_loss(correction="token_tis", correction_high=2.0)(b, _batch(), N)
    old.backward()
    new.backward()
    assert torch.equal(old, new) and torch.equal(a.grad, b.grad)
    assert resolve_correction(tis_cap=3.0) == resolve_correction("token_tis", high=3.0)


def test_mismatch_signals_are_the_same_whatever_the_preset():
    # log rho = ln 4, -ln 4, ln 1.5, ln 3, ln 2. k3 = rho - 1 - ln rho:
    #   1.613706 + 0.636294 + 0.094535 + 0.901388 + 0.306853 = 3.552776 -> mean 0.710555
    # max |log rho| = ln 4. rho: sum 10.75, sum of squares 16 + 1/16 + 9/4 + 9 + 4 = 31.3125
    # ESS = 10.75^2 / (5 * 31.3125) = 115.5625 / 156.5625 = 0.738124
    for name in CASES:
        _, _, metrics = _run(correction=name, **CASES[name][0])
        assert metrics["mismatch_kl"] == pytest.approx(0.710555, abs=1e-5)
        assert metrics["mismatch_max_abs"] == pytest.approx(math.log(4.0), abs=1e-6)
        assert metrics["is_ratio_mean"] == pytest.approx(2.15, abs=1e-6)
        assert metrics["is_ratio_sq_mean"] == pytest.approx(6.2625, abs=1e-5)
        assert with_ess(metrics)["is_ess"] == pytest.approx(0.738124, abs=1e-5)


def test_effective_sample_size_is_of_the_whole_step_not_a_mean_of_parts():
    # Row by row, as two micro-batches (or ranks) would report: token means, then the
    # engines' reduction (value x tokens summed, over all tokens) gives the whole batch's
    # means, and the ESS from them is the batch's, 0.738124.
    parts = []
    for row in range(2):
        logprobs = torch.tensor(_prox())[row:row + 1]
        batch = _batch().select([row])
        _, metrics = make_policy_loss()(logprobs, batch, N)
        parts.append((metrics, float(batch.loss_mask.sum())))
    reduced = {k: sum(m[k] * t for m, t in parts) / N
               for k in ("is_ratio_mean", "is_ratio_sq_mean")}
    ess = effective_sample_size(reduced["is_ratio_mean"], reduced["is_ratio_sq_mean"])
    assert ess == pytest.approx(0.738124, abs=1e-5)
    # each row's own: row 0 (4, 1/4, 3/2) 5.75^2 / (3 * 18.3125) = 0.601820; row 1 (3, 2)
    # 25 / (2 * 13) = 0.961538; their token mean 0.745700 is not the step's ESS
    own = [effective_sample_size(m["is_ratio_mean"], m["is_ratio_sq_mean"]) for m, _ in parts]
    assert own == pytest.approx([0.601820, 0.961538], abs=1e-5)
    assert abs((3 * own[0] + 2 * own[1]) / 5 - ess) > 5e-3
    # the maximum is a maximum: row 0's ln 4, not a token mean of both rows'
    assert [m["mismatch_max_abs"] for m, _ in parts] == pytest.approx([math.log(4),
                                                                      math.log(3)])
    assert is_maximum("mismatch_max_abs") and is_maximum("mismatch_abs_max")
    assert not is_maximum("mismatch_kl") and not is_maximum("is_ess")


def test_effective_sample_size_edges():
    assert effective_sample_size(1.0, 1.0) == 1.0  # all weights equal
    assert effective_sample_size(0.0, 0.0) == 1.0  # no trained token: nothing to judge
    assert effective_sample_size(math.inf, math.inf) == 0.0  # w^2 overflowed: one dominates


def test_huge_mismatch_stays_finite():
    # |log rho| = 80: rho^2 overflows float32, not the float64 the metrics use
    old = [[0.0, -90.0, -1.0]]
    logprobs = torch.tensor([[0.0, -10.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    batch = TrainBatch(input_ids=torch.zeros((1, 3), dtype=torch.long),
                       attention_mask=torch.ones((1, 3), dtype=torch.long), loss_mask=mask,
                       old_logprobs=torch.tensor(old), advantages=mask.clone(),
                       sample_weights=torch.ones(1), versions=torch.zeros((1, 3),
                                                                          dtype=torch.long))
    for name in CASES:
        loss, metrics = make_policy_loss(correction=name)(logprobs, batch, 2)
        assert math.isfinite(loss.item()), name
        assert all(map(math.isfinite, metrics.values())), (name, metrics)
    # seq_tis: S = e^80 overflows float32 to inf; the weight is the bound, 2
    loss, metrics = make_policy_loss(correction="seq_tis")(logprobs, batch, 2)
    assert loss.item() == pytest.approx(-2.0) and metrics["correction_truncated_fraction"] == 1
    assert 0 < with_ess(metrics)["is_ess"] <= 0.5 + 1e-6  # one of two weights dominates


# Config errors name the key.


@pytest.mark.parametrize("settings, key", [
    ({"name": "icepops"}, "algorithm.correction"),
    ({"name": "icepop", "low": 2.0, "high": 1.0}, "algorithm.correction_low"),
    ({"name": "icepop", "low": 1.0, "high": 1.0}, "algorithm.correction_high"),
    ({"name": "token_mask", "low": -0.5}, "algorithm.correction_low"),
    ({"name": "token_tis", "high": -1.0}, "algorithm.correction_high"),
    ({"name": "token_tis", "high": 0.0}, "algorithm.correction_high"),
    ({"name": "token_tis", "low": 0.5}, "algorithm.correction_low"),
    ({"name": "none", "high": 2.0}, "algorithm.correction_high"),
    ({"name": "icepop", "tis_cap": 2.0}, "algorithm.tis_cap"),
    ({"name": "token_tis", "tis_cap": 2.0, "high": 3.0}, "algorithm.correction_high"),
    ({"tis_cap": 0.0}, "algorithm.tis_cap"),
])
def test_bad_correction_settings_name_the_key(settings, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_correction(**settings)


def test_an_unknown_preset_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'icepop'"):
        resolve_correction("icepops")


def test_the_algorithm_section_checks_its_correction():
    from eddyrl.core.config import AlgorithmConfig

    AlgorithmConfig(correction="seq_mask", correction_low=0.2).validate("algorithm")
    with pytest.raises(ConfigError, match=r"algorithm\.tis_cap.*algorithm\.correction"):
        AlgorithmConfig(correction="geo_mask", tis_cap=2.0).validate("algorithm")
    with pytest.raises(ConfigError, match=r"algorithm\.correction_low"):
        AlgorithmConfig(correction="seq_mask", correction_low=3.0).validate("algorithm")


def test_the_update_keeps_a_maximum_over_its_optimizer_steps_and_derives_the_ess():
    from eddyrl.core.config import AlgorithmConfig
    from eddyrl.core.update import PolicyUpdate

    class TwoSteps:  # reports what two optimizer steps' engines would, already reduced
        reports = iter([{"mismatch_max_abs": 0.5, "is_ratio_mean": 1.0, "is_ratio_sq_mean": 1.0},
                        {"mismatch_max_abs": 0.25, "is_ratio_mean": 2.0,
                         "is_ratio_sq_mean": 8.0}])

        def compute_logprobs(self, batch):
            return torch.zeros(batch.input_ids.shape)

        def train_step(self, batch, loss_fn, **_):
            return next(self.reports)

    update = PolicyUpdate(AlgorithmConfig(), mini_batches=2)
    metrics = update(_batch(prox=False), TwoSteps())
    assert metrics["mismatch_max_abs"] == 0.5  # the larger, not the mean 0.375
    # means over the two steps: 1.5 and 4.5 -> ESS 2.25 / 4.5 = 0.5
    assert metrics["is_ratio_mean"] == 1.5 and metrics["is_ess"] == pytest.approx(0.5)


def _run_scaled(scale, **settings):
    """`_run` with the governor's per-row scale of the bounds on the batch."""
    logprobs = torch.tensor(_prox(), requires_grad=True)
    batch = _batch()
    batch.correction_scale = torch.tensor(scale)
    loss, metrics = make_policy_loss(**settings)(logprobs, batch, N)
    loss.backward()
    return (-logprobs.grad * N)[torch.tensor(MASK) > 0].tolist(), metrics


def test_the_governors_scale_narrows_each_rows_bounds_in_log_space():
    # icepop [0.5, 5] at scale 0.5 on row 0: [0.5 ** 0.5, 5 ** 0.5] = [0.707, 2.236]: 4 and 1/4
    # masked, 1.5 kept; row 1 at scale 1: [0.5, 5], 3 and 2 kept
    weights, metrics = _run_scaled([0.5, 1.0], correction="icepop")
    assert weights == pytest.approx([0, 0, 1.5, 3, 2], abs=1e-5)
    assert metrics["correction_masked_fraction"] == pytest.approx(2 / 5)
    # token_tis (cap 2) at scale 0.5: cap sqrt(2) = 1.4142 on every token above it
    weights, metrics = _run_scaled([0.5, 0.5], correction="token_tis")
    assert weights == pytest.approx([2 ** 0.5, 0.25, 2 ** 0.5, 2 ** 0.5, 2 ** 0.5], abs=1e-5)
    assert metrics["correction_truncated_fraction"] == pytest.approx(4 / 5)


def test_a_scale_of_one_is_the_configured_bounds_and_none_ignores_it():
    for name in ("token_tis", "icepop", "seq_mask"):
        assert _run_scaled([1.0, 1.0], correction=name)[0] == \
            pytest.approx(CASES[name][1], abs=1e-5)
    assert _run_scaled([0.25, 0.25], correction="none")[0] == \
        pytest.approx(CASES["none"][1], abs=1e-5)
