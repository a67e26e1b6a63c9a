"""Environments named in config by dotted path, `package.module:Name`, checked when the config
is loaded so that a typo fails at start-up with the key, the value and what is wrong, not hours
later inside a rollout. The path itself is resolved by `eddyrl.plugins.load_dotted`, like a
reward function's."""

from __future__ import annotations

import inspect
from typing import Callable

from ..errors import ConfigError
from ..plugins import load_dotted
from .base import Environment


class EnvironmentFactory:
    """Builds one episode's environment: `factory(prompt=..., answer=...)`, with the keyword
    arguments bound at load time (tokenizer, limits, the environment's own options)."""

    def __init__(self, target: Callable[..., Environment], name: str, kwargs: dict) -> None:
        self.target, self.name, self.kwargs = target, name, kwargs

    def __call__(self, *, prompt: str, answer: str) -> Environment:
        env = self.target(prompt=prompt, answer=answer, **self.kwargs)
        if not isinstance(env, Environment):
            raise TypeError(f"environment factory {self.name!r} returned "
                            f"{type(env).__name__}, not an eddyrl.envs.Environment")
        return env


def load_environment(dotted: str, /, key: str = "env.name", **kwargs) -> EnvironmentFactory:
    """A factory for the environment `dotted` names: an `Environment` subclass, or a callable
    that returns one. `kwargs` are checked against its signature now (with `prompt` and
    `answer`, which each episode supplies); ConfigError naming `key` on any problem."""
    target = load_dotted(dotted, key, expect="an Environment subclass or a factory function "
                                             "returning one")
    where = f"config key {key!r} = {dotted!r}"
    if inspect.isclass(target):
        if not issubclass(target, Environment):
            raise ConfigError(f"{where}: class {target.__name__} is not a subclass of "
                              "eddyrl.envs.Environment")
        if inspect.isabstract(target):
            missing = ", ".join(sorted(target.__abstractmethods__))
            raise ConfigError(f"{where}: {target.__name__} is abstract (implement {missing})")
    if {"prompt", "answer"} & set(kwargs):
        raise ConfigError(f"{where}: prompt and answer are given per episode, not at load time")
    _check_arguments(target, kwargs, where)
    return EnvironmentFactory(target, dotted, kwargs)


def _check_arguments(target: Callable, kwargs: dict, where: str) -> None:
    """Unknown and missing keyword arguments, found before the first episode. A class's
    `**kwargs` is taken to go to its base's `__init__`, so names are looked for up the chain to
    a base that takes no `**kwargs` (Environment's); required ones only in the first (a class
    may pass its bases' arguments itself)."""
    named, required, open_ended = set(), set(), True
    functions = [vars(k)["__init__"] for k in target.__mro__ if "__init__" in vars(k)] \
        if inspect.isclass(target) else [target]
    for function in functions:
        try:
            params = list(inspect.signature(function).parameters.values())
        except ValueError:
            return  # no signature to read (a builtin): the first episode will tell
        keywords = [p for p in params if p.name != "self" and p.kind in
                    (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        named |= {p.name for p in keywords}
        if function is functions[0]:
            required = {p.name for p in keywords if p.default is p.empty}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            open_ended = False
            break
    given = {"prompt", "answer", *kwargs}
    unknown = sorted(set(kwargs) - named) if not open_ended else []
    missing = sorted(required - given)
    if unknown or missing:
        problems = ([f"unknown arguments {', '.join(unknown)}"] if unknown else []) + \
            ([f"missing arguments {', '.join(missing)}"] if missing else [])
        raise ConfigError(f"{where}: {'; '.join(problems)} (it takes: "
                          f"{', '.join(sorted(named - {'prompt', 'answer'}))})")
