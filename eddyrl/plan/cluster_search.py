"""The staged search of `eddy plan --cluster`: which mode, split, K, concurrency and bucket
layout train fastest on a simulated cluster, within a budget of simulated runs.

Sans-IO: the search asks an `Evaluator` (a candidate in, its steady-step numbers out) and
never simulates itself, so its order and its budget are tested on a stub (cluster.py runs the
simulator). A simulated run costs seconds to a minute at cluster scale, so the search is
staged, each stage starting from the best found so far:

1. modes: every registry mode at the scenario's own split. Always run in full: the first
   choice is then at least as fast as the best registry mode at the default split (the
   ranking is one total order over everything evaluated, stage 1 included).
2. split: for the `top_modes` best modes that have a split (colocated time-shares all
   devices), other rollout / training splits in multiples of each role's tp, an eighth, a
   quarter, ... of the devices moved; those giving devices to the busier role (the other one
   idles more) first.
3. tune: the best candidate, one setting at a time (K, groups in flight, rollout batch size,
   bucket layout), each adopted when it is faster; K only where the mode already lags
   (K >= 1: K = 0 is what makes sync and colocated what they are).

Faster means more trained samples per second over the steady steps (all but the first, which
fills the pipeline), as `eddy bench sim` measures its speed-up; step time breaks ties.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration to simulate: a registry mode on a split, with settings that replace
    the mode's own (None: the mode's, with its scenario hook's)."""

    mode: str
    rollout_devices: int
    train_devices: int
    max_staleness: int | None = None  # window.max_staleness (K)
    inflight: int | None = None  # window.max_inflight_prompts
    batch_size: int | None = None  # sim.rollout.max_batch_size
    long_workers: int | None = None  # instances of the `bucket` layout's long bucket

    @property
    def split(self) -> str:
        return f"{self.rollout_devices}:{self.train_devices}"


@dataclass(slots=True)
class Outcome:
    """A candidate's simulated numbers over the steady steps, or why it could not run.
    `settings`: what it ran with (K, inflight, batch_size, long_workers), for the next stage."""

    candidate: Candidate
    stage: str
    step_s: float = float("inf")
    samples_per_s: float = 0.0
    device_idle: float | None = None
    rollout_idle: float | None = None
    train_idle: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def rank_key(self) -> tuple[float, float]:
        return (-self.samples_per_s, self.step_s) if self.ok else (float("inf"), float("inf"))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.candidate), "split": self.candidate.split, "stage": self.stage,
                "step_s": self.step_s if self.ok else None,
                "samples_per_s": self.samples_per_s if self.ok else None,
                "device_idle": self.device_idle, "rollout_idle": self.rollout_idle,
                "train_idle": self.train_idle, "settings": self.settings,
                "error": self.error or None}


Evaluator = Callable[[Candidate, str], Outcome]  # (candidate, stage) -> outcome


@dataclass(frozen=True, slots=True)
class Space:
    """What the search may choose from, for one scenario."""

    modes: tuple[str, ...]
    rollout_devices: int  # the scenario's default split
    train_devices: int
    rollout_tp: int
    train_tp: int
    batch_prompts: int
    unsplit_modes: tuple[str, ...] = ("colocated",)  # a split means nothing to them
    top_modes: int = 2  # modes whose splits stage 2 tries
    staleness_choices: tuple[int, ...] = (1, 2, 3, 4)

    def splits(self) -> list[tuple[int, int]]:
        """Every (rollout, train) of the same total in multiples of each role's tp."""
        total = self.rollout_devices + self.train_devices
        return [(r, total - r) for r in range(self.rollout_tp, total, self.rollout_tp)
                if (total - r) >= self.train_tp and (total - r) % self.train_tp == 0]


@dataclass
class SearchResult:
    outcomes: list[Outcome]  # in the order run
    baseline: Outcome | None  # the best registry mode at the default split

    def ranked(self) -> list[Outcome]:
        return sorted((o for o in self.outcomes if o.ok), key=Outcome.rank_key)

    @property
    def runs(self) -> int:
        return sum(1 for o in self.outcomes if o.ok)


class _Budget:
    """Simulated runs left; a candidate that could not run (refused, or failed) costs none."""

    def __init__(self, evaluate: Evaluator, runs: int) -> None:
        self.evaluate, self.left = evaluate, runs
        self.seen: dict[Candidate, Outcome] = {}
        self.outcomes: list[Outcome] = []

    def run(self, candidate: Candidate, stage: str) -> Outcome | None:
        if candidate in self.seen:
            return self.seen[candidate]
        if self.left <= 0:
            return None
        outcome = self.evaluate(candidate, stage)
        self.seen[candidate] = outcome
        self.outcomes.append(outcome)
        if outcome.ok:
            self.left -= 1
        return outcome


