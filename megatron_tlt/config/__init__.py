"""Typed configuration: dataclasses, YAML recipes, ``section.field=value`` overrides.

One convention everywhere: a run's configuration is the defaults below, then each
``--config recipe.yaml`` in order, then command-line overrides written as dotted
``section.field=value`` pairs, e.g.::

    torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/demo_cpu.yaml \
        parallel.tensor_model_parallel_size=2 model.dtype=float32

A string field takes the text after the first ``=`` verbatim (a regular expression or
a prompt needs no quoting; an empty value is "" or, for an optional string, not set);
other fields are parsed as YAML. OmegaConf does the merging and type coercion (the
same structured-config model NeMo and Hydra use); this module adds what users need on
top: errors that name the field, the file and line, and the closest valid key, and
the rules against the model and the world size (``config/loading.py``), which
``megatron_tlt.validation.validate`` runs with every other rule before any compute.
"""

from __future__ import annotations

from .base import ConfigError
from .loading import build_parser, config_from_args, load_config, mini_batch_count, parse_args
from .markdown import describe
from .rl_sections import (CheckpointConfig, DataConfig, DrafterGroupConfig, GRPOConfig,
                          RewardConfig, TrackingConfig, TrainConfig)
from .sections import (Config, GenerateConfig, ModelConfig, ParallelConfig, PlatformConfig,
                       RolloutConfig, SpeculativeConfig)

__all__ = [
    "Config", "ConfigError", "ModelConfig", "ParallelConfig", "PlatformConfig",
    "GenerateConfig", "RolloutConfig", "SpeculativeConfig", "DataConfig", "RewardConfig",
    "GRPOConfig", "TrainConfig", "DrafterGroupConfig", "CheckpointConfig", "TrackingConfig",
    "build_parser", "config_from_args", "describe", "load_config", "mini_batch_count",
    "parse_args",
]
