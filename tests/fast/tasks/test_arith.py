"""Task generation: deterministic, disjoint splits, long-tailed term counts."""

import statistics

import pytest

from eddyrl.tasks.arith import (
    ArithTaskConfig,
    demonstration,
    generate_rows,
    max_response_chars,
    parse_prompt,
    write_splits,
)
from eddyrl.tasks.dataset import read_rows
from eddyrl.tasks.reward import reward

CONFIG = ArithTaskConfig()


def test_demonstration_writes_running_sums():
    assert demonstration("add 3 5 8") == "3 8 16 = 16"
    assert demonstration("add 0 0") == "0 0 = 0"
    assert parse_prompt("add 12 7") == [12, 7]


def test_generation_is_deterministic_in_seed():
    assert generate_rows(50, 3, "train", CONFIG) == generate_rows(50, 3, "train", CONFIG)
    assert generate_rows(50, 3, "train", CONFIG) != generate_rows(50, 4, "train", CONFIG)


def test_rows_are_consistent_and_demonstrations_earn_full_reward():
    for row in generate_rows(200, 0, "train", CONFIG):
        numbers = parse_prompt(row["prompt"])
        assert row["answer"] == str(sum(numbers))
        assert row["num_terms"] == len(numbers)
        assert CONFIG.min_terms <= len(numbers) <= CONFIG.max_terms
        assert all(0 <= n <= CONFIG.max_operand for n in numbers)
        assert len(demonstration(row["prompt"])) <= max_response_chars(CONFIG)
        assert reward(demonstration(row["prompt"]), row["answer"]) == 1.0


def test_train_and_eval_prompts_are_disjoint():
    train = {row["prompt"] for row in generate_rows(3000, 0, "train", CONFIG)}
    held_out = {row["prompt"] for row in generate_rows(300, 0, "eval", CONFIG)}
    assert not train & held_out


def test_term_counts_are_heavy_tailed():
    counts = [row["num_terms"] for row in generate_rows(4000, 0, "train", CONFIG)]
    term_range = range(CONFIG.min_terms, CONFIG.max_terms + 1)
    share = {k: counts.count(k) / len(counts) for k in term_range}
    assert share[2] == max(share.values())  # the shortest problems are the most common
    assert share[2] > 2 * share[4]
    assert share[CONFIG.max_terms] > 0.01  # yet the longest still turn up
    lengths = [len(demonstration(row["prompt"])) for row in generate_rows(4000, 0, "train", CONFIG)]
    assert statistics.mean(lengths) > statistics.median(lengths)  # right-skewed
    assert max(lengths) > 3 * statistics.median(lengths)


def test_write_splits_round_trips(tmp_path):
    train_path, eval_path = write_splits(tmp_path, 0, 20, 5, CONFIG)
    assert read_rows(train_path) == generate_rows(20, 0, "train", CONFIG)
    assert len(read_rows(eval_path)) == 5


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="max_terms"):
        ArithTaskConfig(min_terms=5, max_terms=3)
