#!/usr/bin/env python
"""Speculative decoding vs plain decoding in the rollout engine (SmolLM2-135M, greedy).

    python tools/bench_spec.py --json bench_spec.json          # full (~8 min + warm-up)
    python tools/bench_spec.py --quick                         # < 3 min once warmed up

The drafter is ``--drafter`` or, by default, a warmed SmolLM2 drafter cached under
``$MEGATRON_TLT_CACHE/drafters/`` (made by tools/warmup_drafter.py on first use from
8,192 prompts, ~2 h on 2 cores; its training prompts use seed 0, the benchmark's
prompts seed 1: held out).

(a) batch sizes 1, 2, 4, 8: the same 8 real reasoning-gym prompts run in batches of
    that size (real responses, EOS ends them, cap --new-tokens), speculation on with a
    fixed strategy per batch size vs plain decoding, interleaved pairs, median ratio of
    total times;
(b) a long-tail batch: 32 prompts, real response lengths (EOS ends a response, cap
    --tail-tokens), the adaptive engine (speculation below the threshold, BEG-MAB
    strategy choice) vs plain decoding: total time ratio.

Outputs must be identical to plain decoding; a sequence may part from it only where
plain decoding's top-2 logits are tied to within --tie-margin (verification runs
different matrix shapes, so the last bits of a logit may differ). Anything else
fails the benchmark.

Also reported: the drafter's cost per forward relative to a target decode step, at
batch 1 (drafter layer + fc + draft head vs the whole target).

JSON summary keys: ``speedup_bs1``, ``accept_len_bs1``, ``tail_batch_speedup``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench_common import check_ties  # noqa: E402
from megatron_tlt.platform import silence_expected_warnings  # noqa: E402

DEFAULT_STRATEGIES = "1:7_1_7,2:5_1_5,4:4_1_4,8:4_1_4"


def default_drafter_path() -> Path:
    from megatron_tlt.assets import default_cache_dir

    return default_cache_dir() / "drafters" / "smollm2-basic_arithmetic.safetensors"


def ensure_drafter(path: Path, quick: bool) -> Path:
    if path.is_file():
        return path
    print(f"no drafter at {path}: warming one up (tools/warmup_drafter.py)", flush=True)
    import warmup_drafter

    args = ["--out", str(path), "--draft-vocab", "1024", "--eval-prompts", "4"]
    if quick:
        args += ["--train-prompts", "64", "--max-new-tokens", "128", "--epochs", "4",
                 "--batch-tokens", "1024"]
    else:  # responses are kept next to the drafter: an interrupted warm-up resumes
        args += ["--train-prompts", "8192", "--max-new-tokens", "256", "--epochs", "3",
                 "--unroll", "2", "--batch-tokens", "1024", "--lr", "3e-3",
                 "--responses", str(path.with_suffix(".responses.jsonl"))]
    warmup_drafter.main(args)
    return path


def check_outputs(engine, prompts, ours, ref, tie_margin: float) -> dict:
    """Identical outputs, or a first divergence at a near-tie of plain decoding."""
    from megatron_tlt.models.inference import forward_local_logits, gather_logits

    def next_logits(ids):
        local = forward_local_logits(engine.runner.model, torch.tensor([ids], device=engine.device))
        return gather_logits(local, engine.arch)[0, -1]

    return check_ties(prompts, ours, ref, next_logits, tie_margin,
                      ("speculative", "plain"))


def drafter_cost(engine, reps: int = 20) -> dict:
    """Median seconds of one target decode step and one drafter step at batch 1."""
    from megatron_tlt.rollout.kv_cache import KVCache

    r, sd = engine.runner, engine.spec
    d = sd.draft
    n = 128
    cache = KVCache(num_layers=len(r.layers), max_batch=1, kv_heads=r.groups, capacity=n + 8,
                    head_dim=r.head_dim, dtype=r.dtype, device=r.device)
    dcache = KVCache(num_layers=1, max_batch=1, kv_heads=d.groups, capacity=n + 8,
                     head_dim=d.head_dim, dtype=d.dtype, device=d.device)
    tok = torch.tensor([[5]], device=r.device)
    pos = torch.tensor([n], device=r.device)
    h = torch.randn(1, r.arch.hidden_size, device=r.device, dtype=r.dtype)

    def target():
        r.logits(r.extend(cache, slice(0, 1), tok, pos)[:, 0])

    def draft():
        x = d.inputs(tok[:, 0], h, target_features=False)
        d.draft_logits(d.extend(dcache, slice(0, 1), tok, pos, embeds=x[:, None])[:, 0])

    out = {}
    with torch.no_grad():
        for name, fn in (("target", target), ("drafter", draft)):
            for _ in range(3):
                fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            out[name] = statistics.median(ts)
    out["ratio"] = out["drafter"] / out["target"]
    return out


def timed(engine, prompts, sp):
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return time.perf_counter() - t0, [o.token_ids for o in outs], engine.last_stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--drafter", default=None, help="drafter checkpoint (default: cached)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                    help="fixed strategy per batch size for (a): 'bs:depth_topk_verify,...'")
    ap.add_argument("--prompts", type=int, default=8, help="prompts for (a)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--tail-prompts", type=int, default=32)
    ap.add_argument("--tail-tokens", type=int, default=384)
    ap.add_argument("--tail-pairs", type=int, default=2)
    ap.add_argument("--threshold", type=int, default=None,
                    help="adaptive engine's speculation threshold (default: the config's)")
    ap.add_argument("--tie-margin", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="batch sizes 1,2 over 2 prompts; 64 tokens; 1 pair; tail of 8 prompts, "
                         "128 tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.new_tokens, args.pairs, args.prompts = "1,2", 64, 1, 2
        args.tail_prompts, args.tail_tokens, args.tail_pairs = 8, 128, 1
    silence_expected_warnings()
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    import megatron.core

    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.models.drafter import load_drafter
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.rollout.workload import reasoning_gym_prompts

    src = require_smollm2()
    dpath = Path(args.drafter) if args.drafter else ensure_drafter(default_drafter_path(),
                                                                    args.quick)
    engine = RolloutEngine.from_pretrained(src, RolloutConfig(max_batch_size=64))
    drafter = load_drafter(dpath, engine.arch, dtype=engine.runner.dtype, device=engine.device)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    strat = dict(item.split(":") for item in args.strategies.split(","))
    pool = [p.token_ids for p in reasoning_gym_prompts(
        engine.tokenizer, n=max(sizes + [args.tail_prompts, args.prompts]), seed=args.seed)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    pool_a = pool[: args.prompts]

    # (a) fixed strategies, speculation on throughout
    rows = []
    for b in sizes:
        s = strat.get(str(b)) or strat[max(strat, key=lambda k: (int(k) <= b, int(k)))]
        groups = [pool_a[i: i + b] for i in range(0, len(pool_a), b)]
        engine.detach_drafter()
        engine.config.speculative = SpeculativeConfig(policy="fixed", strategy=s,
                                                      threshold=1 << 30)
        engine.generate(groups[0], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
        ratios, plain_tps, spec_tps, accept, checks = [], [], [], [], []
        for _ in range(args.pairs):
            tp = ts = 0.0
            n_tok, acc_rows, acc_sum = 0, 0, 0.0
            for g in groups:
                engine.detach_drafter()
                t, ref, _ = timed(engine, g, sp)
                tp += t
                engine.attach_drafter(drafter)
                t, got, st = timed(engine, g, sp)
                ts += t
                checks.append(check_outputs(engine, g, got, ref, args.tie_margin))
                n_tok += sum(map(len, got))
                acc_rows += st.spec.rows
                acc_sum += st.spec.emitted
            plain_tps.append(n_tok / tp)
            spec_tps.append(n_tok / ts)
            ratios.append(tp / ts)
            accept.append(acc_sum / max(1, acc_rows))
        check = dict(identical=sum(c["identical"] for c in checks),
                     tie_splits=sum(c["tie_splits"] for c in checks),
                     worst_tie_gap=max(c["worst_tie_gap"] for c in checks))
        row = dict(batch=b, strategy=s, plain_tok_s=statistics.median(plain_tps),
                   spec_tok_s=statistics.median(spec_tps), speedup=statistics.median(ratios),
                   speedup_min=min(ratios), speedup_max=max(ratios),
                   accept_len=statistics.median(accept), **check)
        rows.append(row)
        print(f"bs {b:>2} {s:>7}: plain {row['plain_tok_s']:6.1f} tok/s  spec "
              f"{row['spec_tok_s']:6.1f} tok/s  speedup {row['speedup']:.2f} "
              f"[{row['speedup_min']:.2f}, {row['speedup_max']:.2f}]  accept "
              f"{row['accept_len']:.2f}  identical {check['identical']}/"
              f"{len(pool_a) * args.pairs} (tie splits {check['tie_splits']})", flush=True)

    # (b) long-tail batch, adaptive engine
    tail_prompts = pool[: args.tail_prompts]
    tsp = SamplingParams(temperature=0.0, max_new_tokens=args.tail_tokens)
    engine.detach_drafter()
    cfg = SpeculativeConfig() if args.threshold is None else SpeculativeConfig(
        threshold=args.threshold)
    engine.config.speculative = cfg
    tail, tuner = [], None
    for _ in range(args.tail_pairs):
        engine.detach_drafter()
        tp, ref, pst = timed(engine, tail_prompts, tsp)
        engine.attach_drafter(drafter, tuner)  # one tuner across runs: it keeps learning
        tuner = engine.tuner
        ts, got, st = timed(engine, tail_prompts, tsp)
        check = check_outputs(engine, tail_prompts, got, ref, args.tie_margin)
        tail.append(dict(plain_s=tp, adaptive_s=ts, ratio=tp / ts,
                         spec_fraction=st.spec_fraction, **check, spec=st.spec.summary()))
        lengths = sorted(map(len, ref))
        print(f"tail batch of {len(tail_prompts)} (lengths {lengths[0]}..{lengths[-1]}, "
              f"median {statistics.median(lengths)}): plain {tp:.1f}s  adaptive {ts:.1f}s  "
              f"speedup {tp / ts:.2f}  speculating in {st.spec_fraction:.0%} of steps  "
              f"accept {st.spec.accept_len:.2f}  identical {check['identical']}/"
              f"{len(tail_prompts)}", flush=True)
    cost = drafter_cost(engine)
    print(f"drafter forward {cost['drafter'] * 1e3:.2f} ms vs target decode step "
          f"{cost['target'] * 1e3:.2f} ms at batch 1: {cost['ratio']:.3f}x", flush=True)

    bs1 = next((r for r in rows if r["batch"] == 1), None)
    result = {
        "benchmark": "bench_spec",
        "config": dict(model="SmolLM2-135M-Instruct",
                       dtype=str(engine.runner.dtype).replace("torch.", ""), drafter=str(dpath),
                       drafter_config=drafter.config.to_dict(), batch_sizes=sizes,
                       strategies=strat, prompts=args.prompts, new_tokens=args.new_tokens,
                       pairs=args.pairs,
                       tail_prompts=args.tail_prompts, tail_tokens=args.tail_tokens,
                       threshold=cfg.threshold, arms=cfg.arms, seed=args.seed,
                       torch=torch.__version__, megatron_core=megatron.core.__version__,
                       device=(torch.cuda.get_device_name() if engine.device.type == "cuda"
                               else platform.processor() or platform.machine()),
                       threads=torch.get_num_threads(), cpus=os.cpu_count()),
        "results": rows, "tail": tail, "drafter_cost": cost,
        "speedup_bs1": bs1["speedup"] if bs1 else None,
        "accept_len_bs1": bs1["accept_len"] if bs1 else None,
        "tail_batch_speedup": statistics.median(t["ratio"] for t in tail),
    }
    print(json.dumps({k: result[k] for k in ("speedup_bs1", "accept_len_bs1",
                                             "tail_batch_speedup")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
