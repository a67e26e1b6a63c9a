"""Calls to a run's actors, named (who, doing what) and with a deadline (`cluster.timeout_s`):
a failure becomes one `WorkerCallError` line that starts with its cause (`errors.py`; the
traceback goes to the run's worker_errors.log), and a lost GCS or raylet becomes `RayLost`,
whatever call was in flight. One `RayCalls` per runtime, shared by the runtime (its trainer
ranks) and the rollout actor set (`rollout_actors.py`)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, Awaitable

from ... import disk_full
from ...run_dir import open_append
from ...errors import EddyError, RayLost, WorkerCallError
from .errors import cause_line, plain
from .session import LocalRaySession


class RayCalls:
    def __init__(self, session: LocalRaySession | None, timeout_s: float,
                 error_log: Path) -> None:
        self.session = session  # None when joining a cluster: Ray's processes are not watched
        self.timeout_s = timeout_s
        self.error_log = error_log  # a failure's full traceback, where its one line points
        self._ray_lost_future: asyncio.Future | None = None

    async def call(self, who: str, what: str, ref: Any) -> Any:
        import ray

        try:
            return await self._awaited(ref)
        except asyncio.TimeoutError:
            raise WorkerCallError(f"{who} did not finish {what} within {self.timeout_s:.0f} s "
                                  "(cluster.timeout_s)") from None
        except ray.exceptions.RayError as exc:
            self.raise_if_ray_lost(exc)
            raise WorkerCallError(f"{who} failed during {what}: {self.reason(who, what, exc)}"
                                  ) from exc

    async def call_all(self, calls: list[tuple[str, str, Any]]) -> list[Any]:
        """`call` for each (who, what, ref), together."""
        return await asyncio.gather(*(self.call(*c) for c in calls))

    def get_all(self, calls: list[tuple[str, str, Any]]) -> list[Any]:
        """`call` for the few calls made outside the event loop (start-up, the channel)."""
        import ray

        results = []
        for who, what, ref in calls:
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise WorkerCallError(f"{who} did not finish {what} within "
                                      f"{self.timeout_s:.0f} s (cluster.timeout_s)") from None
            except ray.exceptions.RayError as exc:
                self.raise_if_ray_lost(exc)
                raise WorkerCallError(f"{who} failed during {what}: "
                                      f"{self.reason(who, what, exc)}") from exc
        return results

    def reason(self, who: str, what: str, exc: BaseException) -> str:
        """A worker's failure in one line, its cause first; a traceback goes to worker_errors.log
        in the run directory, and the line says so."""
        line, text = cause_line(exc), plain(str(exc)).strip()
        full = disk_full.find(exc)  # however deep it was wrapped (a CheckpointException's)
        if full is not None and os.strerror(full.code) not in line:
            line = f"{full} (leading to {line})"
        if "\n" not in text:
            return line
        try:
            with open_append(self.error_log) as log:  # never through a link
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {who} failed during "
                          f"{what}\n{text}\n")
        except (OSError, EddyError) as unwritable:  # a full disk (the log is on it), a link
            # put there during the run: to stderr instead
            print(f"eddy: {who} failed during {what} ({self.error_log} could not be written: "
                  f"{unwritable}):\n{text}", file=sys.stderr, flush=True)
            return f"{line} (traceback above, on stderr)"
        return f"{line} (traceback: {self.error_log})"

    # ---- Ray itself lost -------------------------------------------------------------------
    def raise_if_ray_lost(self, exc: BaseException | None = None) -> None:
        """A worker call failed: if Ray's GCS or raylet is gone, that is what to report."""
        why = self.session.lost() if self.session is not None else None
        if why is not None:
            raise RayLost(why) from exc

    def _ray_lost(self) -> asyncio.Future | None:
        """A future of the running loop that gets the reason when the GCS or raylet dies (the
        session's watch tells it); None when joining a cluster (not watched)."""
        if self.session is None:
            return None
        loop = asyncio.get_running_loop()
        if self._ray_lost_future is None or self._ray_lost_future.get_loop() is not loop:
            future = self._ray_lost_future = loop.create_future()

            def resolve(why: str) -> None:  # from the watch's thread
                try:
                    loop.call_soon_threadsafe(
                        lambda: None if future.done() else future.set_result(why))
                except RuntimeError:  # that loop is closed: its run is over
                    pass

            self.session.on_lost(resolve)
        return self._ray_lost_future

    async def _awaited(self, call: Awaitable[Any]) -> Any:
        """`await call` within cluster.timeout_s (else TimeoutError), unless the GCS or raylet
        dies first: then RayLost, whatever the call was (a lost GCS fails no actor call for a
        minute; then Ray ends the driver without a word)."""
        lost = self._ray_lost()
        if lost is None:
            return await asyncio.wait_for(call, self.timeout_s)
        if lost.done():
            if asyncio.iscoroutine(call):
                call.close()  # never started: not an "never awaited" warning at exit
            raise RayLost(lost.result())
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait((task, lost), timeout=self.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if lost.done():
            raise RayLost(lost.result())
        if task not in done:
            raise asyncio.TimeoutError
        return task.result()
