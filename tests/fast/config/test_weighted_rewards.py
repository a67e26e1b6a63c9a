"""Issue 34, item 5: several rewards with weights, `data.rewards: [{fn, weight, name}]`, as TRL's
`reward_funcs` + `reward_weights`. The config's checks (each naming `data.rewards[i].key`), the
weighted sum (worked by hand), each reward logged on its own, and one reward function staying
exactly as it was: no `reward/<name>` key, the same value."""

import asyncio
import math
import pickle

import pytest

from eddyrl.config import load_config
from eddyrl.core.idle import IdleWatch, reward_name
from eddyrl.core.rewarding import (RewardTerm, SafeReward, Scored, WeightedRewards,
                                   load_reward)
from eddyrl.core.step_metrics import eval_metrics, rollout_metrics
from eddyrl.errors import ConfigError
from eddyrl.observability.samples import markdown, sample_rows
from eddyrl.protocol import GenerationResult, Group, Trajectory
from eddyrl.tasks.config import RewardSpec

ARITH = "eddyrl.tasks.reward:reward"
FIXTURES = "reward_fixtures"  # tests/ is on sys.path under pytest


def correct(response: str, answer: str) -> float:
    return float(response.strip() == answer)


def formatted(response: str, answer: str) -> float:
    return 0.5 if response.startswith("=") else 0.0


def rewards_config(*overrides: str):
    return load_config(None, list(overrides), check_files=False)


# -- the config ----------------------------------------------------------------------------------

def test_the_default_is_data_reward_fn_alone():
    data = rewards_config().data
    assert data.rewards == [] and data.reward_specs() == []


def test_entries_get_their_defaults_weight_1_and_the_function_name():
    data = rewards_config(f"data.rewards=[{{fn: {ARITH}, name: correct}}, "
                          f"{{fn: './graders/fmt.py:ok', weight: -0.5}}, "
                          f"{{fn: 'pkg.mod:Outer.check', weight: 2}}]").data
    assert data.reward_specs() == [RewardSpec(fn=ARITH, weight=1.0, name="correct"),
                                   RewardSpec(fn="./graders/fmt.py:ok", weight=-0.5, name="ok"),
                                   RewardSpec(fn="pkg.mod:Outer.check", weight=2.0,
                                              name="check")]


@pytest.mark.parametrize("value, message", [
    (f"[{{fn: {ARITH}}}, {{fn: {ARITH}, wieght: 2}}]",
     "unknown config key 'data.rewards[1].wieght' (valid keys here: fn, weight, name); did you "
     "mean 'weight'?"),
    ("[{weight: 2}]", "config key 'data.rewards[0].fn' is missing"),
    ("[{fn: nocolon}]", "config key 'data.rewards[0].fn' = 'nocolon' must be a dotted path"),
    (f"[{{fn: {ARITH}}}, {{fn: {ARITH}, name: b, weight: .inf}}]",
     "config key 'data.rewards[1].weight' = inf is not a finite number"),
    (f"[{{fn: {ARITH}, weight: .nan}}]",
     "config key 'data.rewards[0].weight' = nan is not a finite number"),
    (f"[{{fn: {ARITH}, weight: heavy}}]",
     "config key 'data.rewards[0].weight' = 'heavy' must be a number"),
    (f"[{{fn: {ARITH}, weight: true}}]",
     "config key 'data.rewards[0].weight' = True must be a number"),
    (f"[{ARITH}]", "config key 'data.rewards[0]' = 'eddyrl.tasks.reward:reward' must be a "
                   "mapping {fn: "),
    (f"{{fn: {ARITH}}}", "config key 'data.rewards' in the command-line overrides is a list"),
    (f"[{{fn: {ARITH}}}, {{fn: 'other.mod:reward'}}]",
     "config keys 'data.rewards[0]' and 'data.rewards[1]' are both named 'reward'"),
    (f"[{{fn: {ARITH}, name: 'my reward'}}]",
     "config key 'data.rewards[0].name' = 'my reward' must be letters, digits"),
    (f"[{{fn: {ARITH}, weight: 0}}, {{fn: 'a.b:c', weight: 0.0}}]",
     "config key 'data.rewards': every weight is 0"),
])
def test_a_bad_entry_is_refused_naming_its_key(value, message):
    with pytest.raises(ConfigError) as error:
        rewards_config(f"data.rewards={value}")
    assert message in str(error.value)


