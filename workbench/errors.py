class WorkbenchError(Exception):
    """A user-facing error: one line naming what is wrong and what is allowed."""
