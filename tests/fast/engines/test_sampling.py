"""The sampler's reported log-probs and its top-k / top-p restrictions."""

import math

import torch

from eddyrl.engines.inference.sampling import sample, scaled_logprobs


def test_logprob_is_temperature_scaled_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logprobs = sample(logits, temperature=0.5, generator=torch.Generator().manual_seed(0))
    z = [4.0, 2.0, 0.0]  # logits / 0.5
    expected = z[tokens.item()] - math.log(sum(math.exp(v) for v in z))
    assert logprobs.item() == pytest_approx(expected)


def pytest_approx(value):
    import pytest

    return pytest.approx(value, abs=1e-6)


def test_greedy_takes_argmax_and_reports_temperature_one():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    tokens, logprobs = sample(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, scaled_logprobs(logits, 1.0)[[0, 1], [1, 0]])


def test_top_k_and_top_p_only_draw_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sample(logits, temperature=1.0, top_k=2, generator=gen)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample(logits, temperature=1.0, top_p=0.7, generator=gen)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7, then 0.8 crosses: keep tokens 0 and 1
    tokens, _ = sample(logits, temperature=1.0, top_p=0.4, generator=gen)
    assert set(tokens.tolist()) == {0}


def test_seeded_generator_repeats():
    logits = torch.randn(16, 50)
    a, _ = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b, _ = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
