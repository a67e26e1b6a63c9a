"""The trainer ranks' checkpoint, from them into a directory and back (`RayRuntime.save` and
`load`). Where every node sees the run directory the ranks write and read it themselves; on
a cluster without a shared one (`cluster.shared_run_dir = false`: `ship`) each rank saves on
its node's disk and the driver collects the files through the object store, and a load sends
them to the ranks the same way.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from ..node_files import DirectoryShipment
from .trainer_calls import TrainerCalls


async def save(ranks: TrainerCalls, trainers: list[Any], path: str, *,
               ship_from: list[str] | None, namespace: str) -> None:
    """`ship_from`: each rank's node (`RayRuntime.placement`) where the files go through the
    driver, else None: the ranks write `path` themselves."""
    if ship_from is not None:
        await _save_through_driver(ranks, trainers, path, ship_from, namespace)
    else:
        await ranks.call_all([(r, f"save to {path}", t.save.remote(path))
                              for r, t in enumerate(trainers)])


async def _save_through_driver(ranks: TrainerCalls, trainers: list[Any], path: str,
                               nodes: list[str], namespace: str) -> None:
    """Each rank saves on its node's disk; from one rank per node the driver collects the
    files (through the object store) and writes them into `path`, which the caller then
    renames into place (checkpoints.write); the nodes' copies are removed."""
    name = f"{namespace}-{uuid.uuid4().hex[:8]}"
    local = await ranks.call_all([(r, "save on its node", t.save_on_node.remote(name))
                                  for r, t in enumerate(trainers)])
    first_on_node = {node: rank for rank, node in reversed(list(enumerate(nodes)))}
    try:
        shipments = await ranks.call_all([
            (r, f"checkpoint files ({nodes[r]})", trainers[r].collect.remote(local[r]))
            for r in sorted(first_on_node.values())])
        for shipment in shipments:  # blocking reads of the object store: off the loop
            await asyncio.to_thread(shipment.write_into, path)
    finally:
        await ranks.call_all([(r, "discard its node's copy",
                               trainers[r].discard.remote(local[r]))
                              for r in sorted(first_on_node.values())])


async def load(ranks: TrainerCalls, trainers: list[Any], path: str, *, ship: bool) -> int:
    """Every trainer rank loads a checkpoint `save` wrote (weights, optimizer, RNG); returns
    the trainer's version after it. `ship`: the checkpoint's files go to the ranks through
    the object store."""
    checkpoint = await asyncio.to_thread(DirectoryShipment.from_path, path) if ship else path
    await ranks.call_all([(r, f"load from {path}", t.load.remote(checkpoint))
                          for r, t in enumerate(trainers)])
    return (await ranks.call_all([(0, "version", trainers[0].version.remote())]))[0]