def best(outcomes: Iterable[Outcome]) -> Outcome | None:
    ranked = sorted((o for o in outcomes if o.ok), key=Outcome.rank_key)
    return ranked[0] if ranked else None


def search(space: Space, evaluate: Evaluator, budget: int) -> SearchResult:
    """The staged search (module docstring) within `budget` simulated runs."""
    if budget < len(space.modes):
        raise ConfigError(f"--budget {budget} is too small: the search first runs every "
                          f"registry mode at the scenario's split ({len(space.modes)} runs)")
    runs = _Budget(evaluate, budget)
    modes = [runs.run(Candidate(m, space.rollout_devices, space.train_devices), "modes")
             for m in space.modes]
    baseline = best(o for o in modes if o is not None)
    if baseline is None:
        return SearchResult(runs.outcomes, None)
    _splits(space, runs, [o for o in modes if o is not None], share=(runs.left + 1) // 2)
    _tune(space, runs, best(runs.outcomes))
    return SearchResult(runs.outcomes, baseline)


# Devices moved from one role to the other, as shares of the cluster, the likeliest first: a
# small cluster has few splits, a large one too many to try, and a move of one tp at 1024
# devices would change nothing a short simulated run can tell apart.
SPLIT_MOVES = (1 / 8, 1 / 4, 1 / 16, 3 / 8)


def split_order(space: Space, outcome: Outcome) -> list[tuple[int, int]]:
    """Splits other than the default, nearest to each move of SPLIT_MOVES; those giving
    devices to the busier role (the other one idles more) first."""
    default, total = space.rollout_devices, space.rollout_devices + space.train_devices
    towards_rollout = (outcome.train_idle or 0.0) >= (outcome.rollout_idle or 0.0)
    order: list[tuple[int, int]] = []
    for sign in ((1, -1) if towards_rollout else (-1, 1)):
        side = [s for s in space.splits() if (s[0] - default) * sign > 0]
        for move in SPLIT_MOVES if side else ():
            split = min(side, key=lambda s: abs(s[0] - (default + sign * move * total)))
            if split not in order:
                order.append(split)
    return order


def _splits(space: Space, runs: _Budget, modes: list[Outcome], share: int) -> None:
    """Stage 2: up to `share` runs over the splits of the best split modes, taken round-robin
    (each mode's next split in turn) so that one mode's many splits cannot use them all."""
    chosen = sorted((o for o in modes if o.ok and o.candidate.mode not in space.unsplit_modes),
                    key=Outcome.rank_key)[:space.top_modes]
    queues = [[replace(o.candidate, rollout_devices=r, train_devices=t)
               for r, t in split_order(space, o)] for o in chosen]
    limit = runs.left - share
    while runs.left > limit and any(queues):
        for queue in queues:
            if queue and runs.left > limit:
                runs.run(queue.pop(0), "split")


def _tune(space: Space, runs: _Budget, start: Outcome | None) -> None:
    """Stage 3: one setting at a time around the best candidate."""
    current = start
    for dimension in (_staleness, _inflight, _batch_size, _layout):
        if current is None or runs.left <= 0:
            return
        tried = [runs.run(c, "tune") for c in dimension(space, current)]
        current = best([current, *(o for o in tried if o is not None)])


def _staleness(space: Space, outcome: Outcome) -> list[Candidate]:
    k = outcome.settings.get("max_staleness", 0)
    if not k:
        return []
    return [replace(outcome.candidate, max_staleness=v) for v in space.staleness_choices
            if v != k]


def _inflight(space: Space, outcome: Outcome) -> list[Candidate]:
    """Groups in flight at one and two batches (0, the window's own (K + 1) batches, is left
    out of sync modes, where one batch is all there is)."""
    if not outcome.settings.get("max_staleness", 0):
        return []
    now = outcome.settings.get("inflight", 0)
    values = [space.batch_prompts, 2 * space.batch_prompts, (3 * space.batch_prompts) // 2]
    return [replace(outcome.candidate, inflight=v) for v in values if v != now]


def _batch_size(space: Space, outcome: Outcome) -> list[Candidate]:
    now = outcome.settings.get("batch_size")
    if not now:
        return []
    return [replace(outcome.candidate, batch_size=v) for v in (now * 2, max(1, now // 2))]


def _layout(space: Space, outcome: Outcome) -> list[Candidate]:
    """One long-bucket instance more or fewer than the layout the mode ran."""
    now = outcome.settings.get("long_workers")
    if not now:
        return []
    return [replace(outcome.candidate, long_workers=v) for v in (now + 1, now - 1) if v >= 1]
