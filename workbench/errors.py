class WorkbenchError(Exception):
    """A user-facing error: one line naming what is wrong and what is allowed."""


class ConfigError(WorkbenchError):
    """A config field holds a value outside what it allows (EngineConfig, TritonOptions, ...)."""
