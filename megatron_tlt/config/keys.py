"""Config keys: every dotted key of a config class, the closest one to a typo, the
line of a key in a YAML file, and omegaconf's errors translated into ``ConfigError``s
that name the field, the place and the fix."""

from __future__ import annotations

import difflib
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Optional

from .base import ConfigError
from .kinds import renamed_keys


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.type if is_dataclass(f.type) else None
        if sub is None and f.default_factory is not MISSING and is_dataclass(f.default_factory):
            sub = f.default_factory
        if sub is not None:
            keys.append(key)
            keys.extend(_all_keys(sub, key + "."))
        else:
            keys.append(key)
    return keys


def _closest_hint(key: str, cls) -> str:
    moved = renamed_keys().get(key)
    if moved is not None:
        return f"; it is now '{moved}' (the kind's own settings)"
    close = difflib.get_close_matches(key, _all_keys(cls), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _yaml_line(path: Path, dotted: str) -> Optional[int]:
    """1-based line of ``dotted`` (a.b.c) in a YAML file, if it can be found."""
    import yaml

    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        for k, v in node.value:
            if k.value == part:
                line, node = k.start_mark.line + 1, v
                break
        else:
            return None
    return line


def _translate(err: Exception, cls, origin: str, path: Optional[Path] = None) -> ConfigError:
    """omegaconf's exception -> ConfigError naming field, place and fix."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(err, "full_key", None) or "?"
    where = origin
    if path is not None:
        line = _yaml_line(path, key)
        where = f"{path}:{line}" if line else str(path)
    if isinstance(err, ConfigKeyError):
        return ConfigError(f"{where}: unknown config key '{key}'{_closest_hint(key, cls)}")
    if isinstance(err, ValidationError):
        msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
        if key == "?":
            return ConfigError(f"{where}: {msg}")
        return ConfigError(f"{where}: bad value for '{key}': {msg}")
    return ConfigError(f"{where}: {err}")
