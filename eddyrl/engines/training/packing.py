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
(tests/integration/engines/test_packing_on_model.py pins them to it). On the default run a prompt is ~3/4 of each
row's tokens, so this cuts the forward and backward to about 2/5. It needs an attention that
takes a custom 4D mask (transformers' `sdpa` and `eager`); other implementations, and rows
without a shared prompt, run in the row layout.

The mask is dense: [S, S] per packed sequence. That is what `sdpa` builds for a padded batch
anyway, but for long responses (thousands of tokens times n samples) a packed sequence's mask
and attention scores grow with the square of the whole group: `max_packed_tokens` bounds a
packed sequence, and a prompt group longer than that is split into smaller packs.

Where the platform has a variable-length attention (attention.py chooses, by
`train.attention`), the varlen layout replaces both: a micro-batch's rows, real tokens only,
end to end in one sequence of at most `max_packed_tokens`, positions restarting at 0 at each
row and no mask; the kernel finds the rows from the positions. No padding and nothing [S, S],
but each row carries its own prompt: a response must see its prompt and not its siblings,
which independent sequences cannot say. Every layout gives (input_ids, position_ids, a mask or
None, source), and `source` gathers the log-probs back into the row layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ...protocol import TrainBatch
from .logprob import PolicyForward, TokenLogProbs, as_policy

# the attention implementations of transformers that take a custom 4D mask as given
CUSTOM_MASK_ATTENTION = ("sdpa", "eager")


@dataclass(slots=True)
class Packed:
    """A packed layout of one micro-batch's forward pass: the shared-prompt one (a dense mask
    from `segments`) or the varlen one (`segments` None: no mask, the rows told apart by their
    positions restarting at 0)."""

    input_ids: torch.Tensor  # [U, S] one row per pack: a prompt, then its rows' responses
    position_ids: torch.Tensor  # [U, S] each response continues from its prompt's positions
    # [U, S] 0 the prompt, k the k-th response, -1 padding; None: the varlen layout (U = 1)
    segments: torch.Tensor | None
    source: torch.Tensor  # [b, w] flat index into [U * S] of the logits predicting that token

    def to(self, device: torch.device) -> "Packed":
        return Packed(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.position_ids, self.segments, self.source)))

    def attention_mask(self, dtype: torch.dtype | None) -> torch.Tensor | None:
        """[U, 1, S, S]: a position sees the earlier positions of its prompt and of its own
        segment. Padding sees only itself (a query that sees nothing gives NaN, and NaN times
        a zero gradient is still NaN). `dtype` None: bool (sdpa), else additive (eager).
        None for the varlen layout: the attention reads the rows from `position_ids`."""
        seg = self.segments
        if seg is None:
            return None
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
                  varlen: bool = False, max_packed_tokens: int = 8192,
                  max_tokens: int = 0) -> list[MicroBatch]:
    """`batch`'s rows in micro-batches of at most `size` rows, rows of like length together,
    each cut after its longest row's last real token. `max_tokens` > 0: also at most that many
    tokens in each micro-batch's forward, padding included (`_fill`); a row longer than that
    alone. `share_prompts` (and the batch knows its
    rows' prompt lengths): the rows of one prompt stay in one micro-batch, whose forward packs
    the prompt once (module docstring); a pack holds at most `max_packed_tokens`. `varlen`
    (instead): each micro-batch's forward is its rows end to end in one sequence of at most
    `max_packed_tokens` (a longer row alone), with no mask (`_pack_rows`)."""
    if len(batch) == 0:
        return []
    ends = row_ends(batch)
    pack_bound = min(max_packed_tokens, max_tokens) if max_tokens else max_packed_tokens
    if varlen:  # its forward runs the rows' real tokens end to end: the pack bound is the budget
        return _varlen_micro_batches(batch, ends, size, pack_bound)
    if not share_prompts or batch.prompt_lengths is None:
        order = torch.argsort(ends, stable=True).tolist()
        groups = _fill([[i] for i in order], [int(ends[i]) for i in order], size, max_tokens)
        return [_micro(batch, torch.tensor([i for (i,) in group]), ends) for group in groups]
    units = _prompt_units(batch, ends, size, pack_bound)
    units.sort(key=lambda unit: int(ends[unit].max()))  # like lengths together
    lengths = [_pack_length(unit, batch.prompt_lengths, ends) for unit in units]
    return [_micro(batch, torch.tensor([i for unit in group for i in unit]), ends,
                   units=[len(unit) for unit in group])
            for group in _fill(units, lengths, size, max_tokens)]


def _fill(units: list[list[int]], lengths: list[int], size: int, max_tokens: int
          ) -> list[list[list[int]]]:
    """`units` (runs of rows that go together), in order, into consecutive groups of at most
    `size` rows and, with `max_tokens` > 0, at most `max_tokens` tokens in the forward: a
    padded layout runs every unit (a row, or a pack) at the longest one's length, so a group
    costs units x its longest. A unit longer than the budget alone: a row cannot be split
    under causal attention."""
    groups: list[list[list[int]]] = []
    rows = longest = 0
    for unit, length in zip(units, lengths):
        if max_tokens and length > max_tokens:
            warnings.warn(f"train.max_tokens_per_micro_batch = {max_tokens}: a longer row (or "
                          "pack) runs alone in a micro-batch over the budget; a row cannot be "
                          "split", RuntimeWarning, stacklevel=3)
        if groups and (rows + len(unit) <= size and not (
                max_tokens and (len(groups[-1]) + 1) * max(longest, length) > max_tokens)):
            groups[-1].append(unit)
            rows, longest = rows + len(unit), max(longest, length)
        else:
            groups.append([unit])
            rows, longest = len(unit), length
    return groups


