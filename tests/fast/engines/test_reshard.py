"""A rebuilt trainer's shards cut from the old world's copies (shard_copy.reshard): for every
old and new world size, each new rank's chunk of every tensor is exactly FSDP2's chunk of the
whole (torch.chunk along dim 0, short or empty last chunks); in the old world's size each
rank's copy comes back as it was, the same tensor, never sliced; scalars and generators come
from the rank named; only the copies a rank's rows overlap are fetched."""

import pytest
import torch

from eddyrl.engines.training.shard_copy import (ShardCopy, reshard, rows_of, shapes_of)
from eddyrl.errors import EddyError

ROWS = {"param/w": (7, 3), "param/b": (5,), "param/tiny": (1, 4),
        "optim/param.w/exp_avg": (7, 3)}


def _whole(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=g) for key, shape in ROWS.items()}


def _chunk(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(tensor, world, dim=0)  # FSDP2's: the last ones short, or none at all
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def _copies(whole: dict[str, torch.Tensor], world: int, version: int = 5) -> list[ShardCopy]:
    return [ShardCopy(rank, version, {
        **{key: _chunk(t, rank, world).clone() for key, t in whole.items()},
        "optim/param.w/step": torch.tensor(float(version)),
        "rng/cpu": torch.full((4,), rank, dtype=torch.uint8)}) for rank in range(world)]


@pytest.mark.parametrize("rows,world", [(7, 2), (7, 3), (5, 4), (1, 4), (0, 2), (8, 8)])
def test_rows_of_is_torch_chunk(rows, world):
    whole = torch.arange(rows)
    for rank in range(world):
        start, end = rows_of(rank, world, rows)
        assert torch.equal(whole[start:end], _chunk(whole, rank, world))


@pytest.mark.parametrize("old,new", [(2, 1), (3, 2), (4, 3), (4, 1), (2, 3), (5, 4)])
def test_each_new_rank_gets_fsdp2s_chunk_of_the_whole(old, new):
    whole = _whole()
    copies = _copies(whole, old)
    for rank in range(new):
        copy = reshard([shapes_of(c) for c in copies], lambda i: copies[i], new, rank,
                       rng_from=min(rank, old - 1), version=5)
        assert copy.rank == rank and copy.version == 5
        for key, tensor in whole.items():
            assert torch.equal(copy.tensors[key], _chunk(tensor, rank, new)), (key, rank)
        assert copy.tensors["optim/param.w/step"].item() == 5.0
        assert torch.equal(copy.tensors["rng/cpu"],
                           torch.full((4,), min(rank, old - 1), dtype=torch.uint8))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_same_world_gives_each_rank_its_own_copy_unsliced(world):
    copies = _copies(_whole(1), world)
    for rank in range(world):
        fetched = []
        copy = reshard([shapes_of(c) for c in copies],
                       lambda i: fetched.append(i) or copies[i], world, rank, rank, 5)
        assert fetched == [rank]  # no other rank's copy crosses the network
        for key, tensor in copies[rank].tensors.items():
            assert copy.tensors[key] is tensor or torch.equal(copy.tensors[key], tensor)
            if tensor.numel():
                assert copy.tensors[key].data_ptr() == tensor.data_ptr(), key


def test_a_shrunk_rank_fetches_only_the_copies_it_overlaps():
    copies = _copies(_whole(), 4)  # 7 rows: chunks of 2, 2, 2, 1 -> 3 ranks: 3, 3, 1
    fetched: list[int] = []
    reshard([shapes_of(c) for c in copies], lambda i: fetched.append(i) or copies[i], 3, 2,
            rng_from=2, version=5)
    assert set(fetched) == {2, 3}  # rows 6.. of w (old rank 3), b's 4.. (old rank 2)


def test_a_copy_of_another_version_or_other_tensors_is_refused():
    copies = _copies(_whole(), 2)
    stale = ShardCopy(1, 4, copies[1].tensors)
    with pytest.raises(EddyError, match="old rank 1's copy is of version 4, not 5"):
        reshard([shapes_of(c) for c in copies], [copies[0], stale].__getitem__, 1, 0, 0, 5)
    other = ShardCopy(1, 5, {k: v for k, v in copies[1].tensors.items() if k != "param/b"})
    with pytest.raises(EddyError, match="other tensors than old rank 0's: \\['param/b'\\]"):
        reshard([shapes_of(copies[0]), shapes_of(other)], [copies[0], other].__getitem__,
                1, 0, 0, 5)
