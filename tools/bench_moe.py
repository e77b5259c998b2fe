#!/usr/bin/env python
"""Qwen3 / Qwen3-MoE in the rollout engine: speed against transformers ``generate``, and
the engine / trainer log-prob mismatch of an MoE policy with and without routing replay,
and both drafter kinds on an MoE target.

    python tools/bench_moe.py --part speed --reps 5 --json F       # ~12 min on 2 cores
    python tools/bench_moe.py --part replay --prompts 32 --new-tokens 48 --json F  # ~2 min
    python tools/bench_moe.py --part speed --quick                  # < 3 min
    python tools/bench_moe.py --part spec --threads 1 --new-tokens 48 --reps 5 \
        --json F                                                     # ~1 min

``--part speed``: a small random Qwen3 (dense, head_dim != hidden / heads) and a small
random Qwen3-MoE, float32, greedy, ``--new-tokens`` tokens per sequence (EOS ignored),
batches of 1, 8 and 32 random prompts of different lengths; engine and transformers run
interleaved (A, B, A, B, ...), each pair a throughput ratio, the median reported
(``megatron_tlt/bench/families.py``).

``--part replay``: bf16 on CPU, the engine samples responses (T = 1) and records their
experts; the trainer's forward scores them (micro-batches of padded samples): mean and
tail |Δ log p| and the share of flipped routes, for the MoE model without and with
routing replay and for a dense model of the same shape
(``megatron_tlt/bench/replay_mismatch.py``).

``--part spec``: the self-drafter and the one-layer drafter on a small random Qwen3-MoE
at T = 1 (a fixed depth-4 chain): acceptance, tokens per step, and a draft step's time
against the target's decode step (``megatron_tlt/bench/spec_moe.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megatron_tlt.runtime_env import silence_expected_warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--part", choices=("speed", "replay", "spec"), required=True)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="speed: A/B pairs per batch "
                    "size; spec: generates per drafter (medians)")
    ap.add_argument("--prompts", type=int, default=32, help="replay: responses")
    ap.add_argument("--micro-batch", type=int, default=4, help="replay: trainer rows")
    ap.add_argument("--models", default=None, help="folder for the random models "
                    "(default: a temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="one A/B pair, 16 new tokens, 8 prompts (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.new_tokens, args.prompts = 1, 16, 8
    silence_expected_warnings()
    import torch

    from megatron_tlt.bench.common import timing_only
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.runtime_env import apply_cpu_redirection, init_distributed

    torch.set_num_threads(args.threads)
    init_distributed()
    initialize_model_parallel(1, 1)
    apply_cpu_redirection()
    root = Path(args.models or tempfile.mkdtemp(prefix="bench_moe_"))
    if args.part == "speed":
        from megatron_tlt.bench import families

        result = families.run(root, new_tokens=args.new_tokens, reps=args.reps,
                              threads=args.threads)
        result.update(timing_only(target_random=True))  # (random models: speed only)
    elif args.part == "spec":
        from megatron_tlt.bench import spec_moe

        result = spec_moe.run(root, new_tokens=args.new_tokens, reps=args.reps)
        result.update(timing_only(target_random=True))  # random target and drafters
    else:
        from megatron_tlt.bench import replay_mismatch as rm

        moe = rm.save_random(root / "moe", rm.MOE)
        dense = rm.save_random(root / "dense", rm.DENSE)
        kw = dict(prompts=args.prompts, new_tokens=args.new_tokens,
                  micro_batch=args.micro_batch)
        rows = [rm.measure(moe, replay=False, **kw), rm.measure(moe, replay=True, **kw),
                rm.measure(dense, replay=None, **kw)]
        result = {"part": "replay", "dtype": "bfloat16", "models": {"moe": rm.MOE,
                                                                   "dense": rm.DENSE},
                  "rows": rows}
        for r in rows:
            print(f"{r['model']:>9} replay={str(r['replay']):>5}: mean|dlogp| "
                  f"{r['mean_abs_dlogp']:.4f}  p99 {r['p99_abs_dlogp']:.4f}  max "
                  f"{r['max_abs_dlogp']:.3f}  flipped routes {r['flipped_route_share']}  "
                  f"tokens with a flip {r['tokens_with_a_flip_share']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
