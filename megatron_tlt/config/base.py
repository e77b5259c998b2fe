"""The config package's foundation: ``ConfigError`` and the field and check helpers."""

from __future__ import annotations

import difflib
from dataclasses import MISSING, field
from typing import Any, Sequence


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says which field and how."""


def _help(text: str, default: Any = MISSING, factory: Any = MISSING):
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


def _choice(section: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{section}.{name}={value!r} is not valid{hint}; choose one of {', '.join(choices)}"
        )


def _positive(section: str, name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{section}.{name} must be >= 1, got {value}")
