"""The PPO-clip loss against values worked out by hand.

Log-probs are built as old + log(r), so each token's ratio is exactly the r written in the test.
"""

import math

import pytest
import torch

from eddyrl.protocol import TrainBatch
from eddyrl.core.losses import make_policy_loss
from eddyrl.errors import ConfigError


def _batch(old, advantages, mask, weights=None, ref=None, prox=None) -> TrainBatch:
    old, advantages, mask = (torch.tensor(x, dtype=torch.float32) for x in (old, advantages, mask))
    rows = mask.shape[0]
    return TrainBatch(input_ids=torch.zeros(mask.shape, dtype=torch.long),
                      attention_mask=torch.ones(mask.shape, dtype=torch.long), loss_mask=mask,
                      old_logprobs=old, advantages=advantages,
                      sample_weights=torch.ones(rows) if weights is None else torch.tensor(weights),
                      versions=torch.zeros(mask.shape, dtype=torch.long),
                      ref_logprobs=None if ref is None else torch.tensor(ref),
                      prox_logprobs=None if prox is None else torch.tensor(prox))


def _logprobs_with_ratios(old, ratios):
    """Leaf log-probs old + log(r) (r = 1 where None), so gradients can be read back."""
    values = [[o + (math.log(r) if r is not None else 0.0) for o, r in zip(orow, rrow)]
              for orow, rrow in zip(old, ratios)]
    return torch.tensor(values, requires_grad=True)


# One row: position 0 is the prompt (never trained); four response tokens with
#   t1: r = 1.5, A = +1 -> min(1.5, 1.2) = 1.2  -> loss -1.2, clipped (no gradient)
#   t2: r = 0.5, A = +1 -> min(0.5, 0.8) = 0.5  -> loss -0.5
#   t3: r = 1.5, A = -1 -> min(-1.5, -1.2) = -1.5 -> loss +1.5
#   t4: r = 0.5, A = -1 -> min(-0.5, -0.8) = -0.8 -> loss +0.8, clipped (no gradient)
OLD = [[0.0, -1.0, -2.0, -0.5, -1.5]]
RATIOS = [[None, 1.5, 0.5, 1.5, 0.5]]
ADV = [[0.0, 1.0, 1.0, -1.0, -1.0]]
MASK = [[0.0, 1.0, 1.0, 1.0, 1.0]]


def test_clip_for_positive_and_negative_advantages():
    logprobs = _logprobs_with_ratios(OLD, RATIOS)
    loss_fn = make_policy_loss(clip_low=0.2, clip_high=0.2)
    loss, metrics = loss_fn(logprobs, _batch(OLD, ADV, MASK), 4)
    # (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.6 / 4
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # (1.5 + 0.5 + 1.5 + 0.5) / 4
    # k3 = r - 1 - ln r: 0.094535 at r = 1.5, 0.193147 at r = 0.5; mean 0.143841
    assert metrics["approx_kl"] == pytest.approx(0.143841, abs=1e-5)
    loss.backward()
    # d(-r A / N) / d logprob = -A r / N where unclipped: t2 -0.5/4, t3 +1.5/4; clipped ones 0.
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, -0.125, 0.375, 0.0]]), atol=1e-6)


def test_clip_higher_lets_positive_advantages_grow_further():
    # clip_high 0.28: t1 is now capped at 1.28 -> -1.28; the rest as before:
    # (-1.28 - 0.5 + 1.5 + 0.8) / 4 = 0.13
    logprobs = _logprobs_with_ratios(OLD, RATIOS)
    loss, _ = make_policy_loss(clip_low=0.2, clip_high=0.28)(logprobs, _batch(OLD, ADV, MASK), 4)
    assert loss.item() == pytest.approx(0.13, abs=1e-6)
    # r = 1.25, A = +1: clipped at 1.2 by the symmetric clip, inside the clip-higher range.
    ratios, adv, mask, old = [[None, 1.25]], [[0.0, 1.0]], [[0.0, 1.0]], [[0.0, -1.0]]
    symmetric, _ = make_policy_loss(0.2, 0.2)(_logprobs_with_ratios(old, ratios),
                                              _batch(old, adv, mask), 1)
    higher, _ = make_policy_loss(0.2, 0.28)(_logprobs_with_ratios(old, ratios),
                                            _batch(old, adv, mask), 1)
    assert symmetric.item() == pytest.approx(-1.2) and higher.item() == pytest.approx(-1.25)


