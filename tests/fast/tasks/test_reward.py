"""Answer extraction and reward on hand-computed cases."""

import pytest

from eddyrl.tasks.reward import extract_answer, reward


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3 8 16 = 16", "16"),
        ("3 8 16 =16\n", "16"),
        ("3 8 15 = 15", "15"),
        ("1 = 2 = 3", "3"),  # the last `=` wins
        ("= 007", "7"),
        ("3 8 16", None),  # no final `=`
        ("3 8 16 = ", None),
        ("3 8 16 = 16 and more", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_reward_correct_wrong_malformed_empty():
    assert reward("3 8 16 = 16", "16") == 1.0
    assert reward("3 8 15 = 15", "16") == 0.0
    assert reward("3 8 16", "16") == 0.0
    assert reward("", "16") == 0.0


def test_format_weight_rewards_only_well_formed_wrong_answers():
    assert reward("3 8 15 = 15", "16", format_weight=0.1) == 0.1
    assert reward("3 8 x = 15", "16", format_weight=0.1) == 0.0
    assert reward("", "16", format_weight=0.1) == 0.0
    assert reward("3 8 16 = 16", "16", format_weight=0.1) == 1.0
    assert reward("= 15", "16", format_weight=0.1) == 0.0  # an answer without work is malformed
    assert reward("= 16", "16") == 1.0  # but a correct answer is correct however it was reached