def test_reward_fn_and_rewards_together_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"data.reward_fn = 'a.b:c' and data.rewards are both "
                                          r"set"):
        rewards_config("data.reward_fn=a.b:c", f"data.rewards=[{{fn: {ARITH}}}]")


def test_rewards_replace_the_cipher_tasks_reward_check():
    with pytest.raises(ConfigError, match="data.task = cipher answers with a word"):
        rewards_config("data.task=cipher")
    rewards_config("data.task=cipher", "data.rewards=[{fn: 'eddyrl.tasks.cipher:reward'}]")


def test_loading_names_the_entry_whose_function_is_missing():
    specs = [RewardSpec(fn=ARITH, weight=1.0, name="a"),
             RewardSpec(fn="eddyrl.tasks.reward:missing", weight=1.0, name="b")]
    with pytest.raises(ConfigError, match=r"'data.rewards\[1\].fn' = "
                                          r"'eddyrl.tasks.reward:missing'.*no attribute"):
        load_reward(ARITH, specs)
    assert load_reward(ARITH, ()) is load_reward(ARITH)  # no rewards: data.reward_fn itself


# -- the sum ------------------------------------------------------------------------------------

TWO = WeightedRewards((RewardTerm(correct, 1.0, "correct"), RewardTerm(formatted, 0.2, "format")))


def test_the_weighted_sum_by_hand():
    # right and formatted: 1.0 * 1 + 0.2 * 0.5 = 1.1; right only: 1.0; formatted only: 0.1
    assert TWO("=7", "=7") == pytest.approx(1.1)
    assert TWO("7", "7") == 1.0
    assert TWO("=8", "7") == pytest.approx(0.1)
    scored = asyncio.run(SafeReward(TWO).score_parts("=8", "7"))
    assert scored == Scored(pytest.approx(0.1), None, {"correct": 0.0, "format": 0.5})
    assert SafeReward(TWO)("=7", "=7") == (pytest.approx(1.1), None)  # the two-value call


def test_several_rewards_pickle_by_reference_for_worker_processes():
    loaded = load_reward(ARITH, [RewardSpec(fn=ARITH, weight=2.0, name="arith"),
                                 RewardSpec(fn=f"{FIXTURES}:digit_share", weight=0.5,
                                            name="digits")])
    assert isinstance(loaded, WeightedRewards) and pickle.loads(pickle.dumps(loaded)) == loaded
    # "1 + 2 = 3" against "3": arith 1, digit share 3/9
    assert loaded("1 + 2 = 3", "3") == pytest.approx(2.0 * 1 + 0.5 * 3 / 9)


def test_one_reward_function_is_the_one_term_case_unchanged():
    def signed(response, answer):
        return -0.0 if response == "z" else float(len(response)) / 3

    safe = SafeReward(signed)
    assert [(t.weight, t.name) for t in safe.terms] == [(1.0, None)]
    assert asyncio.run(safe.score_parts("ab", "")) == Scored(2 / 3, None, None)
    value = asyncio.run(safe.score("z", ""))[0]
    assert value == 0.0 and math.copysign(1, value) == -1  # its value, bit for bit


def test_a_failing_reward_scores_0_in_the_sum_and_is_named():
    def broken(response, answer):
        raise ValueError("no parse")

    safe = SafeReward(WeightedRewards((RewardTerm(correct, 1.0, "correct"),
                                       RewardTerm(broken, 3.0, "strict"))))
    scored = asyncio.run(safe.score_parts("7", "7"))
    assert scored == Scored(1.0, "reward 'strict': ValueError: no parse",
                            {"correct": 1.0, "strict": 0.0})
    assert safe.errors == 1 and safe.first_error == "reward 'strict': ValueError: no parse"


