"""The version gate: which requests an inference engine starts, and when it swaps in staged
weights. One rule for every engine (`hf`, `vllm`, the simulator's `sim`, the tests' scripted
engine), held as a sans-IO object: no torch, no clock, no I/O, only state (plus `wait_for_admission`,
the one loop engines await on it). The engine does the
waiting and the weight copies; it asks the gate what to do and tells it what it did.

The contract (the worker side of DORA's assignment, `core/version_assignment.py`):

- An engine *hosts* one policy version, the weights its tokens come from, and never leaves it on
  its own. A request *runs* from the moment the engine admits it (`started`: a JOIN) to its
  final result (`finished`), off the batch included (preempted, waiting for a tool inside the
  engine); requests still queued before their admission do not hold the hosted version.
- `load_weights(version, hold=...)` *stages* weights (`stage`). They are applied at once when
  nothing runs and `hold` is not set; else they wait for a request that needs them (`held`):
  `hold` because episodes between turns will come back for the hosted version, staged while
  requests run because those requests keep it. Staging again replaces what was staged: the
  newest staged weights win.
- A request asks for a version (`GenerationRequest.version`, one per generate call):
  - the hosted one: JOIN, staged weights or not (migrated requests, DORA's legacy fill);
  - a newer one: WAIT until the running requests drain (`can_switch`), then the engine applies
    the staged weights (`apply`) and the request starts on them, on the newest weights staged
    by the time it starts, which may be newer than the version it asked for (the assignment's
    `published` relabels such requests). A version newer than anything staged is an error;
  - an older one: REFUSE (finish reason "refused"): those weights are gone, the caller
    regenerates the request elsewhere. Not a fresh request that waited here (`waited=True`)
    and whose staged weights were superseded while it waited: it JOINs the newest. A resumed
    one (`resumed=True`: it carries tokens of its version) is refused then too: newer weights
    continuing its tokens would mix versions in one trajectory (C1);
  - None: the newest weights the engine has: JOIN when nothing is staged, else it asks for
    the staged ones (WAIT, as a request for the staged version).
- The token policy (`TokenPolicy`), chosen by `partial_rollout`:
  - `ONE_VERSION` (DORA's C1): every token of a request comes from the version it started on;
    weights are applied only while nothing runs (`apply` refuses otherwise);
  - `PER_TOKEN` (partial rollout): a request's version is ignored, staged weights are applied
    at the engine's next step boundary (`due`) while requests run, and running requests go on
    under them (`may_continue`), each token carrying the version that sampled it
    (`token_version`, recorded in `GenerationResult.versions`).

An engine is a caller: `admit` per request or generate call, looping on WAIT (wait for its
running requests to drain while `can_switch()` is false, then apply and ask again with
`waited=True`: `wait_for_admission` is that loop); `started` / `finished` around what it runs; `stage` in `load_weights`, then
`apply` the weights if `due()` (`stage`'s own answer: at once because the engine is idle); and
`token_version()` for each token it samples. Illegal calls (a version newer than anything
staged, `apply` with nothing staged or under C1 while requests run, more finished than started)
raise ValueError naming the gate's state.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable


class Admission(enum.Enum):
    """What a request may do now."""

    JOIN = "join"  # start on the hosted version
    WAIT = "wait"  # newer weights are staged: drain, apply them, ask again (waited=True)
    REFUSE = "refuse"  # its version is gone here: finish reason "refused"


@dataclass(frozen=True, slots=True)
class TokenPolicy:
    """Which versions a request's tokens may come from."""

    name: str
    # A running request goes on across an applied version (its later tokens carry the new one),
    # so staged weights are applied at the next step boundary, whoever runs.
    switches_running: bool

    def need(self, version: int | None) -> int | None:
        """The version a request asking for `version` needs (None: the newest weights)."""
        return None if self.switches_running else version


ONE_VERSION = TokenPolicy("one version per request (C1)", switches_running=False)
PER_TOKEN = TokenPolicy("partial rollout: a version per token", switches_running=True)


def token_policy(partial_rollout: bool) -> TokenPolicy:
    return PER_TOKEN if partial_rollout else ONE_VERSION


def call_version(versions: Iterable[int | None]) -> int | None:
    """The one version a generate call's requests ask for (None: none asks for one). An engine
    that admits a call as a whole needs them to agree."""
    wanted = {v for v in versions if v is not None}
    if len(wanted) > 1:
        raise ValueError(f"one generate call mixes versions {sorted(wanted)}; split it")
    return wanted.pop() if wanted else None


