"""The cipher task: a fixed key, deterministic and disjoint splits, an exact-match reward, and
its place among the built-in tasks."""

import string

import pytest

from eddyrl.errors import ConfigError
from eddyrl.tasks.builtin import BUILTIN_TASKS, write_builtin_splits
from eddyrl.tasks.cipher import (
    FREQUENCY_ORDER,
    KEY,
    CipherTaskConfig,
    demonstration,
    encipher,
    generate_rows,
    max_response_chars,
    parse_prompt,
)
from eddyrl.tasks.config import TASKS, DataConfig
from eddyrl.tasks.dataset import read_rows
from eddyrl.tasks.reward import reward as arith_reward
from eddyrl.tasks import cipher

CONFIG = CipherTaskConfig()


def test_the_key_and_the_letter_ranks_are_permutations_of_the_alphabet():
    assert sorted(KEY) == sorted(FREQUENCY_ORDER) == list(string.ascii_lowercase)
    assert encipher("abc") == "tds"
    assert demonstration("enc hello") == encipher("hello") == "efnnx"
    with pytest.raises(ValueError, match="lower-case"):
        encipher("Hi")


def test_generation_is_deterministic_in_seed():
    assert generate_rows(50, 3, "train", CONFIG) == generate_rows(50, 3, "train", CONFIG)
    assert generate_rows(50, 3, "train", CONFIG) != generate_rows(50, 4, "train", CONFIG)
    assert generate_rows(50, 3, "eval", CONFIG) != generate_rows(50, 3, "train", CONFIG)


def test_rows_are_consistent_and_cover_every_letter_and_length():
    rows = generate_rows(2000, 0, "train", CONFIG)
    for row in rows:
        word = parse_prompt(row["prompt"])
        assert row["answer"] == encipher(word) == demonstration(row["prompt"])
        assert row["num_terms"] == len(word)
        assert CONFIG.min_letters <= len(word) <= CONFIG.max_letters
        assert len(row["answer"]) <= max_response_chars(CONFIG)
    assert {c for row in rows for c in parse_prompt(row["prompt"])} == set(string.ascii_lowercase)
    assert {row["num_terms"] for row in rows} == set(range(5, 13))


def test_train_and_eval_prompts_are_disjoint():
    train = {row["prompt"] for row in generate_rows(3000, 0, "train", CONFIG)}
    held_out = {row["prompt"] for row in generate_rows(300, 0, "eval", CONFIG)}
    assert not train & held_out


def test_reward_scores_a_right_and_a_wrong_response():
    row = generate_rows(1, 0, "eval", CONFIG)[0]
    assert cipher.reward(row["answer"], row["answer"]) == 1.0
    assert cipher.reward(f" {row['answer']}\n", row["answer"]) == 1.0
    wrong = row["answer"][:-1] + ("a" if row["answer"][-1] != "a" else "b")
    assert cipher.reward(wrong, row["answer"]) == 0.0
    assert cipher.reward(row["answer"][:-1], row["answer"]) == 0.0  # a letter short
    assert cipher.reward(parse_prompt(row["prompt"]), row["answer"]) == 0.0  # copied, not enciphered
    assert cipher.reward("", row["answer"]) == 0.0
    assert arith_reward(row["answer"], row["answer"]) == 0.0  # hence the config check below


def test_builtin_splits_round_trip(tmp_path):
    assert tuple(BUILTIN_TASKS) == TASKS
    train_path, eval_path = write_builtin_splits("cipher", tmp_path, 0, 20, 5)
    assert read_rows(train_path) == generate_rows(20, 0, "train", CONFIG)
    assert read_rows(eval_path) == generate_rows(5, 0, "eval", CONFIG)


def test_cipher_with_the_arith_reward_is_refused():
    with pytest.raises(ConfigError, match="eddyrl.tasks.cipher:reward"):
        DataConfig(task="cipher").validate("data")
    DataConfig(task="cipher", reward_fn="eddyrl.tasks.cipher:reward").validate("data")


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="max_letters"):
        CipherTaskConfig(min_letters=6, max_letters=5)