def test_token_level_normalisation_uses_the_global_count_and_sample_weights():
    # Ratio 1 everywhere, so each token's loss is -A * weight.
    # Row 0: 2 tokens, A = 1, weight 1 -> -2.   Row 1: 3 tokens, A = 2, weight 0.5 -> -3.
    old = [[0.0, -1.0, -1.0, 0.0], [0.0, -1.0, -1.0, -1.0]]
    adv = [[0.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0]]
    mask = [[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
    batch = _batch(old, adv, mask, weights=[1.0, 0.5])
    loss_fn = make_policy_loss()
    logprobs = torch.tensor(old)
    whole, _ = loss_fn(logprobs, batch, 5)
    assert whole.item() == pytest.approx(-1.0)  # -5 / 5
    # Split into micro-batches with the same global count: -2/5 + -3/5, the same total.
    parts = [loss_fn(logprobs[i:i + 1], batch.select(slice(i, i + 1)), 5)[0] for i in range(2)]
    assert [p.item() for p in parts] == pytest.approx([-0.4, -0.6])
    # Another rank holding 5 more tokens halves this rank's share.
    assert loss_fn(logprobs, batch, 10)[0].item() == pytest.approx(-0.5)


def test_kl_to_reference_uses_k3():
    # A = 0, so only the KL term: ref - logprob = ln 2 -> 2 - ln 2 - 1 = 0.306853,
    # ref - logprob = -ln 2 -> 0.5 + ln 2 - 1 = 0.193147; they sum to exactly 0.5.
    old = [[0.0, -1.0, -1.0]]
    ref = [[0.0, -1.0 + math.log(2.0), -1.0 - math.log(2.0)]]
    batch = _batch(old, [[0.0, 0.0, 0.0]], [[0.0, 1.0, 1.0]], weights=[2.0], ref=ref)
    loss, metrics = make_policy_loss(kl_coef=0.1)(torch.tensor(old), batch, 2)
    assert loss.item() == pytest.approx(2.0 * 0.1 * 0.5 / 2, abs=1e-6)  # weight 2, 2 tokens
    assert metrics["kl_ref"] == pytest.approx(0.25, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_policy_loss(kl_coef=0.1)(torch.tensor(old), _batch(old, old, [[0.0, 1.0, 1.0]]), 2)


def test_truncated_importance_sampling_weights_by_the_capped_behaviour_ratio():
    # pi/pi_behaviour = 4 -> weight min(4, 2) = 2; = 0.5 -> 0.5. A = 1: loss -(2 + 0.5) / 2.
    old = [[0.0, -2.0, -1.0]]
    logprobs = _logprobs_with_ratios(old, [[None, 4.0, 0.5]])
    loss, metrics = make_policy_loss(tis_cap=2.0)(
        logprobs, _batch(old, [[0.0, 1.0, 1.0]], [[0.0, 1.0, 1.0]]), 2)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.25) and metrics["clip_fraction"] == 0.0
    loss.backward()  # gradient -A * w / N: -1.0 and -0.25
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -1.0, -0.25]]), atol=1e-6)


def test_padding_with_any_logprob_gives_finite_loss_and_gradient():
    old, ref = [[0.0, -1.0, 0.0]], [[0.0, -1.0, 0.0]]
    logprobs = torch.tensor([[0.0, -1.0, float("-inf")]], requires_grad=True)
    batch = _batch(old, [[0.0, 1.0, 5.0]], [[0.0, 1.0, 0.0]], ref=ref)
    loss, metrics = make_policy_loss(kl_coef=0.1)(logprobs, batch, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logprobs.grad).all() and all(map(math.isfinite, metrics.values()))


@pytest.mark.parametrize("kwargs", [{"clip_low": 1.0}, {"clip_high": -0.1}, {"kl_coef": -1.0},
                                    {"tis_cap": 0.0}, {"dual_clip": 1.0}])
def test_bad_settings_name_the_key(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        make_policy_loss(**kwargs)


# Decoupled PPO, truncated importance sampling, dual clip.


def test_on_policy_decoupled_is_the_plain_policy_gradient():
    # prox = behaviour = current: r = 1 and w = 1 everywhere, so every mode is -sum(A) / N.
    # A = (1, -2, 0.5), N = 3: loss = -(1 - 2 + 0.5) / 3 = 1/6; d loss / d logpi_t = -A_t / 3.
    old, adv, mask = [[0.0, -1.0, -0.5, -2.0]], [[0.0, 1.0, -2.0, 0.5]], [[0.0, 1.0, 1.0, 1.0]]
    coupled = torch.tensor(old, requires_grad=True)
    decoupled = torch.tensor(old, requires_grad=True)
    plain, _ = make_policy_loss()(coupled, _batch(old, adv, mask), 3)
    loss, metrics = make_policy_loss(tis_cap=2.0, dual_clip=3.0)(
        decoupled, _batch(old, adv, mask, prox=old), 3)
    plain.backward()
    loss.backward()
    assert loss.item() == pytest.approx(1.0 / 6.0, abs=1e-6) and loss.item() == plain.item()
    expected = torch.tensor([[0.0, -1.0 / 3.0, 2.0 / 3.0, -0.5 / 3.0]])
    assert torch.allclose(decoupled.grad, expected, atol=1e-6)
    assert torch.equal(decoupled.grad, coupled.grad)
    assert metrics["tis_weight_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["dual_clip_fraction"] == 0.0 and metrics["tis_truncated_fraction"] == 0.0


def test_importance_weight_is_truncated_at_the_cap():
    # logpi = prox (r = 1); prox / behaviour = 4, 0.5, 3 -> w = min(., 2) = 2, 0.5, 2. A = 1:
    # loss = -(2 + 0.5 + 2) / 3 = -1.5; gradient -w A / N = -2/3, -1/6, -2/3.
    # The last position is padding with prox = -inf: it must change nothing.
    old = [[0.0, -2.0, -1.0, -3.0, 0.0]]
    prox = [[0.0, -2.0 + math.log(4.0), -1.0 + math.log(0.5), -3.0 + math.log(3.0),
             float("-inf")]]
    logprobs = torch.tensor([row[:4] + [0.0] for row in prox], requires_grad=True)
    batch = _batch(old, [[0.0, 1.0, 1.0, 1.0, 0.0]], [[0.0, 1.0, 1.0, 1.0, 0.0]], prox=prox)
    loss, metrics = make_policy_loss(tis_cap=2.0)(logprobs, batch, 3)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -2 / 3, -1 / 6, -2 / 3, 0.0]]),
                          atol=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.5, abs=1e-6)  # (2 + 0.5 + 2) / 3
    assert metrics["tis_truncated_fraction"] == pytest.approx(2 / 3)
    # No cap: the raw weights, -(4 + 0.5 + 3) / 3 = -2.5.
    uncapped, metrics = make_policy_loss()(logprobs.detach(), batch, 3)
    assert uncapped.item() == pytest.approx(-2.5, abs=1e-5)
    assert metrics["tis_truncated_fraction"] == 0.0


