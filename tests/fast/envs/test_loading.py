"""Plug-in contract: environments and rewards named by dotted path, each mistake a clear
ConfigError naming the key. The plug-ins live in a module written to a temporary directory."""

import asyncio
import sys
import textwrap

import pytest

from eddyrl.envs import Action, Environment, load_environment, load_reward_fn
from eddyrl.envs.calculator import CalculatorEnv
from eddyrl.errors import ConfigError

PLUGIN = textwrap.dedent("""
    from eddyrl.envs import Environment, Reply

    class Echo(Environment):
        def __init__(self, *, greeting="hi", **kwargs):
            super().__init__(**kwargs)
            self.greeting = greeting

        async def respond(self, action):
            return Reply(done=True, reward=float(action.text == self.greeting))

    class Abstract(Environment):
        pass

    class NotAnEnv:
        pass

    def make_echo(*, tokenizer, prompt, answer, level=1):
        return Echo(tokenizer=tokenizer, prompt=prompt, answer=answer, greeting=str(level))

    def make_wrong(*, prompt, answer):
        return "not an environment"

    class Holder:
        Inner = Echo

    def reward(text, answer):
        return 1.0

    NUMBER = 3
""")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(PLUGIN)
    (tmp_path / "broken_envs.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs"
    for name in ("my_envs", "broken_envs"):
        sys.modules.pop(name, None)


def test_loads_a_subclass_with_bound_arguments(plugin, spy):
    factory = load_environment("my_envs:Echo", tokenizer=spy, greeting="yo")
    env = factory(prompt="p", answer="a")
    assert isinstance(env, Environment) and (env.prompt, env.greeting) == ("p", "yo")
    assert asyncio.run(env.step(Action((1,), "yo"))).reward == 1.0


def test_loads_a_factory_function_and_a_nested_name(plugin, spy):
    env = load_environment("my_envs:make_echo", tokenizer=spy, level=7)(prompt="p", answer="a")
    assert env.greeting == "7"
    assert load_environment("my_envs:Holder.Inner", tokenizer=spy)(prompt="p", answer="a")


def test_bundled_environment_by_path(spy):
    factory = load_environment("eddyrl.envs.calculator:CalculatorEnv", tokenizer=spy)
    assert isinstance(factory(prompt="p", answer="1"), CalculatorEnv)


@pytest.mark.parametrize("dotted", ["my_envs.Echo", "my_envs:", ":Echo", "my envs:Echo",
                                    "my_envs:Echo:x", "", "1mod:Echo"])
def test_malformed_path(plugin, dotted):
    with pytest.raises(ConfigError, match="'env.name'.*form 'package.module:Name'"):
        load_environment(dotted)


def test_module_that_does_not_import_is_named(plugin):
    with pytest.raises(ConfigError, match="module 'no_such_pkg.envs' cannot be imported "
                                          r"\(ModuleNotFoundError"):
        load_environment("no_such_pkg.envs:Env")
    with pytest.raises(ConfigError, match="module 'broken_envs' cannot be imported.*"
                                          "not_a_module_anywhere"):
        load_environment("broken_envs:Env")


def test_missing_attribute(plugin):
    with pytest.raises(ConfigError, match="module 'my_envs' has no attribute 'Ecko'"):
        load_environment("my_envs:Ecko")


@pytest.mark.parametrize("name, why", [
    ("NotAnEnv", "class NotAnEnv is not a subclass of eddyrl.envs.Environment"),
    ("Abstract", r"Abstract is abstract \(implement respond\)"),
    ("NUMBER", "'my_envs:NUMBER': the object is a int, not an Environment subclass or a "
               "factory"),
])
def test_not_an_environment(plugin, name, why):
    with pytest.raises(ConfigError, match=why):
        load_environment(f"my_envs:{name}", key="env.custom")


def test_factory_returning_something_else_fails_at_its_first_call(plugin):
    factory = load_environment("my_envs:make_wrong")
    with pytest.raises(TypeError, match="'my_envs:make_wrong' returned str, not an"):
        factory(prompt="p", answer="a")


def test_arguments_are_checked_up_the_init_chain(plugin, spy):
    with pytest.raises(ConfigError, match=r"unknown arguments greting \(it takes: clock, "
                                          "greeting, limits, payload_bytes, tokenizer"):
        load_environment("my_envs:Echo", tokenizer=spy, greting="yo")
    with pytest.raises(ConfigError, match="missing arguments tokenizer"):
        load_environment("my_envs:make_echo")
    with pytest.raises(ConfigError, match="unknown arguments max_turns"):
        load_environment("eddyrl.envs.calculator:CalculatorEnv", tokenizer=spy, max_turns=3)


def test_prompt_and_answer_come_per_episode(plugin, spy):
    with pytest.raises(ConfigError, match="given per episode"):
        load_environment("my_envs:Echo", tokenizer=spy, answer="1")


def test_reward_by_dotted_path(plugin):
    """Rewards and environments load through the same function: the same four messages."""
    key = "env.options.reward_fn"
    assert load_reward_fn("my_envs:reward", key)("x", "y") == 1.0
    with pytest.raises(ConfigError, match=f"'{key}' = 'my_envs:NUMBER': the object is a int, "
                                          r"not a callable fn\(response_text, answer\)"):
        load_reward_fn("my_envs:NUMBER", key)
    with pytest.raises(ConfigError, match=f"'{key}' = 'my_envs.reward' is not a dotted path "
                                          "of the form 'package.module:Name'"):
        load_reward_fn("my_envs.reward", key)
    with pytest.raises(ConfigError, match=f"'{key}' = 'my_envs:rewrad': module 'my_envs' has "
                                          "no attribute 'rewrad'"):
        load_reward_fn("my_envs:rewrad", key)
    with pytest.raises(ConfigError, match=f"'{key}' = 'no_such_pkg:f': module 'no_such_pkg' "
                                          r"cannot be imported \(ModuleNotFoundError"):
        load_reward_fn("no_such_pkg:f", key)
