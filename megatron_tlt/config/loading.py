"""Loading: YAML recipes and overrides into a ``Config``, the entry parser, run checks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .base import ConfigError
from .keys import _translate
from .markdown import describe
from .overrides import apply_override
from .sections import Config


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
# rules against the model and the launch: registered and run by validation.validate
# -------------------------------------------------------------------------------------

def mini_batch_count(cfg: Config) -> int:
    """Optimizer steps per ppo epoch (validated against the batch sizes)."""
    g, t = cfg.grpo, cfg.train
    total = g.prompts_per_step * g.group_size
    gbs = t.global_batch_size or total
    if gbs % g.group_size or total % gbs:
        raise ConfigError(
            f"train.global_batch_size={gbs} must be a multiple of grpo.group_size="
            f"{g.group_size} and divide grpo.prompts_per_step x group_size = {total}")
    return total // gbs


def check_data_parallel_layout(cfg: Config, arch, world_size: int) -> None:
    """Every replica gets whole groups of every mini-batch (and the batch sizes agree)."""
    dp = max(world_size // (cfg.parallel.tensor_model_parallel_size
                            * cfg.parallel.pipeline_model_parallel_size), 1)
    m = mini_batch_count(cfg)
    if cfg.grpo.prompts_per_step % (m * dp):
        raise ConfigError(
            f"grpo.prompts_per_step={cfg.grpo.prompts_per_step} must be divisible by "
            f"mini-batches per step ({m}) x data-parallel size ({dp}) = {m * dp}, so "
            f"every replica gets whole groups of every mini-batch")


def check_drafter_group_layout(cfg: Config, arch, world_size: int) -> None:
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


def check_parallel_sizes(cfg: Config, arch, world_size: int) -> None:
    """TP, PP and the recomputed layers against the model's heads and layers and the
    world size."""
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
