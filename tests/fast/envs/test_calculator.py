"""The AST calculator and CalculatorEnv, token-level with the tiny tokenizer."""

import asyncio

import pytest

from eddyrl.envs import Action
from eddyrl.envs.calculator import (TAG_SYNTAX, TINY_SYNTAX, Calculator, CalculatorEnv,
                                    CalculatorError, format_number)

calc = Calculator()


@pytest.mark.parametrize("expression, value", [
    ("48213+90377", 138590), ("2 - 7", -5), ("6*7", 42), ("7/2", 3.5), ("7//2", 3),
    ("-7 % 3", 2), ("2**10", 1024), ("2**-1", 0.5), ("(1+2)*(3+4)", 21), ("--3", 3),
    ("1.5e3 + 0.5", 1500.5), ("1_000 * 3", 3000), ("  10 ", 10),
    ("2**0.5 * 2**0.5", 2**0.5 * 2**0.5),
])
def test_evaluates_arithmetic(expression, value):
    assert calc(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("", "empty"), ("__import__('os')", "unsupported"), ("x + 1", "unsupported"),
    ("(1).real", "unsupported"), ("abs(-1)", "unsupported"), ("[1, 2]", "unsupported"),
    ("True + 1", "unsupported"), ("1j * 2", "unsupported"), ("'a' * 3", "unsupported"),
    ("1 < 2", "unsupported"), ("1 +", "not an arithmetic"), ("1/0", "division by zero"),
    ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("9**9**9", "exponent beyond"), ("10**200", "longer than 100 digits"),
    ("2**300 * 2**300", "longer than 100 digits"), ("1" * 101, "longer than 100 digits"),
    ("1e308 * 10", "too large"), ("1e999", "too large"), ("10.0 ** 400", "too large"),
    ("(-8) ** 0.5", "not a real number"), ("1+" * 200 + "1", "longer than 256"),
])
def test_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calc(expression)


def test_limits_are_settings():
    assert Calculator(max_digits=400)("10**200") == 10**200
    with pytest.raises(CalculatorError, match="longer than 5 characters"):
        Calculator(max_chars=5)("123456")


@pytest.mark.parametrize("value, text", [(5, "5"), (5.0, "5"), (-2.0, "-2"), (3.5, "3.5"),
                                         (1e20, "1e+20"), (10**30, str(10**30))])
def test_format_number(value, text):
    assert format_number(value) == text


def run(env, text, tokenizer):
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    return asyncio.run(env.step(Action(ids, text)))


def test_tiny_episode_is_token_in_token_out(tiny_tokenizer):
    env = CalculatorEnv(tokenizer=tiny_tokenizer, prompt="add 48213 90377", answer="138590",
                        syntax=TINY_SYNTAX)
    assert env.stop_conditions() == (tuple(tiny_tokenizer.encode("#", add_special_tokens=False)),
                                     ())
    obs = run(env, "calc:48213+90377#", tiny_tokenizer)
    assert obs.token_ids == tuple(tiny_tokenizer.encode("result:138590\n",
                                                        add_special_tokens=False))
    assert tiny_tokenizer.unk_token_id not in obs.token_ids
    assert not obs.done
    assert (obs.tool.tool, obs.tool.status, obs.tool.size) == ("calculator", "success", "small")
    final = run(env, "= 138590", tiny_tokenizer)
    assert (final.done, final.reward, final.ended_by, final.token_ids) == \
        (True, 1.0, "env", ())


def test_wrong_final_answer_scores_zero(tiny_tokenizer):
    env = CalculatorEnv(tokenizer=tiny_tokenizer, prompt="add 1 2", answer="3",
                        syntax=TINY_SYNTAX)
    assert run(env, "= 4", tiny_tokenizer).reward == 0.0


def test_failed_call_is_a_tool_failure_and_the_episode_goes_on(spy):
    env = CalculatorEnv(tokenizer=spy, prompt="p", answer="1")
    obs = run(env, "let me see <calc>1/0</calc>", spy)
    assert not obs.done
    assert spy.encoded[-1] == "<result>error: division by zero</result>"
    assert (obs.tool.status, obs.tool.error) == ("failure", "division by zero")
    assert run(env, "<calc>2-1</calc>", spy).tool.status == "success"
    assert spy.encoded[-1] == "<result>1</result>"


def test_last_call_of_a_turn_is_the_one_answered(spy):
    env = CalculatorEnv(tokenizer=spy, prompt="p", answer="1", syntax=TAG_SYNTAX)
    run(env, "<calc>1+1</calc> and <calc>2+2</calc>", spy)
    assert spy.encoded[-1] == "<result>4</result>"


def test_reward_fn_by_callable_or_dotted_path(spy):
    seen = []
    env = CalculatorEnv(tokenizer=spy, prompt="p", answer="42",
                        reward_fn=lambda text, answer: seen.append((text, answer)) or 0.25)
    assert run(env, "it is 42", spy).reward == 0.25
    assert seen == [("it is 42", "42")]  # the final turn's text, not the whole transcript
    env = CalculatorEnv(tokenizer=spy, prompt="p", answer="42",
                        reward_fn="eddyrl.tasks.reward:reward")
    assert run(env, "40 = 42", spy).reward == 1.0


def test_failing_reward_fn_is_an_environment_error(spy):
    env = CalculatorEnv(tokenizer=spy, prompt="p", answer="1",
                        reward_fn=lambda text, answer: 1 / 0)
    obs = run(env, "= 1", spy)
    assert (obs.done, obs.ended_by, obs.reward) == (True, "error", 0.0)
    assert obs.error.startswith("ZeroDivisionError")
