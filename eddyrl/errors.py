"""Errors Eddy raises for problems a user can fix. The CLI prints them as one message, no trace."""


class EddyError(Exception):
    """Base class: the message alone must say what is wrong and what to do."""


class ConfigError(EddyError, ValueError):
    """A config key, value or file is wrong. The message names the key and what is allowed."""


class PlatformError(EddyError, RuntimeError):
    """A platform is unknown, not installed, or not present on this machine."""


class WorkerCallError(EddyError, RuntimeError):
    """A worker failed or did not answer in time; the message says which and doing what."""


class WorkerLost(EddyError, RuntimeError):
    """A rollout worker's process is gone (killed, crashed, its node lost). The rollout puts its
    requests back and the runtime replaces the worker; the run goes on."""

    def __init__(self, worker: int, what: str, cause: str = "") -> None:
        super().__init__(f"rollout worker {worker} was lost during {what}"
                         + (f": {cause}" if cause else ""))
        self.worker = worker


class RayLost(EddyError, RuntimeError):
    """The local Ray's GCS or raylet died: no worker call can be trusted after it, so the run
    ends with this one line (which process, and resume=auto), not with whichever call was in
    flight."""
