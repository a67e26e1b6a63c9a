"""The tiny multi-turn task: rows, splits, and its reference episode through CalculatorEnv in
the tiny tokenizer's vocabulary."""

import asyncio

import pytest

from eddyrl.envs import Action
from eddyrl.envs.calculator import TINY_SYNTAX, CalculatorEnv
from eddyrl.tasks.tool_task import ToolTaskConfig, demonstration, generate_rows
from eddyrl.models.tiny import MAX_POSITIONS
from eddyrl.tasks.arith import parse_prompt
from eddyrl.tasks.prompts import prompt_ids

CONFIG = ToolTaskConfig()


def test_rows_are_big_sums_deterministic_and_split():
    train = generate_rows(200, seed=1, split="train", config=CONFIG)
    assert train == generate_rows(200, seed=1, split="train", config=CONFIG)
    evals = generate_rows(50, seed=1, split="eval", config=CONFIG)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    for row in train + evals:
        numbers = parse_prompt(row["prompt"])
        assert 2 <= len(numbers) == row["num_terms"] <= 3
        assert all(1000 <= n < 10**6 for n in numbers)
        assert row["answer"] == str(sum(numbers))


@pytest.mark.parametrize("bad", [dict(min_terms=3, max_terms=2), dict(min_digits=0),
                                 dict(eval_fraction=1.0)])
def test_config_is_validated(bad):
    with pytest.raises(ValueError, match="tool_task"):
        ToolTaskConfig(**bad)


def test_reference_episode_scores_one_in_the_tiny_vocabulary(tiny_tokenizer):
    row = generate_rows(1, seed=0, split="train", config=CONFIG)[0]
    env = CalculatorEnv(tokenizer=tiny_tokenizer, prompt=row["prompt"], answer=row["answer"],
                        syntax=TINY_SYNTAX)
    total = len(prompt_ids(tiny_tokenizer, row["prompt"]))
    for speaker, text in demonstration(row["prompt"]):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert tiny_tokenizer.unk_token_id not in ids, text
        total += len(ids)
        if speaker == "model":
            obs = asyncio.run(env.step(Action(tuple(ids), text)))
        else:
            assert list(obs.token_ids) == ids  # the env says exactly the reference text
    assert (obs.done, obs.reward) == (True, 1.0)
    assert total + 1 < MAX_POSITIONS  # + end of message