def test_dual_clip_bounds_only_negative_advantages_with_a_large_ratio():
    # Coupled mode, clip 0.2, c = 3:
    #   t1: r = 5,   A = -1: min(-5, -1.2) = -5, below c A = -3 -> J = -3, loss 3, no gradient
    #   t2: r = 5,   A = +1: min(5, 1.2) = 1.2 (A > 0: the dual clip never applies) -> loss -1.2
    #   t3: r = 2,   A = -1: min(-2, -1.2) = -2, above -3 -> loss 2, gradient -A r / N = 2/4
    #   t4: r = 0.5, A = -1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped
    # loss = (3 - 1.2 + 2 + 0.8) / 4 = 1.15; without the dual clip (5 - 1.2 + 2 + 0.8) / 4 = 1.65.
    old = [[0.0, -3.0, -3.0, -1.0, -1.0]]
    ratios = [[None, 5.0, 5.0, 2.0, 0.5]]
    adv, mask = [[0.0, -1.0, 1.0, -1.0, -1.0]], [[0.0, 1.0, 1.0, 1.0, 1.0]]
    logprobs = _logprobs_with_ratios(old, ratios)
    loss, metrics = make_policy_loss(dual_clip=3.0)(logprobs, _batch(old, adv, mask), 4)
    loss.backward()
    assert loss.item() == pytest.approx(1.15, abs=1e-5)
    assert metrics["dual_clip_fraction"] == pytest.approx(0.25)
    assert metrics["clip_fraction"] == pytest.approx(0.5)  # t2 and t4
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.0]]), atol=1e-5)
    plain, _ = make_policy_loss()(logprobs.detach(), _batch(old, adv, mask), 4)
    assert plain.item() == pytest.approx(1.65, abs=1e-5)


def test_decoupled_ratio_is_taken_against_prox_not_behaviour():
    # Per token: r = pi / pi_prox, w = pi_prox / pi_behaviour, A = +1, clip 0.2.
    #   t1: r = 1.5, w = 0.5: w * min(1.5, 1.2) = 0.6 -> loss -0.6, clipped (no gradient)
    #   t2: r = 1.1, w = 2:   w * min(1.1, 1.2) = 2.2 -> loss -2.2, gradient -w r A / N = -1.1
    # loss = (-0.6 - 2.2) / 2 = -1.4.
    # Coupled, the ratio against behaviour is r w = 0.75 and 2.2:
    #   min(0.75, 0.8) = 0.75 and min(2.2, 1.2) = 1.2 -> (-0.75 - 1.2) / 2 = -0.975.
    behaviour = [[0.0, -1.0, -2.0]]
    prox = [[0.0, -1.0 + math.log(0.5), -2.0 + math.log(2.0)]]
    logprobs = _logprobs_with_ratios(prox, [[None, 1.5, 1.1]])
    adv, mask = [[0.0, 1.0, 1.0]], [[0.0, 1.0, 1.0]]
    batch = _batch(behaviour, adv, mask, prox=prox)
    loss, metrics = make_policy_loss()(logprobs, batch, 2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.4, abs=1e-5)
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1]]), atol=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((0.75 + 2.2) / 2, abs=1e-5)  # vs behaviour
    coupled, _ = make_policy_loss()(logprobs.detach(), _batch(behaviour, adv, mask), 2)
    assert coupled.item() == pytest.approx(-0.975, abs=1e-5)
    # The proximal log-probs travel with the rows like every other per-position tensor.
    part = batch.select([0]).select_columns(2)
    assert torch.equal(part.prox_logprobs, batch.prox_logprobs[:, :2])
