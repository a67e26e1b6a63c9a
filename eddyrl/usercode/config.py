"""Config section `user_code`: where rewards and environment steps run (`pool.py`).

    user_code:
      reward: {mode: thread, workers: 4}   # data.reward_fn; limit: data.reward_timeout_s
      env: {mode: thread, workers: 32}     # env.name's environments; limit: env.step_timeout_s

`mode`: `thread` (the default: light, trusted code; no pickling, no start-up cost, a blocking
call no longer stalls the run), `process` (heavy or untrusted code: math-verify, tools; a
crash or a hang costs one worker process, which is replaced; what it runs must pickle) or
`inline` (on the controller's event loop, as `eddy sim` always runs it). `workers`: threads or
processes at most; in thread mode an environment step holds a thread while it runs, so
environments get more.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..validation import check_choice, check_range
from .factory import MODES, make_pool
from .pool import Pool, describe

Mode = Literal["thread", "process", "inline"]
MAX_WORKERS = 1024


@dataclass(kw_only=True, slots=True)
class WorkersConfig:
    mode: Mode = "thread"
    workers: int = 4  # threads or processes, at most

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.mode", self.mode, MODES)
        check_range(f"{prefix}.workers", self.workers, 1, MAX_WORKERS)

    def build(self, prefix: str, *, name: str, shared: Any = None,
              sent: tuple[tuple[str, Any], ...] = ()) -> Pool:
        """The pool. In process mode `shared` and each of `sent` ((what, object): what
        every call sends) must pickle: ConfigError naming `prefix.mode` if one does not."""
        self.validate(prefix)
        if self.mode == "process":
            for what, value in (("the shared object", shared), *sent):
                try:
                    pickle.dumps(value)
                except Exception as exc:
                    raise ConfigError(
                        f"config key '{prefix}.mode' = 'process': {what} cannot be sent to a "
                        f"worker process ({describe(exc)}); make it importable (a module-level "
                        "function or class) or use mode 'thread'") from None
        return make_pool(self.mode, self.workers, name=name, shared=shared)


@dataclass(kw_only=True, slots=True)
class UserCodeConfig:
    reward: WorkersConfig = field(default_factory=lambda: WorkersConfig(workers=4))
    env: WorkersConfig = field(default_factory=lambda: WorkersConfig(workers=32))

    def validate(self, prefix: str) -> None:
        self.reward.validate(f"{prefix}.reward")
        self.env.validate(f"{prefix}.env")
