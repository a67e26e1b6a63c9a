"""Errors Eddy raises for problems a user can fix. The CLI prints them as one message, no trace."""


class EddyError(Exception):
    """Base class: the message alone must say what is wrong and what to do."""


class ConfigError(EddyError, ValueError):
    """A config key, value or file is wrong. The message names the key and what is allowed."""


class PlatformError(EddyError, RuntimeError):
    """A platform is unknown, not installed, or not present on this machine."""
