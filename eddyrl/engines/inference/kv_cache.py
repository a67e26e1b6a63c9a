"""The `hf` engine's KV cache: one buffer per layer, sized once for the batch's longest sequence.

transformers' `DynamicCache` concatenates every layer's keys and values with the new position at
each decode step, which copies the whole cache every step: measured on the default run (4 layers,
batches of 128, ~46 prompt + up to 54 new tokens, 2 CPU cores), `torch.cat` was a seventh of the
generation time. Here each step writes one position into a buffer allocated at prefill for
`capacity` positions, and attention reads a view of the filled part. Selecting rows (dropping
finished ones, or expanding one shared prompt's prefill to its samples) copies the filled part
once.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _BufferedLayer(DynamicLayer):
    """One attention layer's keys and values, [batch, heads, positions, head_dim], in buffers
    of `capacity` positions; `keys` / `values` are views of the first `length`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            batch, heads, _, dim = key_states.shape
            self._key_buffer = key_states.new_empty(batch, heads, self.capacity, dim)
            self._value_buffer = value_states.new_empty(
                batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full: the batch needs "
                               f"{end} (the engine sizes it for the longest sequence)")
        self._key_buffer[:, :, self.length:end] = key_states
        self._value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or repeat) the rows `indices`, in that order."""
        if not self.length:
            return
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(len(indices), *old.shape[1:])
            new[:, :, :self.length] = old[:, :, :self.length].index_select(0, indices)
            setattr(self, name, new)
        self.keys = self._key_buffer[:, :, :self.length]
        self.values = self._value_buffer[:, :, :self.length]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the engine never crops its cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the engine expands rows with batch_select_indices")


def buffered_cache(capacity: int) -> Cache:
    """A cache whose layers hold `capacity` positions each (prompt + new tokens of the longest
    row): the model creates one layer per attention layer at its first forward."""
    return Cache(layer_class_to_replicate=lambda: _BufferedLayer(capacity))
