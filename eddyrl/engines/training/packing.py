"""A training step's micro-batches, and the forward pass that gives their log-probs.

Rows of like length go together and each micro-batch is cut after its longest row: rows are
right-padded and under causal attention a real token never sees a later position, so the cut
drops only work on padding (measured on the default run's batches: the cut micro-batches hold
0.53-0.75 of the padded ones' positions).

Rows of one prompt (a GRPO group's n samples) also share the prompt's forward pass: a micro-batch
packs each distinct prompt once, followed by the responses of its rows, into one sequence. Each
response attends to the prompt and causally to itself, never to its siblings, and its positions
continue from the prompt's, so every token sees exactly the tokens it sees in its own row: the
log-probs and gradients are the row layout's up to float summation order
(tests/engines/test_packing.py pins them to it). On the default run a prompt is ~3/4 of each
row's tokens, so this cuts the forward and backward to about 2/5. It needs an attention that
takes a custom 4D mask (transformers' `sdpa` and `eager`); other implementations, and rows
without a shared prompt, run in the row layout.

The mask is dense: [S, S] per packed sequence. That is what `sdpa` builds for a padded batch
anyway, but for long responses (thousands of tokens times n samples) a packed sequence's mask
and attention scores grow with the square of the whole group: `max_packed_tokens` bounds a
packed sequence, and a prompt group longer than that is split into smaller packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...protocol import TrainBatch

# the attention implementations of transformers that take a custom 4D mask as given
CUSTOM_MASK_ATTENTION = ("sdpa", "eager")


@dataclass(slots=True)
class Packed:
    """The shared-prompt layout of one micro-batch's forward pass."""

    input_ids: torch.Tensor  # [U, S] one row per pack: a prompt, then its rows' responses
    position_ids: torch.Tensor  # [U, S] each response continues from its prompt's positions
    segments: torch.Tensor  # [U, S] 0 the prompt, k the k-th response, -1 padding
    source: torch.Tensor  # [b, w] flat index into [U * S] of the logits predicting that token

    def to(self, device: torch.device) -> "Packed":
        return Packed(*(t.to(device) for t in (self.input_ids, self.position_ids,
                                                self.segments, self.source)))

    def attention_mask(self, dtype: torch.dtype | None) -> torch.Tensor:
        """[U, 1, S, S]: a position sees the earlier positions of its prompt and of its own
        segment. Padding sees only itself (a query that sees nothing gives NaN, and NaN times
        a zero gradient is still NaN). `dtype` None: bool (sdpa), else additive (eager)."""
        seg = self.segments
        size = seg.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool, device=seg.device).tril()
        key, query = seg[:, None, :], seg[:, :, None]
        allowed = causal & (((key == 0) & (query >= 0)) | (key == query))
        allowed |= torch.eye(size, dtype=torch.bool, device=seg.device)
        allowed = allowed[:, None]
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)


@dataclass(slots=True)
class MicroBatch:
    rows: torch.Tensor | None  # its rows' indices in the step's batch; None: padding
    batch: TrainBatch  # those rows in the row layout, cut after the longest: what the loss reads
    packed: Packed | None = None  # None: the forward runs on `batch` as it is

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(self.rows, self.batch.to(device),
                          None if self.packed is None else self.packed.to(device))


def row_ends(batch: TrainBatch) -> torch.Tensor:
    """One past each row's last real position (0 for a row without any)."""
    mask = batch.attention_mask.bool()
    return torch.where(mask.any(1), mask.shape[1] - mask.flip(1).int().argmax(1), 0)


def micro_batches(batch: TrainBatch, size: int, *, share_prompts: bool = False,
                  max_packed_tokens: int = 8192) -> list[MicroBatch]:
    """`batch`'s rows in micro-batches of at most `size` rows, rows of like length together,
    each cut after its longest row's last real token. `share_prompts` (and the batch knows its
    rows' prompt lengths): the rows of one prompt stay in one micro-batch, whose forward packs
    the prompt once (module docstring); a pack holds at most `max_packed_tokens`."""
    if len(batch) == 0:
        return []
    ends = row_ends(batch)
    if not share_prompts or batch.prompt_lengths is None:
        order = torch.argsort(ends, stable=True)
        return [_micro(batch, order[start:start + size], ends)
                for start in range(0, len(batch), size)]
    units = _prompt_units(batch, ends, size, max_packed_tokens)
    units.sort(key=lambda unit: int(ends[unit].max()))  # like lengths together
    groups: list[list[list[int]]] = [[]]
    for unit in units:
        if groups[-1] and sum(map(len, groups[-1])) + len(unit) > size:
            groups.append([])
        groups[-1].append(unit)
    return [_micro(batch, torch.tensor([i for unit in group for i in unit]), ends,
                   units=[len(unit) for unit in group]) for group in groups]


def _micro(batch: TrainBatch, rows: torch.Tensor, ends: torch.Tensor, *,
           units: list[int] | None = None) -> MicroBatch:
    """The micro-batch of `rows`; `units`: the sizes of its runs of rows that share a prompt,
    in order (None: the row layout)."""
    width = max(int(ends[rows].max()), 1)
    micro = batch.select(rows).select_columns(width)
    packed = None
    if units is not None and len(units) < len(rows):
        packed = _pack(micro, ends[rows], units)
    return MicroBatch(rows, micro, packed)


