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


def name_values(text: str, what: str, example: str) -> list[tuple[str, str]]:
    """A config's one-word form, ``"name=value,name=value"``, as (name, raw value) pairs, each
    stripped (empty items skipped); an item without '=' refused in one line ("triton option
    'pdl' is not name=value: e.g. 'pdl=false'"). The config types and checks each value."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"{what} {item!r} is not name=value: e.g. {example!r}")
        out.append((name.strip(), raw.strip()))
    return out
