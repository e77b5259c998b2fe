"""Command-line overrides (``section.field=value``) merged into a structured config.

A string field takes the text after the first ``=`` verbatim: no YAML parsing (a
regular expression such as ``[0-9]+`` or a prompt with colons stays as typed) and no
OmegaConf interpolation (``${`` is escaped). An empty value is the empty string, or
None (not set) for an optional string. Every other field is parsed as YAML, and a
value that does not parse is a one-line ``ConfigError`` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import is_dataclass
from typing import Any, Optional

from .base import ConfigError
from .keys import _all_keys, _closest_hint, _translate


def _field_type(cls, dotted: str):
    """The declared type of config field ``dotted`` (None for an unknown key or a key
    inside a dict-valued field, which OmegaConf then reports or parses)."""
    import typing

    node = cls
    for part in dotted.split("."):
        if not is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
    return None if is_dataclass(node) else node


def _type_name(typ) -> str:
    return getattr(typ, "__name__", str(typ).replace("typing.", ""))


def _escape_interpolation(value: str) -> str:
    """``value`` as OmegaConf reads it back verbatim: ``${`` (and the backslashes
    before it) escaped, so a string is never an interpolation."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)


def apply_override(merged, item: str, cls):
    """Merge one ``section.field=value`` into ``merged``.

    String fields take the text after the first ``=`` verbatim (no YAML parsing, so a
    regular expression or a prompt with brackets, braces, colons, quotes or ``=`` is
    kept as typed); an empty value is the empty string, or None (not set) for an
    optional string. Other fields are parsed as YAML scalars, lists or mappings.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    import yaml

    if "=" not in item or item.startswith("="):
        raise ConfigError(
            f"command-line override {item!r} is not of the form section.field=value "
            f"(e.g. parallel.tensor_model_parallel_size=2)")
    key, value = item.split("=", 1)
    key = key.strip()
    typ = _field_type(cls, key)
    try:
        if typ in (str, Optional[str]):
            if value == "???":
                raise ConfigError(f"command line: '???' is reserved (it marks a missing "
                                  f"value); choose another value for '{key}'")
            node = None if value == "" and typ is not str else _escape_interpolation(value)
            layer: Any = node
            for part in reversed(key.split(".")):
                layer = {part: layer}
            return OmegaConf.merge(merged, OmegaConf.create(layer))
        if typ is not None and not value.strip():
            raise ConfigError(f"command line: '{key}=' has no value; give "
                              f"a value of type {_type_name(typ)}")
        return OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
    except OmegaConfBaseException as e:
        raise _translate(e, cls, "command line") from None
    except yaml.YAMLError as e:
        leaves = [k for k in _all_keys(cls) if _field_type(cls, k) is not None]
        if typ is None and not any(key.startswith(k + ".") for k in leaves):
            raise ConfigError(f"command line: unknown config key '{key}'"
                              f"{_closest_hint(key, cls)}") from None
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"command line: bad value for '{key}': {value!r} is not a valid "
                          f"{_type_name(typ) if typ is not None else 'value'} ({first})"
                          ) from None
