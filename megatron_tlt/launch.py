"""Start-up shared by every entry point: config checks, distributed, model, tokenizer.

The order matters: everything that can be checked from the config and the model's
config.json is checked before any process group or weight exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from .config import Config
from .models import arch_from_source, load_model, load_tokenizer, resolve_source
from .models.gpt import ModelArch, memory_controls
from .models.moe import moe_options
from .parallel import ParallelLayout, initialize_model_parallel
from .runtime_env import Platform, init_distributed, seed_everything
from .rl.preflight import check_vocabulary
from .validation import validate


@dataclass
class Session:
    platform: Platform
    layout: ParallelLayout
    model: object
    arch: ModelArch
    tokenizer: object
    source: Path


def setup(cfg: Config) -> Session:
    """Validate, initialise torch.distributed and megatron-core, build and load the model."""
    source = resolve_source(cfg.model.hf_path)
    arch = arch_from_source(source)
    validate(cfg, arch, int(os.environ.get("WORLD_SIZE", "1")))  # every rule, as --dry-run
    tokenizer = load_tokenizer(source)
    check_vocabulary(tokenizer, arch, source)
    plat = init_distributed(cfg.platform.device, cfg.platform.backend,
                            timeout_minutes=cfg.parallel.collective_timeout_s / 60)
    seed_everything(cfg.platform.seed)
    layout = initialize_model_parallel(cfg.parallel.tensor_model_parallel_size,
                                       cfg.parallel.pipeline_model_parallel_size,
                                       seed=cfg.platform.seed,
                                       timeout_s=cfg.parallel.collective_timeout_s,
                                       ep=cfg.parallel.expert_model_parallel_size)
    model, arch = load_model(source, device=plat.device, dtype=cfg.model.dtype,
                             impl=cfg.model.transformer_impl,
                             memory=memory_controls(cfg.train, cfg.parallel),
                             moe=moe_options(cfg.train, cfg.grpo))
    return Session(plat, layout, model, arch, tokenizer, source)


def shutdown() -> None:
    from .parallel import destroy_model_parallel

    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
