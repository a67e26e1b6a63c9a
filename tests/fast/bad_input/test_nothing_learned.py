"""Issue 34, item 1: a run that cannot learn stops and says why. Before: a GSM8K-format file
with a reward that never matched ran every step with `groups_kept 0, samples_trained 0` and
exited 0 with `held-out accuracy: 0.000 -> 0.000`, no warning. Here the watch and the warning
on their own; a whole run: test_nothing_learned_run.py."""

from eddyrl.core.idle import IdleWatch, check_initial
from eddyrl.protocol import GenerationResult, Group, Trajectory


def group(rewards, answer="42"):
    g = Group("g", "add 1 2", answer, [1, 2], 0)
    g.trajectories = [Trajectory(GenerationResult("r", [1, 2], [ord("x"), ord("y")], [0.0, 0.0],
                                                  [0, 0], "stop"), reward=r) for r in rewards]
    return g


def test_the_watch_stops_after_the_limit_and_a_trained_step_resets_it():
    watch = IdleWatch(3, decode=lambda ids: "".join(map(chr, ids)), reward_name="m:f")
    watch.saw([group([0.0, 0.0]), group([1.0, 0.0])])
    assert not watch.stepped(0) and not watch.stepped(0)
    assert not watch.stepped(8)  # trained: back to 0
    for _ in range(2):
        watch.saw([group([0.0, 0.0])])
        assert not watch.stepped(0)
    watch.saw([group([0.0, 0.0], answer="7")])
    assert watch.stepped(0)
    message = watch.message()
    assert message.startswith("stopped: no sample was trained in the last 3 steps "
                              "(loop.max_idle_steps=3); 100% of the 3 groups")
    assert "Reward function: m:f" in message and "response 'xy' | answer '7' | reward 0" in message
    assert "max_new_tokens" in message and "loop.max_idle_steps=0" in message
    assert not IdleWatch(0, decode=str, reward_name="m:f").stepped(0)  # 0: never


def test_equal_held_out_rewards_of_the_starting_model_are_warned():
    assert check_initial([0.0, 0.0, 0.0], [("a", "1", 0.0)], "m:f").startswith(
        "every held-out response of the starting model got reward 0 from m:f")
    assert check_initial([0.0, 1.0], [], "m:f") is None
