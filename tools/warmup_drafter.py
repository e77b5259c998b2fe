#!/usr/bin/env python
"""Offline drafter warm-up: self-distillation on the target's own responses.

    python tools/warmup_drafter.py --config examples/rl/smollm2_cpu.yaml --out d.safetensors
    python tools/warmup_drafter.py --model /path/to/hf --task chain_sum --train-prompts 512

With ``--config`` (an RL recipe) the responses are sampled as the recipe's rollouts
sample them (its task and prompt format, grpo.temperature / top_p / top_k, group_size
responses per prompt, max_new_tokens) and the loss is taken at those settings; flags
given here override the recipe. Without it: greedy responses on --task.

Then: the target's features, the draft vocabulary by p̃ mass (--draft-vocab N), training
(--loss, --unroll, --hidden-weight), the checkpoint, and a held-out report: exact α by
draft depth, E[max p̃], draft-vocabulary mass, predicted and measured acceptance length.
The library behind it is ``megatron_tlt.drafter_training.warmup``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_tlt.drafter_training.losses import LOSS_PRESETS
from megatron_tlt.runtime_env import silence_expected_warnings


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    a = ap.add_argument
    a("--config", default=None, help="RL recipe (YAML) whose task and sampling to warm up for")
    a("--model", default=None, help="HF folder, checkpoint or 'smollm2' (default: smollm2)")
    a("--out", default=None, help="drafter checkpoint (.safetensors or folder)")
    a("--task", default=None, help="reasoning-gym task (default: the recipe's / workload's)")
    a("--train-prompts", type=int, default=None, help="default 256")
    a("--eval-prompts", type=int, default=None, help="default 8")
    a("--samples-per-prompt", type=int, default=None,
      help="responses per prompt (default: the recipe's group_size, else 1)")
    a("--max-new-tokens", type=int, default=None, help="default: the recipe's, else 256")
    a("--temperature", type=float, default=None,
      help="sampling temperature of the responses and the loss (default: the recipe's, "
           "else 0 = greedy)")
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--epochs", type=int, default=None,
      help="training epochs (default 6); 0 with --init: no training, only --draft-vocab's "
           "re-selection and the held-out evaluation")
    a("--lr", type=float, default=None, help="default 2e-3")
    a("--batch-tokens", type=int, default=None, help="default 4096")
    a("--draft-vocab", type=int, default=None,
      help="prune the draft vocabulary to N tokens (0 = full; with --init: re-select, "
           "0 keeps the checkpoint's)")
    a("--draft-vocab-by", choices=("mass", "count"), default=None,
      help="choose the draft vocabulary by the target's probability mass at the sampling "
           "settings (default) or by response-token frequency")
    a("--loss", choices=sorted(LOSS_PRESETS), default=None, help="drafter loss")
    a("--hidden-weight", type=float, default=None,
      help="weight of the next-hidden-state regression (overrides the loss preset's)")
    a("--eagle3", action="store_true", default=None, help="three target layers as features")
    a("--unroll", type=int, default=None,
      help="training depths: pass k feeds the drafter its own outputs as drafting does")
    a("--eval-strategy", default=None, help="depth_topk_verifytokens (default 6_1_6)")
    a("--eval-new-tokens", type=int, default=None)
    a("--responses", default=None,
      help="keep generated responses in this JSON-lines file and reuse them: an "
           "interrupted or extended run generates only what is missing")
    a("--generate-only", action="store_true", default=None,
      help="stop after generating the responses (needs --responses)")
    a("--chunk", type=int, default=None, help="prompts per generate call")
    a("--init", default=None, help="start from this drafter checkpoint")
    a("--seed", type=int, default=None)
    a("--json", default=None, help="write the report here")
    return ap.parse_args(argv)


def config_from_args(args):
    from megatron_tlt.drafter_training.warmup import WarmupConfig

    fields = {k: v for k, v in vars(args).items()
              if k not in ("config", "json") and v is not None}
    if args.config:
        return WarmupConfig.from_recipe(args.config, **fields)
    return WarmupConfig(**fields)


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    from megatron_tlt.drafter_training.warmup import WarmupError, run_warmup

    try:
        cfg = config_from_args(args)
    except WarmupError as e:
        raise SystemExit(str(e)) from None
    if not cfg.out and not cfg.generate_only:
        raise SystemExit("--out is required (where the drafter checkpoint goes)")
    try:
        result = run_warmup(cfg)
    except WarmupError as e:
        raise SystemExit(str(e)) from None
    if args.json:
        Path(args.json).write_text(json.dumps(result.report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