# -- what is logged ------------------------------------------------------------------------------

def trajectory(reward: float, parts: dict[str, float] | None, text: str = "ab") -> Trajectory:
    result = GenerationResult("r", [1], [ord(c) for c in text], [0.0] * len(text),
                              [0] * len(text), "stop")
    return Trajectory(result, reward, None, parts)


def group(*trajectories: Trajectory) -> Group:
    return Group("g", "prompt", "7", [1], 0, trajectories=list(trajectories))


def test_each_reward_is_logged_beside_the_sum_and_accuracy_counts_the_first():
    # correct 1, format 0.5 -> 1.1; correct 0, format 1 (weight 2) -> 2.0: the sum reaches 1
    # for both, the correctness reward for one
    groups = [group(trajectory(1.1, {"correct": 1.0, "format": 0.5}),
                    trajectory(2.0, {"correct": 0.0, "format": 1.0}))]
    metrics = rollout_metrics(groups, reward_errors=0)
    assert metrics["reward_mean"] == pytest.approx(1.55)
    assert metrics["reward/correct"] == 0.5 and metrics["reward/format"] == 0.75
    assert metrics["train_accuracy"] == 0.5
    held_out = eval_metrics([group(trajectory(2.0, {"correct": 0.0, "format": 1.0})),
                             group(trajectory(1.0, {"correct": 1.0, "format": 0.0}))])
    assert held_out == {"eval_accuracy": 0.5, "eval_reward_mean": 1.5,
                        "eval_reward/correct": 0.5, "eval_reward/format": 0.5}


def test_one_reward_function_logs_the_keys_it_always_did():
    groups = [group(trajectory(1.0, None), trajectory(0.0, None))]
    metrics = rollout_metrics(groups, reward_errors=0)
    assert not [key for key in metrics if "/" in key]
    assert metrics["reward_mean"] == 0.5 and metrics["train_accuracy"] == 0.5
    assert eval_metrics(groups) == {"eval_accuracy": 1.0, "eval_reward_mean": 1.0}


def test_a_sample_shows_each_reward():
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    rows = sample_rows([group(trajectory(1.1, {"correct": 1.0, "format": 0.5}, "=7"))], decode, 1)
    assert rows == [{"prompt": "prompt", "response": "=7", "answer": "7", "reward": 1.1,
                     "rewards": {"correct": 1.0, "format": 0.5}}]
    assert "| 1.1 (correct 1, format 0.5) |" in markdown(rows)
    single = sample_rows([group(trajectory(1.0, None))], decode, 1)
    assert "rewards" not in single[0] and "| 1 |" in markdown(single)


def test_a_run_that_learns_nothing_names_every_reward_and_each_ones_value():
    assert reward_name(TWO) == (f"1 * correct ({__name__}:correct) + "
                                f"0.2 * format ({__name__}:formatted)")
    watch = IdleWatch(1, decode=lambda ids: "".join(map(chr, ids)), reward_name=reward_name(TWO))
    watch.saw([group(trajectory(0.1, {"correct": 0.0, "format": 0.5}, "=8"))])
    assert watch.stepped(0)
    message = watch.message()
    assert f"Reward function: 1 * correct ({__name__}:correct)" in message
    assert "response '=8' | answer '7' | reward 0.1 (correct 0, format 0.5)" in message


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_a_bundled_environment_scores_with_the_sum():
    from eddyrl.envs import Action
    from eddyrl.envs.config import EnvConfig

    factory = EnvConfig(name="calculator", options={"syntax": "tiny"}).build(
        "env", tokenizer=CharTokenizer(), reward_fn=TWO)
    env = factory(prompt="add 3 4", answer="=7")
    assert env.reward_fn is TWO
    assert asyncio.run(env.step(Action((1,), "=7"))).reward == pytest.approx(1.1)
