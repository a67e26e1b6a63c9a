"""What a run owns of the local Ray it starts (no `cluster.address`), from before `ray.init` to
after `ray.shutdown`:

- its own auth token: a fresh one in a 0600 file in a 0700 directory of its own, passed to
  Ray's processes as RAY_AUTH_TOKEN_PATH and removed when the session closes. Ray's default,
  ~/.ray/auth_token, is one 0644 file shared by every Ray cluster of the user. A token the
  user set (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) is left as it is.
- a reaper (`reaper.py`) that kills, by PID, whatever is left of the session's processes
  once the driver closes it or dies (Ray's agents outlive a killed driver by a minute).
- a watch on the GCS and the raylet: a run cannot go on without them, and Ray notices only
  after a minute (then it kills the driver without a word). `lost()` says which died and what
  to do; callbacks registered with `on_lost` hear it within WATCH_S.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from .reaper import NAMES, lost_line

WATCH_S = 1.0  # how often the GCS and raylet are looked at
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


class LocalRaySession:
    def __init__(self) -> None:
        self.token_dir: Path | None = None
        self._saved_env: dict[str, str | None] = {}
        self._reaper: subprocess.Popen | None = None
        self._reaper_pipe: int | None = None
        self._node = None  # Ray's node object: its processes and session directory
        self._lost: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    # ---- before ray.init -------------------------------------------------------------------
    def private_token(self) -> None:
        """Give the Ray about to start a token of its own, unless the user chose one."""
        if any(os.environ.get(name) for name in TOKEN_VARS) or \
                os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            return
        self.token_dir = Path(tempfile.mkdtemp(prefix="eddy-ray-token-"))  # 0700
        path = self.token_dir / "auth_token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate`
        self._saved_env = {name: os.environ.get(name) for name in TOKEN_VARS}
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)  # read by every process Ray starts
        # the driver's token loader caches the first token it reads: an earlier session's
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()

    # ---- after ray.init --------------------------------------------------------------------
    def started(self) -> None:
        """Ray is up: start the reaper and the watch on its GCS and raylet."""
        import ray

        self._node = ray._private.worker._global_node
        roots = [f"{kind}={info.process.pid}" for kind, infos in
                 self._node.all_processes.items() for info in infos]
        if sys.platform.startswith("linux"):
            read, self._reaper_pipe = os.pipe()  # not inherited by anything Ray starts later
            # run as a script (-I: the standard library only, no site packages): it starts fast
            # and needs nothing of this process
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", str(Path(__file__).with_name("reaper.py")),
                 self._node.get_logs_dir_path(), str(self.token_dir or "-"), *roots],
                stdin=read, stdout=subprocess.DEVNULL, start_new_session=True)
            os.close(read)
        threading.Thread(target=self._watch, name="eddy-ray-watch", daemon=True).start()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """Ray's own exit hook shuts it down too, but runs after this one (registered first)."""
        import ray

        if self._closed.is_set():
            return
        if ray.is_initialized():
            ray.shutdown()
        self.close()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            why = self.lost()
            if why is not None:
                self._tell_reaper(f"lost {why}")  # the reaper says it, should the driver die first
                with self._lock:
                    callbacks, self._callbacks = self._callbacks, []
                for callback in callbacks:
                    try:
                        callback(why)
                    except Exception:  # a callback's failure must not end the watch silently
                        pass
                return

    def lost(self) -> str | None:
        """None while Ray's GCS and raylet live; else one line: which died, what to do."""
        import ray

        if self._lost is not None or self._node is None or self._closed.is_set():
            return self._lost
        for kind in NAMES:
            for info in list(self._node.all_processes.get(kind, ())):
                code = info.process.poll()
                # ray.shutdown stops them too, once the driver has left (not initialized)
                if code is not None and ray.is_initialized():
                    how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and
                           -code in signal.valid_signals() else f"exited with code {code}")
                    self._lost = lost_line(kind, info.process.pid, how,
                                           self._node.get_logs_dir_path())
                    return self._lost
        return None

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """`callback(why)` once, from the watch's thread, when the GCS or raylet dies (at once
        if one already has)."""
        with self._lock:
            if self._lost is None:
                self._callbacks.append(callback)
                return
        callback(self._lost)

    def _tell_reaper(self, line: str) -> None:
        with self._lock:  # not while `close` closes the pipe (its number could be reused)
            try:
                if self._reaper_pipe is not None:
                    os.write(self._reaper_pipe, line.replace("\n", " ").encode() + b"\n")
            except OSError:  # the reaper is gone: nothing to tell
                pass

    # ---- after ray.shutdown ----------------------------------------------------------------
    def close(self) -> None:
        """Ray is shut down: kill what is left of its processes, remove the token. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._reaper_pipe is not None:
            self._tell_reaper("bye")  # a normal end: the driver has its own last word
            with self._lock:
                os.close(self._reaper_pipe)  # EOF: the reaper kills the leftovers and exits
                self._reaper_pipe = None
            try:
                self._reaper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.token_dir is not None:
            shutil.rmtree(self.token_dir, ignore_errors=True)
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self.token_dir = None
