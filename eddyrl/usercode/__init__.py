"""Running user code (reward functions, environments) off the controller's event loop: on
worker threads, in worker processes, or inline; a failure, a hang or a crash of it costs its
sample or episode, never the run (`pool`), configured by the `user_code` section (`config`)."""

from .factory import MODES, make_pool
from .pool import InlinePool, Pool, SessionState, UserCodeError, UserCodeTimeout
from .processes import ProcessPool
from .threads import ThreadPool

__all__ = ["MODES", "InlinePool", "Pool", "ProcessPool", "SessionState", "ThreadPool",
           "UserCodeError", "UserCodeTimeout", "make_pool"]