def _prompt_units(batch: TrainBatch, ends: torch.Tensor, size: int, max_tokens: int
                  ) -> list[list[int]]:
    """Rows with the same prompt (same length, same tokens), in runs of at most `size` rows and
    `max_tokens` packed tokens; a row without a usable prompt length is a unit of its own."""
    by_prompt: dict[tuple, list[int]] = {}
    for i, (p, end) in enumerate(zip(batch.prompt_lengths.tolist(), ends.tolist())):
        key = (p, tuple(batch.input_ids[i, :p].tolist())) if 0 < p < end else ("row", i)
        by_prompt.setdefault(key, []).append(i)
    units = []
    for key, rows in by_prompt.items():
        prompt = key[0] if key[0] != "row" else 0
        unit, tokens = [], prompt
        for i in rows:
            response = int(ends[i]) - prompt
            if unit and (len(unit) == size or tokens + response > max_tokens):
                units.append(unit)
                unit, tokens = [], prompt
            unit.append(i)
            tokens += response
        units.append(unit)
    return units


def _pack(micro: TrainBatch, ends: torch.Tensor, units: list[int]) -> Packed:
    """The packed layout of `micro`'s rows: each run of `units` rows shares its first row's
    prompt (a run of one row is that row as it is)."""
    ids, prompts = micro.input_ids, micro.prompt_lengths.tolist()
    packs, start = [], 0  # (shared prompt length, rows)
    for count in units:
        rows = list(range(start, start + count))
        start += count
        p = prompts[rows[0]] if count > 1 else int(ends[rows[0]])
        packs.append((p, rows))
    width = max(p + sum(int(ends[i]) - p for i in rows) for p, rows in packs)
    input_ids = torch.zeros(len(packs), width, dtype=torch.long)
    positions = torch.zeros(len(packs), width, dtype=torch.long)
    segments = torch.full((len(packs), width), -1, dtype=torch.long)
    source = torch.full(ids.shape, -1, dtype=torch.long)
    for u, (p, rows) in enumerate(packs):
        base = u * width
        input_ids[u, :p] = ids[rows[0], :p]
        positions[u, :p] = torch.arange(p)
        segments[u, :p] = 0
        at = p
        for k, i in enumerate(rows, start=1):
            end = int(ends[i])
            # token t of row i is predicted at the position of token t - 1: in the prompt for
            # t <= p, in the row's own response after
            shared = min(p, end - 1)
            source[i, 1:shared + 1] = base + torch.arange(shared)
            n = end - p
            if n > 0:
                input_ids[u, at:at + n] = ids[i, p:end]
                positions[u, at:at + n] = torch.arange(p, end)
                segments[u, at:at + n] = k
                source[i, p + 1:end] = base + at + torch.arange(n - 1)
                at += n
    return Packed(input_ids, positions, segments, source)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, L] log p(input_ids[t] | input_ids[:t]) at `temperature`; position 0 gets 0. The
    row layout: the straightforward forward that the packed one is pinned to."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    token_logp = _scaled(logits[:, :-1], temperature).gather(
        -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (1, 0))


def micro_logprobs(model: torch.nn.Module, micro: MicroBatch, temperature: float
                   ) -> torch.Tensor:
    """[b, w] log-probs of `micro`'s rows in the row layout, whichever layout the forward
    ran in; the same function for every engine that trains, so a joined replica's gradients
    are the core ranks' exactly."""
    rows = micro.batch
    if micro.packed is None:
        return token_logprobs(model, rows.input_ids, rows.attention_mask, temperature)
    packed = micro.packed
    implementation = getattr(model.config, "_attn_implementation", None)
    mask = packed.attention_mask(None if implementation == "sdpa" else torch.float32)
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                   attention_mask=mask, use_cache=False).logits
    logp = _scaled(logits, temperature).flatten(0, 1)  # [U * S, V]
    source = packed.source
    values = logp[source.clamp(min=0), rows.input_ids]
    return torch.where(source >= 0, values, 0.0)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # Divided by the temperature first, because the sampler reports log-probs of the
    # temperature-scaled distribution. Simplified: the full fp32 log-softmax; a chunked one
    # would save memory at large vocabularies.
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def packs_prompts(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes the packed layout's custom 4D mask."""
    return getattr(model.config, "_attn_implementation", None) in CUSTOM_MASK_ATTENTION


def place_rows(out: torch.Tensor, rows: torch.Tensor, micro: TrainBatch,
               values: torch.Tensor) -> None:
    """Write a micro-batch's [b, w] log-probs into rows `rows`, positions 0..w-1, of `out`,
    0 on padding (what a padded position's log-prob would be is meaningless, and differs with
    the cut)."""
    real = micro.attention_mask.to(values.device).bool()
    out[rows, :values.shape[1]] = torch.where(real, values, 0.0).to(out.device, out.dtype)
