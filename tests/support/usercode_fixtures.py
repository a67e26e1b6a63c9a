"""User code that misbehaves, for the user-code pool's tests: module-level, so that a worker
process can load it by name (pickle sends functions and classes by reference)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

from eddyrl.envs import Environment, Reply

def add(a, b):
    return a + b


def pid(*args):
    return os.getpid()


def thread_name(*args):
    return threading.current_thread().name


def blocks(release: threading.Event, *args):
    """Blocks its thread in a system call (no bytecode runs: nothing can interrupt it) until
    the test sets `release` (30 s at most)."""
    release.wait(30)
    return 1.0


def sleeps(*args):
    time.sleep(30)
    return 1.0


def spins(*args, stopped=None):
    """Busy forever, swallowing every Exception; `stopped` is set when it is made to stop."""
    try:
        while True:
            try:
                while True:
                    pass
            except Exception:
                continue
    finally:
        if stopped is not None:
            stopped.set()


def exits(*args):
    sys.exit(3)


def interrupts(*args):
    raise KeyboardInterrupt


def raises(*args):
    raise ZeroDivisionError("grader divided by zero")


def wrong_type(*args):
    return "high"


def unpicklable_result(*args):
    return lambda: 1


def exits_hard(*args):
    os._exit(7)


def segfaults(*args):
    os.kill(os.getpid(), signal.SIGSEGV)


def segfaults_in(state, *args):
    segfaults()


def forks(path, *args):
    """Forks; the copy returns 0.5 into whoever called (it must not be heard), the original
    writes the copy's pid to `path` and returns 1.0."""
    child = os.fork()
    if child == 0:
        return 0.5
    with open(path, "w") as out:
        out.write(str(child))
    return 1.0


def reward_by_answer(response, answer):
    """A reward for the rollout and reward tests: the answer says how it behaves."""
    if answer == "segfault":
        segfaults()
    if answer == "exit":
        exits_hard()
    if answer == "sleep":
        time.sleep(30)
    return float(len(response))


class _Explodes:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("this shared object does not load in a worker")


EXPLODES = _Explodes()


def remember(state, value):
    state.value = getattr(state, "value", 0) + value
    return state.value, os.getpid()


async def remember_async(state, value):
    await asyncio.sleep(0)
    return remember(state, value)


class CharTokenizer:
    """One id per character; picklable (module-level)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, **kwargs):
        return "".join(map(chr, ids))


class Misbehaving(Environment):
    """Turn k does `script[k - 1]` (the last repeats; `script` may be a dict by prompt): "ok"
    answers "ok", "done" ends with reward 1, "block" blocks its thread in a system call until
    `release` is set, "sleep" sleeps 30 s, "exit" raises SystemExit, "interrupt" raises
    KeyboardInterrupt, "high" ends with the reward "high", "segfault" / "exit_hard" kill the
    process, "where" answers with its process id and thread name. Prompt "unbuildable": the
    constructor raises."""

    def __init__(self, *, script=("ok", "done"), release=None, **base):
        super().__init__(**base)
        if self.prompt == "unbuildable":
            raise OSError("sandbox image not found")
        script = script[self.prompt] if isinstance(script, dict) else script
        self.script, self.release = tuple(script), release

    async def respond(self, action):
        what = self.script[min(self.turns, len(self.script)) - 1]
        if what == "done":
            return Reply(done=True, reward=1.0)
        if what == "block":
            blocks(self.release)
        if what == "sleep":
            time.sleep(30)
        if what == "exit":
            sys.exit(1)
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "high":
            return Reply(done=True, reward="high")
        if what == "segfault":
            segfaults()
        if what == "exit_hard":
            exits_hard()
        if what == "where":  # the observation's text: where this environment lives
            return Reply(text=f"{os.getpid()} {threading.current_thread().name}", tool="where")
        return Reply(text="ok", tool="calc")
