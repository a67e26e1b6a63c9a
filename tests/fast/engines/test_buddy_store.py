"""Buddy replication's pure logic (engines/training/buddy.py, shard_copy.py): the ring, the
flat layout, and the store's bookkeeping (version stamps, the copy kept while the live state
moves on, one round at a time, restore's refusals) over an in-process transport."""

import threading

import pytest
import torch

from eddyrl.engines.training.buddy import BuddyStore, buddy_of, ward_of
from eddyrl.engines.training.shard_copy import ALIGN, Layout
from eddyrl.errors import EddyError
from eddyrl.hal import get_platform


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_ring_keeps_each_copy_once_never_on_its_own_rank(world):
    keepers = [buddy_of(rank, world) for rank in range(world)]
    assert sorted(keepers) == list(range(world))  # each rank keeps exactly one copy
    for rank in range(world):
        assert keepers[rank] != rank
        assert ward_of(keepers[rank], world) == rank


def test_one_rank_has_no_buddy():
    assert buddy_of(0, 1) is None and ward_of(0, 1) is None
    with pytest.raises(ValueError, match="2 or more ranks"):
        BuddyStore(0, 1, get_platform("cpu"), collect=list, connect=lambda: None)


def _mixed() -> list[tuple[str, torch.Tensor]]:
    return [("param/a", torch.arange(7, dtype=torch.float32)),
            ("optim/a/step", torch.tensor(3.0)),  # 0-dim, like AdamW's step
            ("param/empty", torch.zeros(0, 5)),  # a rank's empty shard
            ("param/half", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)),
            ("rng/cpu", torch.arange(5, dtype=torch.uint8))]


def test_the_layout_round_trips_every_dtype_and_shape():
    named = _mixed()
    layout = Layout.of(named)
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    assert layout.nbytes >= sum(t.numel() * t.element_size() for _, t in named)
    assert Layout.from_bytes(layout.to_bytes()) == layout
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    for key, tensor in named:
        views[key].copy_(tensor)
    for key, tensor in named:  # read back through a fresh set of views of the same bytes
        got = layout.views(buffer.clone())[key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    with pytest.raises(ValueError, match="bytes for a layout"):
        layout.views(torch.zeros(layout.nbytes - 1, dtype=torch.uint8))


class Mirror:
    """A ring of two where the ward's state is this rank's: what is sent comes back. Round
    `gate_version` waits for `gate` to be set."""

    def __init__(self, gate_version: int | None = None) -> None:
        self.completed: list[int] = []
        self.gate, self.gate_version = threading.Event(), gate_version

    def exchange(self, version, layout, data):
        if version == self.gate_version:
            self.gate.wait()
        self.completed.append(version)
        return version, layout, data.clone()

    def close(self) -> None:
        pass


def _store(live: dict, transport: Mirror) -> BuddyStore:
    return BuddyStore(1, 2, get_platform("cpu"), collect=lambda: list(live.items()),
                      connect=lambda: transport)


def test_the_copy_is_the_state_at_its_version_stamp():
    live = {"param/w": torch.zeros(4), "optim/w/step": torch.tensor(0.0)}
    store = _store(live, Mirror())
    try:
        assert store.held_version is None
        for version in (1, 2):
            live["param/w"] += 1  # the optimizer step
            live["optim/w/step"] += 1
            store.replicate(version)
        store.flush()
        live["param/w"] += 100  # the next step moves on; the copy stays at version 2
        copy = store.restore(lost_rank=0, version=2)
        assert (copy.rank, copy.version, store.held_version) == (0, 2, 2)
        assert torch.equal(copy.tensors["param/w"], torch.full((4,), 2.0))
        assert float(copy.tensors["optim/w/step"]) == 2.0
        assert store.stats.rounds == 2
        assert store.stats.host_bytes == 2 * Layout.of(list(live.items())).nbytes
    finally:
        store.close()


def test_restore_refuses_what_it_does_not_hold():
    live = {"param/w": torch.ones(2)}
    store = _store(live, Mirror())
    try:
        with pytest.raises(EddyError, match="holds no complete copy of rank 0"):
            store.restore(0, 1)
        store.replicate(1)
        store.flush()
        with pytest.raises(EddyError, match="keeps the copy of rank 0, not of rank 1"):
            store.restore(1, 1)
        with pytest.raises(EddyError, match="copy of version 1, not 2"):
            store.restore(0, 2)
    finally:
        store.close()


def test_a_round_starts_only_after_the_previous_one_completed():
    """Round 1's transfer is held back until round 2's collection starts or a second
    passes: a store that started round 2 early would collect with round 1 unfinished."""
    live = {"param/w": torch.ones(2)}
    transport = Mirror(gate_version=1)
    seen: list[list[int]] = []
    second_round = threading.Event()

    def collect():
        seen.append(list(transport.completed))
        if len(seen) == 2:
            second_round.set()
        return list(live.items())

    store = BuddyStore(1, 2, get_platform("cpu"), collect=collect, connect=lambda: transport)
    release = threading.Thread(target=lambda: (second_round.wait(1.0), transport.gate.set()))
    release.start()
    try:
        store.replicate(1)
        assert store.held_version is None  # on its way
        store.replicate(2)
        store.flush()
    finally:
        release.join()
        store.close()
    assert seen == [[], [1]]
    assert transport.completed == [1, 2] and store.held_version == 2


def test_a_failed_transfer_is_raised_at_the_next_round_naming_the_peers():
    class Broken(Mirror):
        def exchange(self, version, layout, data):
            raise ConnectionError("peer closed")

    store = _store({"param/w": torch.ones(2)}, Broken())
    store.replicate(1)
    with pytest.raises(EddyError, match="from rank 1 to rank 0 .* ConnectionError: peer closed"):
        store.replicate(2)
    store.close()


def test_the_config_key_reaches_the_engine_and_refuses_a_non_bool():
    from eddyrl.config import load_config

    assert load_config(None, []).train.engine_options()["buddy_replication"] is True
    off = load_config(None, ["train.buddy_replication=false"]).train
    assert off.engine_options()["buddy_replication"] is False
    with pytest.raises(EddyError, match="config key 'train.buddy_replication' .* not a valid bool"):
        load_config(None, ["train.buddy_replication=maybe"])
