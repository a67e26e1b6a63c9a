"""The `hf` engine's key/value buffers (kv_cache.py), sized at prefill and grown by doubling:
over seeded random schedules of appends and row selections a buffered layer holds exactly
what transformers' `DynamicLayer` holds, takes memory as it fills, and says so when full.
(The decode path that uses them, on the tiny model: test_hf_decode.py.)"""

import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from eddyrl.engines.inference.kv_cache import _BufferedLayer


@pytest.mark.parametrize("seed", range(20))
def test_buffered_layer_holds_what_a_dynamic_layer_holds(seed, monkeypatch):
    """Also while its buffers grow (GROWTH 1 or 2: a doubling every few steps)."""
    import eddyrl.engines.inference.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "GROWTH", [1, 2, 64][seed % 3])
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, heads, dim = rng.randrange(1, 6), 2, 4
    prefill = rng.randrange(1, 7)
    steps = rng.randrange(0, 12)
    reference, buffered = DynamicLayer(), _BufferedLayer(capacity=prefill + steps)
    for n in [prefill] + [1] * steps:
        keys = torch.randn(batch, heads, n, dim, generator=gen)
        values = torch.randn(batch, heads, n, dim, generator=gen)
        want = reference.update(keys, values)
        got = buffered.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert buffered.get_seq_length() == reference.get_seq_length()
        if rng.random() < 0.4:  # drop rows, keep them, or repeat one (a shared prefill)
            index = torch.tensor(sorted(rng.choices(range(batch), k=rng.randrange(1, 2 * batch))))
            reference.batch_select_indices(index)
            buffered.batch_select_indices(index)
            batch = len(index)
            assert torch.equal(reference.keys, buffered.keys)
            assert torch.equal(reference.values, buffered.values)


def test_a_buffered_layer_takes_memory_as_it_fills_not_for_its_whole_capacity():
    from eddyrl.engines.inference.kv_cache import GROWTH

    layer = _BufferedLayer(capacity=10_000)
    layer.update(torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4))
    assert layer._key_buffer.shape[2] == 5 + GROWTH
    for _ in range(GROWTH + 1):
        layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    assert layer._key_buffer.shape[2] == 2 * (5 + GROWTH)  # one doubling
    assert torch.equal(layer.keys[:, :, :5], torch.zeros(2, 1, 5, 4))
    assert torch.equal(layer.keys[:, :, 5:], torch.ones(2, 1, GROWTH + 1, 4))


def test_a_full_buffered_layer_says_so():
    layer = _BufferedLayer(capacity=3)
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(RuntimeError, match="3 positions is full"):
        layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
