"""Buddy replication on two CPU ranks (gloo): after N steps each rank's buddy holds exactly that
rank's shard of version N; a rank rebuilt from that copy (a fresh engine + `restore_shard`)
takes step N + 1 to the same weights, bit for bit, as the rank that was never lost; and with
replication off nothing is copied.

One start of the two ranks does all three (a start costs more than the steps): the ranks train
N steps with replication on, record their own state and the copy each holds, take step N + 1
(the uninterrupted run), then build fresh engines with replication off: rank 1, "lost", from
the copy rank 0 held of it, rank 0, a survivor, from its own state after step N.
"""

import os
import threading

import torch
from fsdp_helpers import join_ranks, make_batch, save_tiny_model, start_ranks

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.training.buddy import buddy_of, ward_of
from eddyrl.engines.training.shard_copy import Layout, ShardCopy, shard_state
from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.hal import distributed as hd
from eddyrl.hal import get_platform

WORLD = 2
STEPS = 2  # N
LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
ENGINE_ARGS = dict(lr=1e-3, micro_batch_size=2, seed=0)
ROWS = (slice(0, 2), slice(2, 4))
LOST = 1


def _export(engine):
    return {k: v.clone() for b in engine.export_weights(1 << 30) for k, v in b.items()}


def _buddy_threads() -> int:
    return sum(t.name.startswith("eddy-buddy") for t in threading.enumerate())


def _worker(rank, model_dir, init_file, out_prefix, batch):
    torch.set_num_threads(1)  # two ranks share two cores with everything else
    os.environ["LOCAL_RANK"] = str(rank)
    platform = get_platform("cpu")
    mine = batch.select(ROWS[rank])
    engine = FSDPTrainEngine(model_dir, platform, rank, WORLD, f"file://{init_file}",
                             buddy_replication=True, **ENGINE_ARGS)
    fresh = None
    try:
        for _ in range(STEPS):
            engine.train_step(mine, LOSS)
            engine.snapshot()  # as the trainer rank takes one after each RL step
        engine.buddy.flush()  # the last round has arrived
        own = {k: t.clone() for k, t in shard_state(engine.model, engine.optimizer, platform)}
        held = engine.buddy.restore(ward_of(rank, WORLD), STEPS)
        host_bytes, rounds = engine.buddy.stats.host_bytes, engine.buddy.stats.rounds
        torch.save(held.tensors, f"{out_prefix}.held.{rank}")

        uninterrupted = engine.train_step(mine, LOSS), _export(engine)
        engine.buddy.flush()
        hd.barrier()  # every copy is on disk
        if rank == LOST:  # from what its buddy kept
            tensors = torch.load(f"{out_prefix}.held.{buddy_of(rank, WORLD)}")
            copy = ShardCopy(rank, STEPS, tensors)
        else:  # a survivor: its own state
            copy = ShardCopy(rank, STEPS, own)
        threads_before = _buddy_threads()
        fresh = FSDPTrainEngine(model_dir, platform, rank, WORLD, f"file://{init_file}",
                                buddy_replication=False, **ENGINE_ARGS)
        fresh.restore_shard(copy)
        restored = {k: t.clone() for k, t in shard_state(fresh.model, fresh.optimizer, platform)}
        rebuilt = fresh.train_step(mine, LOSS), _export(fresh)
        torch.save({"own": own, "held": held.tensors, "held_rank": held.rank,
                    "held_version": held.version, "restored": restored,
                    "version": fresh.version - 1, "uninterrupted": uninterrupted,
                    "rebuilt": rebuilt, "off_store": fresh.buddy,
                    "threads": (threads_before, _buddy_threads()),
                    "host_bytes": host_bytes, "rounds": rounds},
                   f"{out_prefix}.{rank}")
    finally:
        if fresh is not None:
            fresh.close()
        engine.close()


def _start_ranks(*args):
    return start_ranks(_worker, __name__, WORLD, *args)


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), \
            f"{what}: {key} differs"


def test_buddy_copies_rebuild_a_lost_rank_bit_for_bit(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "tiny"))
    batch = make_batch(model_dir)
    out = str(tmp_path / "out")
    join_ranks(_start_ranks(model_dir, str(tmp_path / "init"), out, batch), timeout_s=300)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]

    for rank, result in enumerate(ranks):
        keeper = ranks[buddy_of(rank, WORLD)]
        # the buddy holds exactly this rank's shard of version N: weights, moments, step, RNG
        assert keeper["held_rank"] == rank and keeper["held_version"] == STEPS
        _assert_same(keeper["held"], result["own"], f"rank {rank}'s copy")
        kinds = {key.split("/")[0] for key in result["own"]}
        assert kinds == {"param", "optim", "rng"}
        steps = [t for k, t in result["own"].items() if k.endswith("/step")]
        assert steps and all(float(t) == STEPS for t in steps)
        # what it costs: its own staging buffer and its ward's copy, both the layout's size
        assert result["host_bytes"] == Layout.of(list(result["own"].items())).nbytes \
            + Layout.of(list(keeper["own"].items())).nbytes
        assert result["rounds"] == STEPS

    # rebuilt: the lost rank's fresh engine holds exactly its state of version N ...
    lost = ranks[LOST]
    _assert_same(lost["restored"], lost["own"], "the rebuilt rank's state")
    assert lost["version"] == STEPS
    # ... and the next step gives the same metrics and weights, bit for bit
    (want_metrics, want_weights), (got_metrics, got_weights) = \
        ranks[0]["uninterrupted"], ranks[0]["rebuilt"]
    assert got_metrics == want_metrics and ranks[LOST]["rebuilt"][0] == want_metrics
    assert want_weights and got_weights.keys() == want_weights.keys()
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)

    # off: no store, no thread, nothing copied
    for result in ranks:
        assert result["off_store"] is None
        before, after = result["threads"]
        assert after == before
