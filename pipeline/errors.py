"""The errors a user sees as one line (``error: ...``, exit 2): what they name is the fix."""


class ConfigError(ValueError):
    """A setting that cannot be built; the message names the setting, the value and what is allowed."""


class BuildError(RuntimeError):
    """A build that cannot go on (a stage found a problem it can name); nothing is published."""


class SessionError(RuntimeError):
    """A request a serving session refuses (or a program failure it reports); the session is unchanged."""
