"""The rollout's I/O with its workers: generation calls and aborts sent to the runtime, results
streamed back to one handler, background tasks, and the failures they surface.

- `send` builds an engine request from a table record (fresh, or resumed from a partial
  output) and batches it per worker and version with the others of this moment (an engine
  admits a call by its version); `abort` batches aborts
  the same way. Results of one decode step arrive together, so the resumes and aborts they
  cause go out as one call per worker (`_flush`).
- Each generation call runs as a background task; its results go to `on_result(worker,
  result)` unless the worker was lost since the call started (`incarnation`: results of a
  lost incarnation are dropped, their requests were put back already), or the result is not
  one the call owes (a request it was not given, anything after a request's final): such
  results are counted (`stray`, by why), named in a warning, and ignored.
- A failure in a task is kept and re-raised to whoever waits next, except the loss of a
  worker's process (`WorkerLost`), which goes to `on_lost(worker, error)`. A BaseException
  that is not an Exception (KeyboardInterrupt) is re-raised at once as well.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Awaitable, Callable

from ..errors import WorkerLost
from ..protocol import GenerationRequest, GenerationResult
from ..runtime_protocol import Runtime
from .requests import Purpose, Request

log = logging.getLogger("eddyrl.rollout")


class Streams:
    def __init__(self, runtime: Runtime, on_result: Callable[[int, GenerationResult], None],
                 on_lost: Callable[[int, WorkerLost], None],
                 report_at: tuple[int, ...] = ()) -> None:
        self.runtime = runtime
        self.on_result = on_result
        self.on_lost = on_lost
        self.report_at = report_at  # length milestones the engines report (the router's)
        self.incarnation: Counter[int] = Counter()  # per worker: how often its process died
        self.stray: Counter[str] = Counter()  # results ignored, by why
        self._tasks: set[asyncio.Task] = set()
        # per worker: records to send, with the partial output they resume from
        self._sends: dict[int, list[tuple[Request, GenerationResult | None]]] = {}
        self._aborts: dict[int, list[str]] = {}
        self._flush_scheduled = False
        self._failure: BaseException | None = None
        self._progress: asyncio.Event | None = None

    # -- sending ---------------------------------------------------------------------------

    def send(self, request: Request, partial: GenerationResult | None = None, *,
             now: bool = False) -> None:
        """Generate `request` on its worker: from its prompt, or resumed from `partial`'s
        tokens (a migration's abort, an episode's transcript). Batched per worker with the
        other sends of this moment, unless `now` (a dispatch sends its batch itself)."""
        if partial is not None and partial.token_ids:
            request.resumed = True
        self._sends.setdefault(request.worker, []).append((request, partial))
        if now:
            self.flush_sends()
        else:
            self._schedule_flush()

    def engine_request(self, request: Request, partial: GenerationResult | None = None
                       ) -> GenerationRequest:
        group = request.group
        # the engine's trace tells evaluation from generation for training (refills are that)
        purpose = "eval" if request.purpose is Purpose.EVAL else "train"
        if partial is None:
            return GenerationRequest(request.id, group.prompt_ids, request.sampling,
                                     version=request.version, report_at=self.report_at,
                                     priority=request.priority, purpose=purpose)
        return GenerationRequest(request.id, partial.prompt_ids, request.sampling,
                                 resume_ids=partial.token_ids,
                                 resume_logprobs=partial.logprobs,
                                 resume_versions=partial.versions,
                                 resume_experts=partial.routed_experts,
                                 version=request.version,
                                 report_at=self.report_at, priority=request.priority,
                                 purpose=purpose)

    def abort(self, worker: int, request_id: str) -> None:
        """Abort `request_id` on `worker` (batched per worker, as sends are)."""
        self._aborts.setdefault(worker, []).append(request_id)
        self._schedule_flush()

    async def abort_now(self, worker: int, request_ids: list[str]) -> None:
        """Abort at once and wait for the runtime to take it (DORA's rebalance)."""
        await self._abort_on(worker, request_ids)

    def forget_worker(self, worker: int) -> list[str]:
        """A lost worker: what was batched for it is never sent. Returns those request ids
        (their records say what happens to them)."""
        self._aborts.pop(worker, None)
        return [request.id for request, _ in self._sends.pop(worker, [])]

    def flush_sends(self) -> None:
        sends, self._sends = self._sends, {}
        for worker, batch in sends.items():
            # one call per version: an engine admits a call by its version (C1); the version
            # is the record's now (a weight publish may have relabelled it since `send`).
            # And per purpose, so that a trace tells evaluation from generation.
            calls: dict[tuple[int, bool], list[GenerationRequest]] = {}
            for request, partial in batch:
                calls.setdefault((request.version, request.purpose is Purpose.EVAL), []).append(
                    self.engine_request(request, partial))
            for requests in calls.values():
                self.start_task(self._stream(worker, requests))

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.flush_sends()
        aborts, self._aborts = self._aborts, {}
        for worker, ids in aborts.items():
            self.start_task(self._abort_on(worker, ids))

    # -- receiving -------------------------------------------------------------------------

    async def _stream(self, worker: int, requests: list[GenerationRequest]) -> None:
        """One generation call: each of its requests gets one final result from it; anything
        else it reports (a request it was not given, anything after a request's final) is
        stray, counted and ignored, before it reaches the request's record (a later run of
        the same request, on the same worker, must not take it for its own)."""
        incarnation = self.incarnation[worker]
        open_ids = {r.request_id for r in requests}
        given = set(open_ids)
        try:
            async for result in self.runtime.generate(worker, requests):
                if self.incarnation[worker] != incarnation:
                    self.stray_result(worker, result, "old_incarnation")
                    return  # the worker was lost meanwhile; its requests run elsewhere now
                if result.request_id not in open_ids:
                    self.stray_result(worker, result, "unknown_request"
                                      if result.request_id not in given else
                                      "duplicate_final" if result.final else
                                      "progress_after_final")
                    continue
                if result.final:
                    open_ids.discard(result.request_id)
                self.on_result(worker, result)
        except WorkerLost as lost:
            if self.incarnation[worker] == incarnation:
                self._lost(worker, lost)
        except BaseException as exc:  # surfaced to whoever waits next
            self.fail(exc)

    async def _abort_on(self, worker: int, request_ids: list[str]) -> None:
        incarnation = self.incarnation[worker]
        try:
            await self.runtime.abort(worker, request_ids)
        except WorkerLost as lost:
            if self.incarnation[worker] == incarnation:
                self._lost(worker, lost)
        except BaseException as exc:  # surfaced to whoever waits next
            self.fail(exc)

    def stray_result(self, worker: int, result: GenerationResult, why: str) -> None:
        """A result that is not its request's current one: counted and ignored, named."""
        self.stray[why] += 1
        log.warning("ignored a result from worker %d for request %s (%s; final=%s)",
                    worker, result.request_id, why.replace("_", " "), result.final)

    def _lost(self, worker: int, lost: WorkerLost) -> None:
        try:
            self.on_lost(worker, lost)
        except BaseException as exc:  # surfaced to whoever waits next
            self.fail(exc)

    # -- tasks, failures, waiting ----------------------------------------------------------

    def start_task(self, coroutine: Awaitable) -> None:
        """Run `coroutine` in the background; `drain` waits for it (wrap it in `guarded` to
        surface its failure)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def guarded(self, coroutine: Awaitable) -> None:
        """Await `coroutine`; a failure is surfaced to whoever waits next."""
        try:
            await coroutine
        except BaseException as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.wake()
        if not isinstance(exc, Exception):
            raise exc

    def raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def progress(self) -> asyncio.Event:
        if self._progress is None:
            self._progress = asyncio.Event()
        return self._progress

    def wake(self) -> None:
        self.progress().set()

    async def wait(self, futures: list[asyncio.Future]) -> None:
        """Until every future is done, re-raising a failure as soon as one is surfaced."""
        while not all(f.done() for f in futures):
            self.raise_failure()
            self.progress().clear()
            pending = [f for f in futures if not f.done()]
            waker = asyncio.ensure_future(self.progress().wait())
            await asyncio.wait([*pending, waker], return_when=asyncio.FIRST_COMPLETED)
            waker.cancel()
        self.raise_failure()

    async def drain(self) -> None:
        """Until no background task is left."""
        while self._tasks or self._sends or self._aborts:
            self.flush_sends()
            if self._aborts:
                self._flush()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.raise_failure()
