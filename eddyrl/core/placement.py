"""Which worker runs a request, among those the version assignment allows: one object per way
of deciding, so the rollout asks the same questions with or without Libra's router.

- `GroupPlacement` (no routing): a group's requests go together to the assignment's pick for
  their version (one prefix, one worker's cache); nothing moves on progress.
- `RoutedPlacement` (routing on): each request to the bucket router's choice among the
  allowed workers, and at length milestones or tool returns the router may move it to a
  worker of another bucket. The router reads where requests run and each worker's
  connections from the rollout's request table (`BucketRouter.follow`); it records only the
  paths it learns from.

A placement returns None when no worker can take the request now (every worker lost or
lent): the request waits, parked, for one to come back.
"""

from __future__ import annotations

from ..protocol import ToolState
from ..scheduler.buckets import BucketRouter
from .requests import RequestTable
from .version_assignment import VersionAssignment


class GroupPlacement:
    report_at: tuple[int, ...] = ()

    def __init__(self, assignment: VersionAssignment) -> None:
        self.assignment = assignment

    def place(self, request_id: str, prompt: str, version: int, worker: int | None,
              first: int | None) -> int | None:
        """A new request of `version`; `worker`: the caller's choice; `first`: where its
        group's first request went (None for the first)."""
        if first is not None:
            return first
        if worker is not None:
            return worker
        return self.assignment.pick(version) if any(self.assignment.available) else None

    def place_again(self, request_id: str, prompt: str, version: int) -> int | None:
        """A request starting over from scratch on `version`."""
        return self.assignment.pick(version) if any(self.assignment.available) else None

    def progress(self, request_id: str, tokens: int, allowed: list[int]) -> int | None:
        return None

    def tool_state(self, request_id: str, state: ToolState, tokens: int,
                   allowed: list[int]) -> int | None:
        return None

    def finished(self, request_id: str, tokens: int, learn: bool) -> str | None:
        """The request ended with `tokens` output tokens; its bucket, if any."""
        return None

    def cancel(self, request_id: str) -> None:
        return None


class RoutedPlacement:
    def __init__(self, assignment: VersionAssignment, router: BucketRouter,
                 table: RequestTable) -> None:
        self.assignment = assignment
        self.router = router
        router.follow(table)  # the rollout's: placements and connections
        config = router.config
        self.report_at = tuple(config.milestones) if config.policy == "bucket" else ()

    def place(self, request_id: str, prompt: str, version: int, worker: int | None,
              first: int | None) -> int | None:
        if worker is None and not any(self.assignment.available):
            return None
        allowed = [worker] if worker is not None else self.assignment.eligible(version)
        return self.router.start(request_id, prompt, allowed).instance

    def place_again(self, request_id: str, prompt: str, version: int) -> int | None:
        """From scratch: a new path, from the smallest bucket (`cancel` dropped the old)."""
        if not any(self.assignment.available):
            return None
        return self.router.start(request_id, prompt,
                                 self.assignment.eligible(version)).instance

    def progress(self, request_id: str, tokens: int, allowed: list[int]) -> int | None:
        move = self.router.on_progress(request_id, tokens, allowed)
        return None if move is None else move.target.instance

    def tool_state(self, request_id: str, state: ToolState, tokens: int,
                   allowed: list[int]) -> int | None:
        move = self.router.on_state(request_id, state, tokens, allowed)
        return None if move is None else move.target.instance

    def finished(self, request_id: str, tokens: int, learn: bool) -> str | None:
        """Learn from complete training samples only (`learn`); returns the bucket it ran in."""
        bucket = self.router.placement(request_id).bucket
        if learn:
            self.router.finish(request_id, tokens)
        else:
            self.router.cancel(request_id)
        return bucket

    def cancel(self, request_id: str) -> None:
        self.router.cancel(request_id)
