#!/usr/bin/env python
"""`make demo`: GRPO with TLT rollouts on SmolLM2-135M-Instruct, 2 DP replicas on CPU.

    python tools/demo.py [section.field=value ...]

1. A drafter for the policy: the cached one, or a warm-up bounded to a few minutes
   (``drafter_training.warmup`` with the recipe's task and sampling: 8 chain_sum prompts
   x the GRPO group's 8 responses at T=1, forward KL + TV against the target's T=1
   distribution; its held-out report prints the exact acceptance alpha by draft depth).
2. `torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/smollm2_cpu.yaml
   rollout.speculative.drafter=<it> rollout.speculative.kinds.self.also=true
   drafter_group.enable=true tracking.on_existing_run=new_version` plus any overrides
   given here: a few GRPO steps with both drafter kinds, the one-layer drafter (trained
   by the drafter group in every step's tail) and the policy's own int8 copy
   (re-quantized after every update), the adaptive engine choosing the kind per
   batch-size bucket; a per-step summary table (acceptance per kind, the drafter each
   bucket chose, drafter steps, alpha, held-out accuracy before the first step and
   after the last), and the paths of the W&B offline run, the JSONL, the plots (the
   timeline shows which kind speculated when and the drafter training) and the policy
   exported as a Hugging Face folder (docs/after-training.md). Every demo run is kept:
   the first writes runs/demo/smollm2-grpo, later ones smollm2-grpo-1, -2, ...

``python tools/demo.py rollout.speculative.drafter=self`` (``make demo
DEMO_ARGS=rollout.speculative.drafter=self``) speculates with the self-drafter instead:
the policy's own int8 copy, re-quantized after every update; no warm-up, no drafter
group. ``python tools/demo.py rollout.speculative.kinds.self.also=false`` runs the
one-layer drafter alone (at T=1 on this model its acceptance is too low to pay: the
break-even gate declines nearly every step).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megatron_tlt.bench.launcher import torchrun
from megatron_tlt.drafter_training.prepared import demo_drafter

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "examples" / "rl" / "smollm2_cpu.yaml"


def main(argv=None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    if "rollout.speculative.drafter=self" in overrides:  # the policy's int8 copy drafts:
        # nothing to warm up or train
        return torchrun("demo", 2, REPO / "pretrain_rl_tlt.py",
                        ["--config", RECIPE, "drafter_group.enable=false",
                         "tracking.on_existing_run=new_version", *overrides], t0, cwd=REPO)
    drafter = demo_drafter(RECIPE)
    return torchrun("demo", 2, REPO / "pretrain_rl_tlt.py",
                    ["--config", RECIPE,
                     f"rollout.speculative.drafter={drafter}",
                     "rollout.speculative.kinds.self.also=true", "drafter_group.enable=true",
                     "tracking.on_existing_run=new_version", *overrides], t0, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
