"""A streamed step on the simulated cluster (`train.stream_chunks`: verl's fully asynchronous
trainer, `verl_7b_64`): the trainer takes each part of a version's batch while the rest is
still to come, publishes once a version, and so idles less than the trainer that waits for the
whole batch; the same samples are trained either way. Virtual time: nothing here depends on the
machine."""

import pytest

from eddyrl.sim.clock import run_virtual
from eddyrl.sim.policies import policy_config
from eddyrl.sim.runtime import build, simulate

pytestmark = pytest.mark.filterwarnings("ignore:window.max_staleness")
STEPS = ["loop.steps=3", "loop.batch_prompts=128"]  # a quarter of verl's batch: quicker


def test_each_part_trains_before_the_version_has_taken_its_whole_batch():
    config = policy_config("verl_7b_64", STEPS, "partial")
    assert config.train.stream_chunks == 4  # verl's trigger_parameter_sync_step
    controller, runtime = build(config)
    window, train = controller.window, runtime.train
    calls: list[tuple[int, int]] = []  # (version, groups of its batch taken) at each call

    async def recording(batch, replicas=()):
        calls.append((window.version, window.taken))
        return await train(batch, replicas)

    runtime.train = recording
    run_virtual(controller.run())
    part = window.batch_groups // 4
    # four calls a version, each right after its part was taken: the first three while the
    # version's batch is not all taken, so the trainer runs while the rest generates
    assert calls == [(version, part * (index + 1)) for version in range(3)
                     for index in range(4)]
    assert [m["version"] for m in controller.history[1:]] == [1, 2, 3]  # one publish a step


def test_streaming_cuts_the_trainers_idle_time_and_trains_the_same_samples():
    whole = simulate(policy_config("verl_7b_64", [*STEPS, "train.stream_chunks=1"], "partial"))
    streamed = simulate(policy_config("verl_7b_64", STEPS, "partial"))
    assert streamed["samples_trained"] == whole["samples_trained"] == 3 * 128 * 16
    assert streamed["train_idle"] < whole["train_idle"]
    assert streamed["simulated_s"] < whole["simulated_s"]
