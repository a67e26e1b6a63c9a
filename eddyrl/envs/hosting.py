"""Where a run's environments live: each episode's environment is built, stepped and closed in
a user-code pool (`eddyrl.usercode`, configured by `user_code.env`), as one session of it.

- inline: on the caller's event loop, as before (the simulator; tests with scripted engines).
  `Environment.step` cuts off a `respond()` that awaits past `env.step_timeout_s`; one that
  blocks synchronously blocks the loop.
- thread (the default): each environment has an event loop of its own, run by a worker thread
  for each call. A `respond()` that blocks its thread past the limit ends its episode ("timeout",
  cutoff reward); that thread is abandoned (a Python thread cannot be killed) and a fresh one
  takes its place. Other episodes go on on other threads.
- process: environments live in worker processes (the factory, with its tokenizer, is sent to
  each once, so it must pickle). A hang past the limit or a crash kills or loses the process:
  every episode living there ends with the cutoff reward ("timeout" for the one that hung,
  "error" for the others), and the process is replaced.

The pool's limit is `env.step_timeout_s` plus a grace (1 s + 10 %), so that the environment's
own limit, which ends an awaiting `respond()` cleanly, goes first; the pool's catches what
that cannot (a `respond()` that never yields). It bounds building and closing alike.
"""

from __future__ import annotations

from typing import Any

from ..usercode.config import WorkersConfig
from ..usercode.pool import InlinePool, Pool, SessionState, UserCodeError
from .base import EpisodeLimits, Observation
from .loading import EnvironmentFactory


def grace_s(timeout_s: float) -> float:
    """How much longer than its own limit an environment's call may take in the pool."""
    return 1.0 + 0.1 * timeout_s


class EnvHost:
    """A run's environments and the pool they run in (default: inline, on the caller's loop).
    Stands where an `EnvironmentFactory` would (`Episodes(host, decode)`; called, it builds an
    environment here, as the factory does)."""

    def __init__(self, factory: EnvironmentFactory, pool: Pool | None = None) -> None:
        self.factory = factory
        self.pool = pool if pool is not None else InlinePool(name="environment",
                                                             shared=factory)
        if self.pool.shared is not factory:
            raise ValueError("an EnvHost's pool must be built with the factory as its shared "
                             "object (host_environments does)")

    def __call__(self, *, prompt: str, answer: str):
        """An environment built here, like the factory's (a trial build, stop conditions)."""
        return self.factory(prompt=prompt, answer=answer)

    @property
    def name(self) -> str:
        return self.factory.name

    @property
    def kwargs(self) -> dict:
        return self.factory.kwargs

    @property
    def mode(self) -> str:
        return self.pool.mode

    @property
    def limits(self) -> EpisodeLimits:
        limits = getattr(self.factory, "kwargs", {}).get("limits")
        return limits if isinstance(limits, EpisodeLimits) else EpisodeLimits()

    def open(self) -> "HostedEnv":
        """A new episode's environment, not built yet (`build`)."""
        return HostedEnv(self.pool.session(), self.limits.step_timeout_s)

    def report(self) -> dict[str, Any]:
        """The pool's counts, for the run summary (none inline)."""
        if self.mode == "inline":
            return {}
        return {"user_code": self.mode, "workers_replaced": self.pool.replaced}

    def close(self) -> None:
        """Stop the pool's workers (the run is over)."""
        self.pool.close()


def host_environments(factory: EnvironmentFactory, config: WorkersConfig | None = None,
                      prefix: str = "user_code.env") -> EnvHost:
    """`factory`'s environments in the pool `config` describes (None: inline). ConfigError
    naming `prefix.mode` if process mode cannot send the factory to a worker process."""
    if config is None:
        return EnvHost(factory)
    return EnvHost(factory, config.build(prefix, name="environment", shared=factory))


class HostedEnv:
    """One episode's environment, wherever it lives. Each call raises `UserCodeError` (reason
    error, timeout or lost, with the message for the log) when the environment fails."""

    def __init__(self, session: Any, step_timeout_s: float) -> None:
        self.session = session
        self.step_timeout_s = step_timeout_s
        self.lost = False  # a call timed out or lost its worker: nothing is left to close

    async def build(self, prompt: str, answer: str) -> float:
        """Build the environment; its cutoff reward."""
        return await self._call("environment construction", _build, prompt, answer)

    async def step(self, action) -> Observation:
        return await self._call("environment step", _step, action)

    async def close(self) -> None:
        try:
            if not self.lost:
                await self._call("environment close", _close)
        finally:
            await self.session.close(self.step_timeout_s)

    async def _call(self, what: str, fn, *args) -> Any:
        limit = self.step_timeout_s
        try:
            return await self.session.call(fn, *args, timeout_s=limit + grace_s(limit))
        except UserCodeError as exc:
            self.lost = self.lost or exc.reason != "error"
            if exc.reason == "timeout":
                raise UserCodeError("timeout", f"{what} took longer than env.step_timeout_s="
                                               f"{limit}s ({exc.message})") from None
            if exc.reason == "lost":
                raise UserCodeError("lost", f"environment worker lost: {exc.message}") from None
            raise


# What runs in the pool: module-level functions, so that they pickle by name.

def _build(state: SessionState, prompt: str, answer: str) -> float:
    state.env = state.shared(prompt=prompt, answer=answer)
    return float(state.env.limits.cutoff_reward)


async def _step(state: SessionState, action) -> Observation:
    return await state.env.step(action)


async def _close(state: SessionState) -> None:
    env = getattr(state, "env", None)
    state.env = None
    if env is not None:
        await env.close()
