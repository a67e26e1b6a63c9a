"""The `hf` engine's KV cache: one buffer per layer, grown in doublings up to the batch's longest
sequence.

transformers' `DynamicCache` concatenates every layer's keys and values with the new position at
each decode step, which copies the whole cache every step: measured on the default run (4 layers,
batches of 128, ~46 prompt + up to 54 new tokens, 2 CPU cores), `torch.cat` was a seventh of the
generation time. Here each step writes one position into a buffer and attention reads a view of
the filled part. A buffer starts at the prefill plus `GROWTH` positions and doubles when full,
never past `capacity` (prompt + the longest row's new tokens): a few copies per call instead of
one per step, and no memory for 4,096 new tokens of every row before any row needs them.
Selecting rows (dropping finished ones, or expanding one shared prompt's prefill to its samples)
copies the filled part once.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


GROWTH = 64  # positions a buffer holds past its prefill at first


class _BufferedLayer(DynamicLayer):
    """One attention layer's keys and values, [batch, heads, positions, head_dim], in buffers
    of at most `capacity` positions; `keys` / `values` are views of the first `length`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full: the batch needs "
                               f"{end} (the engine sizes it for the longest sequence)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._empty(key_states, min(self.capacity, end + GROWTH))
            self._value_buffer = self._empty(value_states, min(self.capacity, end + GROWTH))
        elif end > self._key_buffer.shape[2]:
            size = min(self.capacity, max(end, 2 * self._key_buffer.shape[2]))
            self._key_buffer = self._grown(self._key_buffer, size)
            self._value_buffer = self._grown(self._value_buffer, size)
        self._key_buffer[:, :, self.length:end] = key_states
        self._value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    @staticmethod
    def _empty(like: torch.Tensor, positions: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return like.new_empty(batch, heads, positions, dim)

    def _grown(self, buffer: torch.Tensor, positions: int) -> torch.Tensor:
        new = self._empty(buffer, positions)
        new[:, :, :self.length] = buffer[:, :, :self.length]
        return new

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
    """A cache whose layers hold at most `capacity` positions each (prompt + new tokens of the
    longest row): the model creates one layer per attention layer at its first forward."""
    return Cache(layer_class_to_replicate=lambda: _BufferedLayer(capacity))
