"""When a lost trainer rank can be rebuilt in place (runtime/ray/trainer_rebuild.py): the
settings that rule it out, each named; and the copies, which must all be of the version the
trainer's last completed call left (the survivors' own, and the lost rank's on its buddy,
rank + 1), never of a later one (the interrupted step would be trained twice)."""

from types import SimpleNamespace

import pytest

from eddyrl.runtime.rank_rebuild import CopyInfo
from eddyrl.runtime.ray.trainer_rebuild import common_version, why_not_in_place
from eddyrl.runtime_protocol import ACTOR_DIED, TrainerRankLost

SHAPES = {"param/w": (2, 3)}


def _info(rank, own, ward=None, ward_version=None):
    return CopyInfo(rank, own, SHAPES if own is not None else None, ward, ward_version,
                    SHAPES if ward is not None else None)


def test_all_copies_at_the_last_completed_version_are_the_common_version():
    # world 3, rank 1 lost: its copy is on rank 2 (the engines' own versions are not asked:
    # inside the interrupted step they may be past the copies)
    infos = {0: _info(0, 7, ward=2, ward_version=7), 2: _info(2, 7, ward=1, ward_version=7)}
    assert common_version(1, 3, infos, 7) == (7, "")


@pytest.mark.parametrize("infos,why", [
    ({0: _info(0, 8, 2, 7), 2: _info(2, 8, 1, 8)},
     "trainer rank 0's last copy is of version 8, the trainer's last completed step left "
     "version 7: the interrupted step had finished on it"),
    ({0: _info(0, 7, 2, 7), 2: _info(2, 7, 1, None)},
     "trainer rank 2 keeps rank 1's copy and holds none, not version 7"),
    ({0: _info(0, 7, 2, 7), 2: _info(2, 7, 1, 6)},
     "holds version 6, not version 7"),
    ({0: _info(0, None), 2: _info(2, None)},
     "trainer rank 0 holds no copy of its state"),
])
def test_copies_of_another_version_rule_out_the_rebuild_saying_which(infos, why):
    version, reason = common_version(1, 3, infos, 7)
    assert version == -1 and why in reason


def _runtime(ranks=2, colocated=False, **train):
    train = SimpleNamespace(**{"on_rank_loss": "replace", "buddy_replication": True, **train})
    return SimpleNamespace(trainers=[object()] * ranks, colocated=colocated,
                           settings=SimpleNamespace(trainer=SimpleNamespace(train=train)))


@pytest.mark.parametrize("runtime,why", [
    (_runtime(on_rank_loss="stop"), "train.on_rank_loss = stop"),
    (_runtime(ranks=1), "it was the only trainer rank"),
    (_runtime(colocated=True), ""),  # the engines sleep; the replacement takes the device
    # without copies the rollout's weights and a checkpoint stand in (published_rebuild.py)
    (_runtime(buddy_replication=False), ""),
    (_runtime(), ""), (_runtime(on_rank_loss="shrink"), "")])
def test_the_settings_that_rule_out_a_rebuild_are_named(runtime, why):
    lost = TrainerRankLost(1, "train_step", ACTOR_DIED)
    reason = why_not_in_place(runtime, lost)
    assert (why in reason) if why else reason == ""
    if why:
        assert str(lost.not_recovered(reason)).endswith(f"the run cannot go on without it "
                                                        f"({reason})")
