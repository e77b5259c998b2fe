#!/usr/bin/env python
"""GRPO training of a reasoning LLM on megatron-core, with TLT rollouts.

    torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/smollm2_cpu.yaml
    torchrun --nproc_per_node 8 pretrain_rl_tlt.py --config examples/rl/qwen2.5_7b_grpo.yaml \\
        --tensor-model-parallel-size 2 --lr 1e-6 --wandb-project my-rl
    python pretrain_rl_tlt.py --config examples/rl/qwen2.5_32b_grpo.yaml --dry-run --world-size 64

A thin launcher: the command line and ``main`` live in the package
(``megatron_tlt/cli.py``), which the GPU check and the tools call directly.
"""

from __future__ import annotations

import sys

from megatron_tlt.cli import (MEGATRON_FLAGS, build_rl_parser, main, parse,  # noqa: F401
                              run, speculation)

if __name__ == "__main__":
    sys.exit(run())
