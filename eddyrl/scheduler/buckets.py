"""Libra's causality-guided bucket scheduler: which rollout instance runs a request, and when to
move it to a bucket sized for what it has left to generate.

Instances are grouped into buckets by the longest output they are provisioned for (e.g. short:
TP2, <= 3000 tokens; long: TP4, <= 32768). A request's length is predicted from what already
happened to it, not from its prompt: each tool return is summarised as a `ToolState` (tool,
payload size class, status), and a request's path of states keys a prefix tree whose nodes keep
the remaining output tokens observed after reaching them (last `window` requests; mean and P90
refreshed every `rebuild_every` finished requests). There is one tree per prompt and a global
one. Single-turn generation uses generated-length milestones as states instead (`Milestone`),
which makes the router a multi-level feedback queue. The config and the worker -> bucket
assignment are `routing_config.py` (re-exported here).

New requests start in the smallest bucket. At each state the router takes the deepest node on
the request's path with at least `min_observations` (at equal depth the prompt tree wins over the
global one), maps `tokens_so_far + mean` and `tokens_so_far + P90` to the smallest bucket that
fits each, and moves the request only if both land in the same bucket and it is not the current
one: a heavy tail (mean fits, P90 does not) is not trusted either way. Within a bucket, the
instance with the fewest connections is chosen. A move either re-prefills the prefix on the
target ("recompute") or moves the KV cache ("carry_kv", only between engines that both support
it), whichever the injected cost functions say is cheaper; `cost_model.py` plugs in there.

In a run, the version assignment says which workers may take a request now (C1: a worker
hosting its version, or free to switch to it; not one lent to training): every placement and
move is made among those (`allowed`), and a move whose target bucket has none is not made.
Moves made by others (DORA's consolidation, a restart) are reported with `relocate`.

The baselines are settings of the same router, and never move a request:
- round_robin: cycles over all instances, buckets ignored;
- least_load: the instance with the fewest connections overall;
- fifo: the bucket policy with prediction off (smallest bucket, least connections, no moves),
  so comparing it with "bucket" isolates what causality-guided moves buy.

Simplified: when only a shallower node is trusted, its remaining length is used as the remaining
length now, although it was measured from an earlier point; the estimate errs long. Sans-IO: no
clock, no randomness; ties fall back to the order buckets and instances are listed in.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, NamedTuple, Sequence

from ..errors import ConfigError
from .prefix_tree import Milestone, NodeStats, Prediction, PrefixTrees, State, milestone_state, p90
from ..protocol import ToolState
from .routing_config import (BucketSpec, RoutingConfig, bucket_instances, bucket_of_worker,
                             consecutive, worker_batch_size)

__all__ = ["BucketRouter", "BucketSpec", "Milestone", "Move", "NodeStats", "Placement",
           "Prediction", "PrefixTrees", "RoutingConfig", "RoutingError", "RoutingStats",
           "ToolState", "bucket_instances", "bucket_of_worker", "milestone_state", "p90",
           "worker_batch_size"]

# -- states ------------------------------------------------------------------------------------

class Placement(NamedTuple):
    bucket: str
    instance: int


@dataclass(frozen=True, slots=True)
class Move:
    """Move a running request from `source` to `target`: re-prefill its tokens there
    ("recompute") or move its KV cache ("carry_kv")."""

    request_id: str
    source: Placement
    target: Placement
    how: str


# Seconds to move a request of `tokens` tokens from one bucket to another; cost_model.py
# provides profiled ones.
MoveCostFn = Callable[[int, BucketSpec, BucketSpec], float]


@dataclass(frozen=True, slots=True)
class RoutingStats:
    connections: dict[str, int]  # running requests per bucket
    moves: int
    carry_kv_moves: int  # moves that carried the KV cache; the rest recomputed
    predictions: dict[str, int]  # bucket-policy routing decisions by source: prompt/global/none
    blocked: int = 0  # moves predicted but not made: no allowed instance in the target bucket


@dataclass(slots=True)
class _Request:
    prompt_id: str
    path: list[State] = field(default_factory=list)
    tokens_at_state: list[int] = field(default_factory=list)  # tokens_so_far at each state


class RoutingError(RuntimeError):
    """A call the router cannot honour: the caller broke the start/on_state/finish protocol."""


class _OwnPlacements:
    """Where each request runs, for a router used on its own (benchmarks, its tests): the
    router records its placements and moves here. The connection counts are kept with them,
    in `place` and `drop` only."""

    def __init__(self) -> None:
        self._where: dict[str, int] = {}
        self._load: Counter[int] = Counter()

    def worker_of(self, request_id: str) -> int:
        return self._where[request_id]

    def load(self, instance: int) -> int:
        return self._load[instance]

    def place(self, request_id: str, instance: int) -> None:
        self.drop(request_id)
        self._where[request_id] = instance
        self._load[instance] += 1

    def drop(self, request_id: str) -> None:
        instance = self._where.pop(request_id, None)
        if instance is not None:
            self._load[instance] -= 1


class _Followed:
    """Where each request runs, read from a rollout's request table (`follow`): the table is
    the only record of a request's place; the router's placements and moves are carried out
    there by the rollout, so nothing is recorded here."""

    def __init__(self, table) -> None:
        self.table = table

    def worker_of(self, request_id: str) -> int:
        return self.table.worker_of(request_id)

    def load(self, instance: int) -> int:
        return self.table.load(instance)

    def place(self, request_id: str, instance: int) -> None:
        return None  # the rollout adds the request to its table at `instance`

    def drop(self, request_id: str) -> None:
        return None


class BucketRouter:
    def __init__(self, config: RoutingConfig, instances: Mapping[str, Sequence[int]], *,
                 recompute_seconds: MoveCostFn | None = None,
                 carry_kv_seconds: MoveCostFn | None = None,
                 carry_kv_instances: Iterable[int] = ()) -> None:
        """`instances` maps each bucket name to its instance ids. A move carries the KV cache
        only if both ends are in `carry_kv_instances` and both cost functions are given and
        say it is cheaper; otherwise it recomputes."""
        config.validate("routing")
        if config.policy == "none":
            raise ConfigError("routing.policy = 'none' means no router; build none")
        self.config = config
        self.trees = PrefixTrees(config.window, config.rebuild_every, config.min_observations)
        self.specs = {spec.name: spec for spec in config.buckets}
        self._check_instances(instances)
        self._use({name: list(instances[name]) for name in self.specs})
        self._all = frozenset(self._bucket_of)
        self._placements: _OwnPlacements | _Followed = _OwnPlacements()
        self.recompute_seconds = recompute_seconds
        self.carry_kv_seconds = carry_kv_seconds
        self.carry_kv_instances = frozenset(carry_kv_instances)
        self._requests: dict[str, _Request] = {}
        self._moves = self._carry_kv_moves = self._blocked = 0
        self._predictions = {"prompt": 0, "global": 0, "none": 0}

    def follow(self, table) -> None:
        """Read where requests run, and each instance's connections, from `table` (a
        `core.requests.RequestTable`: `worker_of(request_id)`, `load(instance)`) instead of
        recording them: the caller places and moves requests there."""
        if self._requests:
            raise RoutingError("follow() must come before the first request starts")
        self._placements = _Followed(table)

    def _connections(self, instance: int) -> int:
        return self._placements.load(instance)

    # -- protocol --------------------------------------------------------------------------------

    def start(self, request_id: str, prompt_id: str,
              allowed: Collection[int] | None = None) -> Placement:
        """Place a new request on one of the `allowed` instances (None: any)."""
        if request_id in self._requests:
            raise RoutingError(f"request {request_id!r} is already started")
        candidates = self._candidates(allowed)
        policy = self.config.policy
        if policy == "round_robin":
            instance = next(i for i in self._round_robin if i in candidates)
        elif policy == "least_load":
            instance = min((i for i in self._bucket_of if i in candidates),
                           key=self._connections)
        else:  # bucket, fifo: the smallest bucket with an allowed instance
            bucket = next(spec.name for spec in self.config.buckets
                          if any(i in candidates for i in self.instances[spec.name]))
            instance = self._least_connected(bucket, candidates)
        self._requests[request_id] = _Request(prompt_id)
        self._placements.place(request_id, instance)
        return Placement(self._bucket_of[instance], instance)

    def set_layout(self, layout: Sequence[int]) -> None:
        """Give the buckets `layout[b]` instances each, consecutive in bucket order (the
        adaptive scheduler's bucket layout). Running requests stay on their instance; those
        whose instance changed bucket now count as that bucket's."""
        if len(layout) != len(self.config.buckets) or min(layout) < 1 or \
                sum(layout) != len(self._bucket_of):
            raise RoutingError(f"layout {list(layout)} must give each of the "
                               f"{len(self.config.buckets)} buckets at least one of the "
                               f"{len(self._bucket_of)} instances, all of them in all")
        self._use(consecutive(list(self.specs), layout, sorted(self._bucket_of)))

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(len(self.instances[spec.name]) for spec in self.config.buckets)

    def relocate(self, request_id: str, instance: int) -> None:
        """Someone else moved the request to `instance` (a version consolidation, a restart):
        keep the connection counts and its bucket true. Its path and statistics stay. A
        router that `follow`s a table reads the move from there: nothing to do."""
        self._request(request_id)
        if instance not in self._bucket_of:
            raise RoutingError(f"request {request_id!r}: instance {instance} is in no bucket")
        self._placements.place(request_id, instance)

    def on_state(self, request_id: str, state: State, tokens_so_far: int,
                 allowed: Collection[int] | None = None) -> Move | None:
        """A tool returned (or a milestone passed) after `tokens_so_far` output tokens: record
        the state and return the move to make, if any, to one of the `allowed` instances (the
        caller must then carry it out)."""
        request = self._request(request_id)
        if request.tokens_at_state and tokens_so_far < request.tokens_at_state[-1]:
            raise RoutingError(f"request {request_id!r}: tokens_so_far = {tokens_so_far} is "
                               f"below the {request.tokens_at_state[-1]} reported before")
        request.path.append(state)
        request.tokens_at_state.append(tokens_so_far)
        return self._route(request_id, request, tokens_so_far, allowed)

    def on_progress(self, request_id: str, generated_tokens: int,
                    allowed: Collection[int] | None = None) -> Move | None:
        """Single-turn generation: enter every milestone `generated_tokens` has passed since the
        last call (each at its own token count, so paths stay comparable however often the
        caller reports), then route once."""
        request = self._request(request_id)
        reached = milestone_state(generated_tokens, self.config.milestones)
        entered = sum(isinstance(state, Milestone) for state in request.path)
        if reached is None or reached.index < entered:
            return None
        for index in range(entered, reached.index + 1):
            request.path.append(Milestone(index))
            request.tokens_at_state.append(self.config.milestones[index])
        return self._route(request_id, request, generated_tokens, allowed)

    def finish(self, request_id: str, total_tokens: int) -> None:
        """The request ended after `total_tokens` output tokens: free its connection and learn
        from it. The router already knows its path, and the tokens at each state, so the
        remaining length after every prefix follows."""
        request = self._request(request_id)
        reached = request.tokens_at_state[-1] if request.tokens_at_state else 0
        if total_tokens < reached:
            raise RoutingError(f"request {request_id!r} finished with {total_tokens} tokens, "
                               f"fewer than the {reached} it had at its last state")
        remaining = [total_tokens] + [total_tokens - t for t in request.tokens_at_state]
        self.trees.observe(request.prompt_id, request.path, remaining)
        self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """The request was aborted: free its connection without learning from it (a cut-short
        length would bias the predictions short)."""
        self._request(request_id)
        del self._requests[request_id]
        self._placements.drop(request_id)

    # -- queries ---------------------------------------------------------------------------------

    def placement(self, request_id: str) -> Placement:
        self._request(request_id)
        instance = self._placements.worker_of(request_id)
        return Placement(self._bucket_of[instance], instance)

    def stats(self) -> RoutingStats:
        per_bucket = {name: sum(self._connections(i) for i in ids)
                      for name, ids in self.instances.items()}
        return RoutingStats(per_bucket, self._moves, self._carry_kv_moves,
                            dict(self._predictions), self._blocked)

    def bucket_for(self, total_tokens: float) -> str:
        """The smallest bucket whose max_tokens fits `total_tokens`; the largest if none does."""
        for spec in self.config.buckets:
            if total_tokens <= spec.max_tokens:
                return spec.name
        return self.config.buckets[-1].name

    # -- internals -------------------------------------------------------------------------------

    def _route(self, request_id: str, request: _Request, tokens_so_far: int,
               allowed: Collection[int] | None) -> Move | None:
        if self.config.policy != "bucket":
            return None  # baselines never move a request
        prediction = self.trees.predict(request.prompt_id, request.path)
        self._predictions[prediction.source if prediction else "none"] += 1
        if prediction is None:
            return None
        by_mean = self.bucket_for(tokens_so_far + prediction.mean)
        by_p90 = self.bucket_for(tokens_so_far + prediction.p90)
        source = self.placement(request_id)
        if by_mean != by_p90 or by_mean == source.bucket:
            return None
        candidates = self._candidates(allowed)
        if not any(i in candidates for i in self.instances[by_mean]):
            self._blocked += 1  # e.g. its version is hosted by no instance of that bucket
            return None
        target = Placement(by_mean, self._least_connected(by_mean, candidates))
        how = self._how_to_move(tokens_so_far, source, target)
        self._placements.place(request_id, target.instance)
        self._moves += 1
        if how == "carry_kv":
            self._carry_kv_moves += 1
        return Move(request_id, source, target, how)

    def _how_to_move(self, tokens: int, source: Placement, target: Placement) -> str:
        both_carry = {source.instance, target.instance} <= self.carry_kv_instances
        if not both_carry or self.carry_kv_seconds is None or self.recompute_seconds is None:
            return "recompute"  # always possible: the target re-prefills the tokens so far
        src, dst = self.specs[source.bucket], self.specs[target.bucket]
        carry = self.carry_kv_seconds(tokens, src, dst)
        return "carry_kv" if carry < self.recompute_seconds(tokens, src, dst) else "recompute"

    def _use(self, instances: dict[str, list[int]]) -> None:
        """Instances per bucket, and what follows from them."""
        self.instances = instances
        self._bucket_of = {i: name for name, ids in instances.items() for i in ids}
        self._round_robin = itertools.cycle(list(self._bucket_of))

    def _least_connected(self, bucket: str, candidates: Collection[int]) -> int:
        return min((i for i in self.instances[bucket] if i in candidates),
                   key=self._connections)

    def _candidates(self, allowed: Collection[int] | None) -> Collection[int]:
        if allowed is None:
            return self._all
        unknown = sorted(set(allowed) - self._all)
        if unknown or not allowed:
            raise RoutingError(f"allowed instances {sorted(allowed)} must be a non-empty "
                               f"subset of {sorted(self._all)}")
        return allowed

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise RoutingError(f"request {request_id!r} is not running (never started, or "
                               f"already finished)") from None

    def _check_instances(self, instances: Mapping[str, Sequence[int]]) -> None:
        unknown = sorted(set(instances) - set(self.specs))
        if unknown:
            raise ConfigError(f"instances name unknown bucket(s) {unknown}; configured "
                              f"buckets: {list(self.specs)}")
        empty = [name for name in self.specs if not instances.get(name)]
        if empty:
            raise ConfigError(f"bucket(s) {empty} have no instance; give each configured "
                              f"bucket at least one (got {dict(instances)})")
        ids = [i for name in self.specs for i in instances[name]]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ConfigError(f"instance(s) {repeated} appear more than once in "
                              f"{dict(instances)}; each instance belongs to one bucket")