def _pack_length(unit: list[int], prompt_lengths: torch.Tensor, ends: torch.Tensor) -> int:
    """The length of a unit's pack: its prompt once, then each row's response (`_pack`); a
    unit of one row is that row."""
    if len(unit) == 1:
        return int(ends[unit[0]])
    prompt = int(prompt_lengths[unit[0]])
    return prompt + sum(int(ends[i]) - prompt for i in unit)


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


def _varlen_micro_batches(batch: TrainBatch, ends: torch.Tensor, size: int, max_tokens: int
                          ) -> list[MicroBatch]:
    """Rows by length into micro-batches of at most `size` rows and `max_tokens` real tokens,
    each in the varlen layout."""
    groups: list[list[int]] = [[]]
    tokens = 0
    for i in torch.argsort(ends, stable=True).tolist():
        n = int(ends[i])
        if groups[-1] and (len(groups[-1]) == size or tokens + n > max_tokens):
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    out = []
    for group in groups:
        rows = torch.tensor(group)
        micro = _micro(batch, rows, ends)
        out.append(MicroBatch(rows, micro.batch, _pack_rows(micro.batch, ends[rows])))
    return out


def _pack_rows(micro: TrainBatch, ends: torch.Tensor) -> Packed:
    """The varlen layout of `micro`'s rows: their real tokens end to end in one sequence
    [1, T], each row's positions from 0 and no mask, so a variable-length attention (or
    transformers' mask builder, which reads the same restarts) keeps every row to itself:
    each token sees exactly what it sees in its own row. A row with no tokens takes no
    place; a micro-batch of such rows runs one padding position."""
    lengths = ends.tolist()
    total = max(sum(lengths), 1)
    input_ids = torch.zeros(1, total, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    source = torch.full(micro.input_ids.shape, -1, dtype=torch.long)
    at = 0
    for i, end in enumerate(lengths):
        if end == 0:
            continue
        input_ids[0, at:at + end] = micro.input_ids[i, :end]
        positions[0, at:at + end] = torch.arange(end)
        source[i, 1:end] = at + torch.arange(end - 1)  # token t is predicted at t - 1
        at += end
    return Packed(input_ids, positions, None, source)


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
                   attention_mask: torch.Tensor, temperature: float, chunk_tokens: int = 0
                   ) -> torch.Tensor:
    """[B, L] log p(input_ids[t] | input_ids[:t]) at `temperature`; position 0 and padding
    get 0. The row layout, through the chunked head (logprob.py)."""
    return _at_sources(as_policy(model), {"attention_mask": attention_mask}, input_ids,
                       row_sources(attention_mask), input_ids, temperature,
                       chunk_tokens).logprobs


def micro_logprobs(model: torch.nn.Module, micro: MicroBatch, temperature: float,
                   chunk_tokens: int = 0) -> TokenLogProbs:
    """[b, w] log-probs and entropies of `micro`'s rows in the row layout, whichever layout
    the forward ran in; the same function for every engine that trains, so a joined replica's
    gradients are the core ranks' exactly. `model`: a `PolicyForward` (what FSDP shards as its
    root) or a plain causal LM; `chunk_tokens`: tokens per chunk through the LM head (0: all)."""
    policy, rows = as_policy(model), micro.batch
    if micro.packed is None:
        return _at_sources(policy, {"attention_mask": rows.attention_mask}, rows.input_ids,
                           row_sources(rows.attention_mask), rows.input_ids, temperature,
                           chunk_tokens)
    packed = micro.packed
    implementation = getattr(policy.model.config, "_attn_implementation", None)
    mask = packed.attention_mask(None if implementation == "sdpa" else torch.float32)
    return _at_sources(policy, {"attention_mask": mask, "position_ids": packed.position_ids},
                       packed.input_ids, packed.source, rows.input_ids, temperature,
                       chunk_tokens)


def row_sources(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L]: the flat index into [B * L] of the position predicting each real token (the one
    before it), -1 for position 0 and padding: the row layout's `Packed.source`."""
    rows, width = attention_mask.shape
    index = torch.arange(rows * width, device=attention_mask.device).view(rows, width) - 1
    index[:, 0] = -1
    return torch.where(attention_mask.bool(), index, -1)


def _at_sources(policy: PolicyForward, inputs: dict, input_ids: torch.Tensor,
                source: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_tokens: int) -> TokenLogProbs:
    """Log-probs and entropies of `targets` [b, w] predicted at `source` [b, w] (flat indices
    into `input_ids`, -1: none, 0 there). Only those positions go through the LM head."""
    wanted = source >= 0
    got = policy(input_ids, source[wanted], targets[wanted], temperature, chunk_tokens,
                 **inputs)
    return TokenLogProbs(*(torch.zeros(source.shape, dtype=v.dtype, device=v.device)
                           .index_put((wanted,), v) for v in got))


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
