"""Partial rollout switched on during a run (the adaptive scheduler's plan): the whole rollout
follows it at once, moves included (one owner of the setting: `StreamingRollout
.use_partial_rollout`). Scripted engine, no model, no clock."""

import asyncio

from scripted_engine import ScriptedEngine, until

from eddyrl.core.ledger import Ledger
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.version_window import VersionWindow
from eddyrl.protocol import Group, SamplingParams
from eddyrl.runtime.inprocess import InProcessRuntime


def test_switching_partial_rollout_on_lets_running_requests_adopt_the_next_version():
    async def run():
        engine = ScriptedEngine(token=3)
        engine.holds["g0"] = asyncio.Event()  # still running when the next version arrives
        runtime = InProcessRuntime([engine])
        window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=8)
        rollout = StreamingRollout(runtime, window, VersionAssignment(1, 64), Ledger(),
                                   SafeReward(lambda text, answer: 1.0),
                                   lambda ids: "x" * len(ids))
        rollout.ledger.queue("g0", 0, 0)
        rollout.dispatch([Group("g0", "g0", "1", [5, 6], 0)], 1,
                         SamplingParams(max_new_tokens=40))
        await until(lambda: engine._running == 1)
        rollout.use_partial_rollout(True)
        rollout.published(1, [0])  # the engine still reports version 0: it is busy
        # with partial rollout the running request goes on with the new weights (adopt)
        assert rollout.table["g0-0"].version == 1 and rollout.partial_rollout
        engine.holds["g0"].set()
        await rollout.drain()

    asyncio.run(run())
