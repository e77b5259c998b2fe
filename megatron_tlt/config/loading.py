"""Loading: YAML recipes and overrides into a ``Config``, the entry parser, run checks."""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Optional, Sequence

from .base import ConfigError
from .markdown import describe
from .sections import Config


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


def load_config(config_files: Sequence[str | Path] = (), overrides: Sequence[str] = (),
                cls=Config):
    """Defaults <- each YAML file in order <- ``section.field=value`` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(cls)
    for f in config_files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            layer = OmegaConf.load(path)
        except Exception as e:  # YAML syntax errors carry their own line numbers
            raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _translate(e, cls, str(path), path) from None
    from ..overrides import apply_override

    for item in overrides:
        merged = apply_override(merged, item, cls)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _translate(e, cls, "config") from None


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The entry-point parser: ``[--config FILE]... [section.field=value]...``.

    Tools add their own flags (e.g. an output folder) to it and pass the parsed
    namespace to ``config_from_args``.
    """
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Overrides: section.field=value, e.g. parallel.tensor_model_parallel_size=2. "
               "All fields: --help-config.")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML recipe; may repeat, later files win")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config field with its default and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    return parser


def config_from_args(args: argparse.Namespace, cls=Config):
    if args.help_config:
        print(describe(cls))
        sys.exit(0)
    return load_config(args.config, args.overrides, cls)


def parse_args(argv: Optional[Sequence[str]] = None, cls=Config, description: str = ""):
    """Parse an entry point's command line into a validated ``cls`` instance."""
    return config_from_args(build_parser(description).parse_args(argv), cls)


# -------------------------------------------------------------------------------------
# checks against the model and the launch
# -------------------------------------------------------------------------------------

def check_drafter_group_layout(cfg: Config) -> None:
    """The drafter group at PP > 1 trains on the gathered rollout's whole-model copies
    and all-gathered responses; the stage-to-stage rollout has neither."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.drafter_group.enable and pp > 1 and cfg.rollout.pipeline_mode != "gathered":
        raise ConfigError(
            f"drafter_group.enable=true at parallel.pipeline_model_parallel_size={pp} "
            f"needs rollout.pipeline_mode=gathered (every pipeline rank then holds the "
            f"whole model and all of its replica's responses), got "
            f"rollout.pipeline_mode={cfg.rollout.pipeline_mode}; set "
            f"rollout.pipeline_mode=gathered (the default) or drafter_group.enable=false")


def check_self_drafter_layout(cfg: Config) -> None:
    """The self-drafter at PP > 1 quantizes the gathered rollout's whole-model copy; the
    stage-to-stage rollout holds one stage's layers per rank."""
    pp = cfg.parallel.pipeline_model_parallel_size
    spec = cfg.rollout.speculative
    if ((spec.drafter == "self" or spec.self_too) and pp > 1
            and cfg.rollout.pipeline_mode != "gathered"):
        raise ConfigError(
            f"the self-drafter (rollout.speculative.drafter=self or self_too=true) at "
            f"parallel.pipeline_model_parallel_size={pp} needs rollout.pipeline_mode="
            f"gathered (every pipeline rank then quantizes its copy of the whole model), "
            f"got rollout.pipeline_mode={cfg.rollout.pipeline_mode}")


def validate_for_run(cfg: Config, arch, world_size: int) -> None:
    """Checks that need the model's architecture and the world size; run before compute."""
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    if arch.num_attention_heads % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
            f"{arch.num_attention_heads} attention heads; use a divisor of "
            f"{arch.num_attention_heads}")
    if arch.num_query_groups % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
            f"{arch.num_query_groups} KV groups (num_key_value_heads); use a divisor of "
            f"{arch.num_query_groups}")
    check_drafter_group_layout(cfg)
    check_self_drafter_layout(cfg)
    if arch.num_layers % pp:
        raise ConfigError(
            f"parallel.pipeline_model_parallel_size={pp} does not divide the model's "
            f"{arch.num_layers} layers; use a divisor of {arch.num_layers}")
    t = cfg.train
    if t.recompute_granularity == "full" and t.recompute_num_layers > arch.num_layers // pp:
        raise ConfigError(
            f"train.recompute_num_layers={t.recompute_num_layers} exceeds the "
            f"{arch.num_layers // pp} layers of a pipeline stage "
            f"({arch.num_layers} layers / parallel.pipeline_model_parallel_size={pp}); use "
            f"1..{arch.num_layers // pp}")
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size "
            f"({tp}) x parallel.pipeline_model_parallel_size ({pp}) = {tp * pp}; launch a "
            f"multiple of {tp * pp} processes or change the parallel sizes")
