from dataclasses import fields
from typing import Any, Mapping


class WorkbenchError(Exception):
    """A user-facing error: one line naming what is wrong and what is allowed."""


class ConfigError(WorkbenchError):
    """A config field holds a value outside what it allows (EngineConfig, TritonOptions, ...)."""


def refuse_unknown_keys(cls, d: Mapping[str, Any], what: str, noun: str = "key") -> None:
    """A config dataclass's from_dict: refuse keys that are not its fields, in one line that
    lists them and the valid ones ("unknown qsa key(s) 'k'; valid keys: block, top_k, ...")."""
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ConfigError(f"unknown {what} {noun}(s) {', '.join(map(repr, unknown))}; "
                          f"valid {noun}s: {', '.join(valid)}")
