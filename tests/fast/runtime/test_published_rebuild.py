"""Where a trainer rebuilt without buddy copies takes its state (runtime/ray/published_rebuild.py):
the first live rollout worker holding the trainer's version (no other version will do, and each
refusal is named), and the newest verified checkpoint no later than that version (a newer one,
a corrupt one or one without trainer state passed over; none: a fresh optimizer). The rebuild
itself, end to end: tests/faults/test_trainer_rank_loss.py."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eddyrl import checkpoints
from eddyrl.runtime.ray import published_rebuild
from eddyrl.runtime_protocol import ACTOR_DIED, TrainerRankLost


def _checkpoint(root, step, version):
    async def fill(tmp):
        tmp.mkdir()
        save_file({"w": torch.full((4,), float(step))}, str(tmp / "model.safetensors"))
        (tmp / "eddy_train_state.json").write_text(f'{{"version": {version}}}')
    return asyncio.run(checkpoints.write(root, step, fill))


class _Worker:
    """A rollout worker's actor: `held_weights.options(num_returns=2).remote()` gives
    (its version or the error it raises, its weights)."""

    def __init__(self, held):
        self.held = held
        self.held_weights = SimpleNamespace(options=lambda num_returns: SimpleNamespace(
            remote=lambda: (self.held, f"weights of {self.held}")))


class _Calls:
    async def call(self, who, what, ref):
        if isinstance(ref, Exception):
            raise ref
        return ref


def _runtime(tmp_path, held, lost=(), lora=0, publishing=(5, 5)):
    workers = [_Worker(h) for h in held]
    actors = SimpleNamespace(live=lambda: [i for i in range(len(workers)) if i not in lost],
                             handle=lambda i: workers[i])
    train = SimpleNamespace(lora=SimpleNamespace(enabled=lora > 0))
    return SimpleNamespace(actors=actors, calls=_Calls(), work_dir=str(tmp_path),
                           ship_checkpoints=False, publishing=publishing,
                           settings=SimpleNamespace(trainer=SimpleNamespace(train=train)))


LOST = TrainerRankLost(1, "train_step", ACTOR_DIED)


def test_the_weights_come_from_the_first_worker_holding_the_trainers_version(tmp_path):
    runtime = _runtime(tmp_path, held=[4, 5, 5], lost=(1,))
    plan, recorded = asyncio.run(published_rebuild.published_plan(runtime, LOST, 5))
    assert plan.weights == ["weights of 5"] and plan.version == 5  # worker 2: 1 is lost
    assert recorded == {"trainer_weights_from_worker": 2.0, "trainer_optimizer_version": -1.0}
    assert plan.checkpoint is None  # no checkpoint yet: a fresh optimizer


def test_with_several_optimizer_steps_a_version_the_state_is_found_by_its_publish(tmp_path):
    # train.mini_batches = 2: the trainer's 10 optimizer steps went out as version 5
    runtime = _runtime(tmp_path, held=[4, 5], publishing=(10, 5))
    plan, recorded = asyncio.run(published_rebuild.published_plan(runtime, LOST, 10))
    assert plan.weights == ["weights of 5"] and plan.version == 10  # the trainer's count
    assert recorded["trainer_weights_from_worker"] == 1.0


def test_a_state_never_published_has_no_source_and_the_run_ends_saying_why(tmp_path):
    # a streamed step's first part done (11 optimizer steps), the last publish at 10
    runtime = _runtime(tmp_path, held=[5, 5], publishing=(10, 5))
    with pytest.raises(TrainerRankLost) as error:
        asyncio.run(published_rebuild.published_plan(runtime, LOST, 11))
    assert ("the trainer's state after its last completed call (optimizer step 11) never went "
            "to the rollout workers (the last publish was optimizer step 10's, as version 5)"
            in str(error.value))
    assert "train.stream_chunks" in str(error.value)


@pytest.mark.parametrize("held,lora,why", [
    ([4, RuntimeError("the VLLMInferenceEngine engine cannot give its weights back")], 0,
     "no rollout worker holds the trainer's version 5 to start again from (rollout worker 0 "
     "holds version 4; rollout worker 1: the VLLMInferenceEngine engine cannot give its "
     "weights back)"),
    ([], 0, "(no live rollout worker)"),
    ([5], 8, "train.lora: the rollout workers hold the adapter merged onto the base weights")])
def test_without_the_trainers_version_on_a_worker_the_run_ends_saying_why(tmp_path, held,
                                                                         lora, why):
    runtime = _runtime(tmp_path, held=held, lora=lora)
    with pytest.raises(TrainerRankLost) as error:
        asyncio.run(published_rebuild.published_plan(runtime, LOST, 5))
    assert why in str(error.value)


def test_the_optimizer_comes_from_the_newest_verified_checkpoint_not_past_the_version(
        tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, 2)
    _checkpoint(root, 3, 3)
    corrupt = _checkpoint(root, 4, 4)
    (corrupt / "model.safetensors").write_bytes(b"not the bytes the manifest names")
    _checkpoint(root, 6, 6)  # past the version: never (it cannot be the trainer's past)
    runtime = _runtime(tmp_path, held=[5])
    plan, recorded = asyncio.run(published_rebuild.published_plan(runtime, LOST, 5))
    assert plan.checkpoint == str(root / "step_000003")
    assert recorded["trainer_optimizer_version"] == 3.0
    assert f"checkpoint '{corrupt}'" in caplog.text  # step 4's, named and passed over
    assert "falling back to an earlier checkpoint" in caplog.text


def test_a_checkpoint_without_trainer_state_is_passed_over(tmp_path):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, 2)
    bare = _checkpoint(root, 3, 3)
    (bare / "eddy_train_state.json").unlink()
    assert published_rebuild.saved_version(bare) is None
    path, version = published_rebuild._checkpoint(_runtime(tmp_path, held=[]), 5)
    assert (path.name, version) == ("step_000002", 2)
