#!/usr/bin/env python
"""Acceptance length of one drafter checkpoint run in bf16 and through Transformer
Engine's FP8 GEMMs, on SmolLM2-135M (CUDA, bf16 target, greedy). Needs CUDA and TE.

    python tools/drafter_precision.py --json precision.json

The same weights are loaded twice (``fp8=False`` / ``fp8=True``); each decodes the
benchmark's held-out reasoning-gym prompts (seed 1) with a fixed strategy. Reported per
precision: mean accepted tokens per step, acceptance rate per draft position, the share
of outputs identical to plain bf16 decoding, and tokens per second against plain
decoding. FP8 must not cost acceptance: the tool exits non-zero if FP8's acceptance
length is below ``--min-ratio`` times bf16's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megatron_tlt.runtime_env import silence_expected_warnings


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=None, help="checkpoint (default: bench_spec's cached one)")
    ap.add_argument("--strategy", default="6_1_6")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-ratio", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def missing_requirement(dpath: Path) -> str | None:
    """Why this machine cannot run the comparison (no CUDA, no TE, no drafter), or None."""
    if not torch.cuda.is_available():
        return "drafter_precision: needs a CUDA device (FP8 runs through Transformer Engine)"
    from megatron_tlt.models.gpt import te_available

    if not te_available():
        return "drafter_precision: Transformer Engine is not installed (pip install -e .[gpu])"
    if not dpath.exists():
        return f"drafter_precision: no drafter at {dpath} (tools/warmup_drafter.py makes one)"
    return None


def timed_run(engine, groups, sp):
    """Seconds, outputs and per-call stats of decoding every group once."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs, stats = [], []
    for g in groups:
        outs += [o.token_ids for o in engine.generate(g, sp)]
        stats.append(engine.last_stats)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs, stats


def precision_run(engine, dpath: Path, fp8: bool, args, groups, sp, ref, plain_s) -> dict:
    """The drafter loaded in bf16 or FP8 with the fixed strategy: acceptance, identity to
    plain decoding, speed."""
    from megatron_tlt.config import SpeculativeConfig
    from megatron_tlt.models.drafter import load_drafter
    from megatron_tlt.rollout import SamplingParams

    drafter = load_drafter(dpath, engine.arch, dtype=torch.bfloat16, device=engine.device,
                           fp8=fp8)
    engine.config.speculative = SpeculativeConfig(policy="fixed", strategy=args.strategy,
                                                  threshold=1 << 30)
    engine.attach_drafter(drafter)
    engine.generate(groups[0], SamplingParams(temperature=0.0, max_new_tokens=8))
    secs, outs, stats = timed_run(engine, groups, sp)
    rows = sum(s.spec.rows for s in stats)
    emitted = sum(s.spec.emitted for s in stats)
    reach = stats[-1].spec.summary().get("accept_rate_at_position", {})
    engine.detach_drafter()
    return dict(accept_len=emitted / max(1, rows),
                identical=sum(o == r for o, r in zip(outs, ref)) / len(ref),
                tok_s=sum(map(len, outs)) / secs, speedup=plain_s / secs,
                accept_rate_at_position_last_call=reach)


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    from megatron_tlt.drafter_training.prepared import default_drafter_path

    dpath = Path(args.drafter) if args.drafter else default_drafter_path()
    why = missing_requirement(dpath)
    if why:
        print(why, file=sys.stderr)
        return 2
    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.tasks import reasoning_gym_prompts

    engine = RolloutEngine.from_pretrained(require_smollm2(), RolloutConfig(max_batch_size=64),
                                           dtype="bfloat16")
    prompts = [p.token_ids for p in reasoning_gym_prompts(engine.tokenizer, n=args.prompts,
                                                          seed=args.seed)]
    groups = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)

    engine.detach_drafter()
    engine.generate(groups[0], SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
    plain_s, ref, _ = timed_run(engine, groups, sp)
    n_tok = sum(map(len, ref))
    result = dict(drafter=str(dpath), strategy=args.strategy, prompts=args.prompts,
                  batch=args.batch, new_tokens=args.new_tokens, tokens=n_tok,
                  plain_tok_s=n_tok / plain_s, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, precisions={})
    print(f"plain bf16: {n_tok} tokens, {n_tok / plain_s:.1f} tok/s", flush=True)
    for name, fp8 in (("bf16", False), ("fp8", True)):
        res = precision_run(engine, dpath, fp8, args, groups, sp, ref, plain_s)
        result["precisions"][name] = res
        print(f"{name:>4}: accept {res['accept_len']:.2f}  identical {res['identical']:.0%}  "
              f"{res['tok_s']:.1f} tok/s  speedup {res['speedup']:.2f}", flush=True)
    ratio = result["precisions"]["fp8"]["accept_len"] / result["precisions"]["bf16"]["accept_len"]
    result["fp8_over_bf16_accept"] = ratio
    print(f"FP8 / bf16 acceptance length: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