class VersionGate:
    def __init__(self, version: int = 0, *, partial_rollout: bool = False) -> None:
        self._hosted = version
        self._staged: int | None = None
        self._held = False
        self._running = 0
        self.policy = token_policy(partial_rollout)

    # ---- state --------------------------------------------------------------------------
    @property
    def hosted(self) -> int:
        """The version of the weights in use: what a token sampled now carries."""
        return self._hosted

    @property
    def staged(self) -> int | None:
        """The version of the weights received and not applied yet (None: nothing staged)."""
        return self._staged

    @property
    def held(self) -> bool:
        """Whether the staged weights wait for a request that needs them (staged with `hold`,
        or while requests ran) rather than applying once the engine is idle."""
        return self._staged is not None and self._held

    @property
    def running(self) -> int:
        """Requests admitted and not finished: they hold the hosted version."""
        return self._running

    @property
    def partial_rollout(self) -> bool:
        return self.policy.switches_running

    @partial_rollout.setter
    def partial_rollout(self, value: bool) -> None:
        self.policy = token_policy(value)

    def __repr__(self) -> str:
        return f"VersionGate({self._state()})"

    def _state(self) -> str:
        staged = "nothing staged" if self._staged is None else \
            f"version {self._staged} staged{' (held)' if self._held else ''}"
        return (f"hosts version {self._hosted}, {staged}, {self._running} running, "
                f"{self.policy.name}")

    # ---- weights ------------------------------------------------------------------------
    def stage(self, version: int, *, hold: bool = False) -> bool:
        """Weights of `version` were received (replacing any staged before). Returns whether
        to apply them at once because nothing runs and nothing holds them; with partial
        rollout `due()` also says so while requests run (at the next step boundary)."""
        self._staged = version
        self._held = hold or self._running > 0
        return not self._held

    def due(self) -> bool:
        """Whether the staged weights are to be applied now, without a request asking for them:
        nothing runs and they are not held, or partial rollout (at the step boundary)."""
        return self._staged is not None and (
            self.policy.switches_running or (self._running == 0 and not self._held))

    def can_switch(self) -> bool:
        """Whether a waiting request may have the staged weights applied now: nothing runs on
        the hosted version (or partial rollout, where running requests go on under them)."""
        return self._staged is not None and (self.policy.switches_running or self._running == 0)

    def apply(self) -> int:
        """The staged weights are now in use (the engine copied them in); returns their
        version."""
        if self._staged is None:
            raise ValueError(f"apply with nothing staged: the gate {self._state()}")
        if self._running and not self.policy.switches_running:
            raise ValueError(f"cannot apply version {self._staged}: the gate {self._state()}, "
                             "and its running requests must end on their version (C1)")
        self._hosted, self._staged, self._held = self._staged, None, False
        return self._hosted

    # ---- requests -----------------------------------------------------------------------
    def admit(self, version: int | None, *, waited: bool = False, resumed: bool = False,
              who: str = "a request") -> Admission:
        """What a request asking for `version` does now (`waited`: it was told to WAIT before,
        so it takes the newest weights even past its version; not when `resumed`: it carries
        tokens of `version`, which newer weights must not continue, C1). `who` names it in
        errors."""
        need = self.policy.need(version)
        if need is None:
            return Admission.JOIN if self._staged is None else Admission.WAIT
        if need == self._hosted:
            return Admission.JOIN
        if need < self._hosted:
            return Admission.JOIN if waited and not resumed else Admission.REFUSE
        if self._staged is None or self._staged < need:
            raise ValueError(f"{who} needs version {need}; this engine hosts {self._hosted} "
                             f"and has {'nothing' if self._staged is None else self._staged} "
                             "staged")
        return Admission.WAIT

    def started(self, count: int = 1) -> int:
        """`count` admitted requests start; returns the version they start on."""
        if count < 0:
            raise ValueError(f"started({count}): a count of requests is >= 0")
        self._running += count
        return self._hosted

    def finished(self, count: int = 1) -> None:
        """`count` running requests gave their final result (or left the engine)."""
        if count < 0 or count > self._running:
            raise ValueError(f"finished({count}): the gate {self._state()}")
        self._running -= count

    # ---- tokens -------------------------------------------------------------------------
    def token_version(self) -> int:
        """The version a token sampled now carries."""
        return self._hosted

    def may_continue(self, started_on: int) -> bool:
        """Whether a running request that started on version `started_on` may sample its next
        token now: on its own version, or anywhere with partial rollout."""
        return started_on == self._hosted or self.policy.switches_running


async def wait_for_admission(gate: VersionGate, version: int | None, who: str, *,
                             apply_staged: Callable[[], Awaitable[None] | None],
                             drained: asyncio.Event,
                             not_switching: asyncio.Event | None = None,
                             resumed: bool = False) -> bool:
    """The engines' side of `admit`'s WAIT, written once: ask, and while the answer is WAIT,
    either apply the staged weights (`can_switch`) or wait for the running requests to drain
    (`drained`), then ask again with `waited=True`. True: JOIN; False: REFUSE. Returns with no
    await after its last `admit`, so the caller's `started` is on the version admitted.
    `not_switching`: an engine whose weight copy awaits (vLLM) asks only while it is set."""
    waited = False
    while True:
        if not_switching is not None:
            await not_switching.wait()
        admission = gate.admit(version, waited=waited, resumed=resumed, who=who)
        if admission is not Admission.WAIT:
            return admission is Admission.JOIN
        if gate.can_switch():
            applied = apply_staged()
            if inspect.isawaitable(applied):
                await applied
        else:
            await drained.wait()
        waited = True
