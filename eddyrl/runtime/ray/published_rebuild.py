"""Where a rebuilt trainer's state comes from when no buddy copies were kept
(`train.buddy_replication = false`; with copies: trainer_rebuild.py): the weights the rollout
workers were last given, and the optimizer state and generators of the run's last checkpoint.

- The weights: the first live rollout worker whose newest weights (`held_weights`: staged or
  hosted) are the trainer's state after its last completed call (`RayRuntime.trainer_version`,
  counted in optimizer steps). A worker knows its weights by the policy version they were
  published as, so the state is found through the last publish (`RayRuntime.publishing`: the
  trainer's optimizer steps then, and the version they went out as): with `train.mini_batches`
  optimizer steps a version the two counts differ. Only that state will do: an older one would
  drop steps whose batches the ledger counts as trained; none newer exists (the trainer is its
  only source). A state never published, a streamed step's part (`train.stream_chunks`), has
  no such source: the run ends saying so. A worker gives them back in its engine's dtype,
  under the trainer's names; they go to the new rank 0 through the object store and from it to
  the others by broadcast.
- The optimizer and generators: the newest checkpoint under `<run_dir>/checkpoints` that
  verifies (`checkpoints.latest`), of a version no later than that; none (the first steps of a
  run) gives a fresh optimizer and the seed's generators.

Bit for bit the state of a run without the loss only where the checkpoint is of that very
version and the rollout keeps the trainer's dtype (the event says `trainer_state_exact`);
otherwise the next steps start from the checkpoint's optimizer moments (and step count) and
from weights rounded to the rollout's dtype: documented in docs/reliability.md as not exact.
Every group is still trained once: the interrupted call runs again on the same batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import checkpoints
from ...engines.training.state_files import ENGINE_STATE_FILE
from ...resume import CHECKPOINTS
from ...runtime_protocol import TrainerRankLost
from ..node_files import DirectoryShipment
from ..rank_rebuild import PublishedPlan

if TYPE_CHECKING:
    from .runtime import RayRuntime

log = logging.getLogger(__name__)

async def published_plan(runtime: RayRuntime, lost: TrainerRankLost, version: int
                         ) -> tuple[PublishedPlan, dict[str, float]]:
    """The plan every member of the new group loads (`TrainerRank.rejoin_published`), and
    what the event records of it; raises `lost.not_recovered(why)` where there is none."""
    sent_at, published = runtime.publishing
    if sent_at != version:
        raise lost.not_recovered(
            f"train.buddy_replication = false and the trainer's state after its last completed "
            f"call (optimizer step {version}) never went to the rollout workers (the last "
            f"publish was optimizer step {sent_at}'s, as version {published}): a streamed step "
            "(train.stream_chunks) between its parts; keep buddy copies to recover there")
    weights, worker, why = await _published_weights(runtime, published)
    if weights is None:
        raise lost.not_recovered(why)
    path, saved = _checkpoint(runtime, version)
    checkpoint: str | DirectoryShipment | None = None
    if path is not None:
        checkpoint = await asyncio.to_thread(DirectoryShipment.from_path, str(path)) \
            if runtime.ship_checkpoints else str(path)
    optimizer = f"checkpoint {path.name} (version {saved})" if path else "a fresh optimizer"
    log.warning(f"trainer rank {lost.rank} is rebuilt without buddy copies: the weights of "
                f"version {published} from rollout worker {worker}, the optimizer state and "
                f"generators from {optimizer}")
    return (PublishedPlan([weights], version, checkpoint),
            {"trainer_weights_from_worker": float(worker),
             "trainer_optimizer_version": float(saved if path is not None else -1)})


async def _published_weights(runtime: RayRuntime, version: int) -> tuple[Any, int, str]:
    """(a Ray reference to the weights, the worker they came from, "") or (None, -1, why)."""
    if runtime.settings.trainer.train.lora.enabled:
        return None, -1, ("train.lora: the rollout workers hold the adapter merged onto the "
                          "base weights, not the adapter the trainer trains")
    held: list[str] = []
    for worker in runtime.actors.live():
        actor = runtime.actors.handle(worker)
        held_version, weights = actor.held_weights.options(num_returns=2).remote()
        try:
            got = await runtime.calls.call(f"rollout worker {worker}", "weights given back",
                                           held_version)
        except Exception as exc:  # lost meanwhile, or its engine cannot give them back
            held.append(f"rollout worker {worker}: {exc}")
            continue
        if got == version:
            return weights, worker, ""
        held.append(f"rollout worker {worker} holds version {got}")
    return None, -1, (f"train.buddy_replication = false and no rollout worker holds the "
                      f"trainer's version {version} to start again from ("
                      + ("; ".join(held) or "no live rollout worker") + ")")


def _checkpoint(runtime: RayRuntime, version: int) -> tuple[Path | None, int]:
    """The newest checkpoint of the run that verifies (`checkpoints.latest`, which names each
    one it passes over) and holds trainer state of a version no later than `version`."""
    root = Path(runtime.work_dir) / CHECKPOINTS  # absent: none yet (`latest` finds none)

    def usable(path: Path) -> None:
        saved = saved_version(path)
        if saved is None or saved > version:
            raise checkpoints.CheckpointError(
                f"checkpoint '{path}' holds no trainer state of version {version} or before")

    path, _ = checkpoints.latest(root, usable)
    return (path, saved_version(path)) if path is not None else (None, -1)


def saved_version(path: Path) -> int | None:
    """The trainer's version a checkpoint holds, None where it holds no trainer state."""
    try:
        return int(json.loads((Path(path) / ENGINE_STATE_FILE).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
