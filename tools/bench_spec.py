#!/usr/bin/env python
"""Speculative decoding vs plain decoding in the rollout engine (SmolLM2-135M).

    python tools/bench_spec.py --json bench_spec.json          # full (~10 min + warm-up)
    python tools/bench_spec.py --quick                         # a few minutes
    python tools/bench_spec.py --quick --drafter random        # a drafter that loses

The drafter (``--drafter``): a checkpoint path; ``full`` (the default), a warmed
SmolLM2 drafter cached under ``$MEGATRON_TLT_CACHE/drafters/`` (made by
tools/warmup_drafter.py on first use from 8,192 prompts, ~2 h on 2 cores); ``quick``,
the weak drafter of a bounded warm-up (64 prompts, 128 tokens, 4 epochs: a few
minutes; acceptance ~1.5), cached next to it; ``random``, an untrained drafter of the
same shape (seeded); ``self``, the policy's own weight-only int8 copy (the
self-drafter, ``rollout.speculative.drafter=self``). The default is ``quick`` under ``--quick`` when no full drafter
is cached. Training prompts use seed 0, the benchmark's prompts seed 1: held out.

(a) batch sizes 1, 2, 4, 8: the same 8 real reasoning-gym prompts run in batches of
    that size (real responses, EOS ends them, cap --new-tokens): plain decoding, a
    fixed strategy per batch size, and the adaptive engine (the default policy:
    BEG-MAB with the break-even gate, one tuner per batch size kept across its runs,
    as an engine keeps it across rollouts), interleaved (the order alternating from
    group to group); median ratios of tokens/s;
(b) a long-tail batch: 32 prompts, real response lengths (EOS ends a response, cap
    --tail-tokens), the adaptive engine (speculation below the threshold, default
    policy; one tuner across the pairs) and each fixed strategy of --tail-fixed (below
    the same threshold) vs plain decoding.

Both parts also run plain decoding a second time (the A/A control): the ratio of two
runs of identical work shows how far this machine's noise alone moves a ratio, so an
adaptive ratio can be read against it. And per adaptive run, the time of its plain
(declined) steps over plain decoding's at the same batch sizes (median): the gate's
own per-step cost, free of probes and speculative steps.

--sampling-mode coupled (with --temperature > 0): rollout.sampling_mode=coupled, where a
request's sampled response is the same token for token with and without speculation;
outputs are compared with plain decoding's (the count of identical responses is
reported; a mismatch can only come from a floating-point near-tie). Run it next to the
standard mode for the cost of invariance (acceptance and speed, coupled vs standard).

Greedy (the default): outputs must be identical to plain decoding; a sequence may part
from it only where plain decoding's top-2 logits are tied to within --tie-margin
(verification runs different matrix shapes, so the last bits of a logit may differ).
Anything else fails the benchmark. With --temperature > 0 (RL samples at ~1) the
outputs are samples (exact in distribution, not token-identical), so nothing is
compared and speeds are tokens/s.

Also reported: the drafter's cost per forward relative to a target decode step, at
batch 1 (drafter layer + fc + draft head vs the whole target).

JSON summary keys: ``speedup_bs1``, ``accept_len_bs1``, ``tail_batch_speedup``,
``adaptive_min_ratio`` (the smallest adaptive / plain speed over the batch sizes and
the long-tail batch), ``aa_min_ratio`` (the same statistic for plain / plain: the noise
floor), ``declined_step_ratio`` (declined step / plain step time, median over the
batch sizes and the tail), ``adaptive_vs_fixed_bs1`` (adaptive / the fixed strategy at
batch 1), ``adaptive_vs_plain_bs1`` and ``adaptive_vs_plain_tail`` (adaptive / plain at
batch 1 and on the long-tail batch), ``alpha`` (the drafter's exact per-depth acceptance
on held-out sampled responses, ``drafter_training.alpha``), ``tail_best_fixed`` and ``adaptive_vs_best_fixed_tail`` (adaptive / the
fastest fixed strategy on the long-tail batch), ``tail_speedup_bound`` (the most any
per-batch choice of strategy could give the long-tail batch with the speedups measured in
(a): each plain step at batch b sped up by the speedup at the largest measured batch <= b,
``bench.stats.tail_speedup_bound``; each tail pair also records its batch sizes' shares of
plain decoding's time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_tlt.bench.common import check_against_engine, cpu_description, timing_only
from megatron_tlt.bench.stats import (declined_step_ratio, median_or_none, rate_ratio,
                                      tail_speedup_bound, tuned_summary)
from megatron_tlt.drafter_training.prepared import default_drafter_path, ensure_drafter
from megatron_tlt.runtime_env import silence_expected_warnings

DEFAULT_STRATEGIES = "1:7_1_7,2:5_1_5,4:4_1_4,8:4_1_4"


def resolve_drafter(arg, quick_run: bool, engine, seed: int):
    """(drafter, description) for --drafter: full or quick (the warmed drafters, made on
    first use), random (untrained, the warmed ones' shape: a 1,024-token vocabulary), or
    any value a drafter kind takes (self, a checkpoint path)."""
    from megatron_tlt.rollout.speculative.drafters import (is_untrained, make_drafter,
                                                           resolve_value)

    if arg is None:
        arg = "quick" if quick_run and not default_drafter_path().is_file() else "full"
    if arg in ("full", "quick"):
        arg = str(ensure_drafter(default_drafter_path(arg == "quick"), arg == "quick"))
    arg = resolve_value(arg)  # a kind's bare word made concrete (random: 1,024 tokens)
    d = make_drafter(arg, arch=engine.arch, dtype=engine.runner.dtype, device=engine.device,
                     seed=seed)
    return d, f"{d.label} ({arg}{f', seed {seed}' if is_untrained(arg) else ''})"


def drafter_cost(engine, reps: int = 20) -> dict:
    """Median seconds of one target decode step and one drafter step at batch 1."""
    from megatron_tlt.rollout.kv_cache import KVCache

    r, sd = engine.runner, engine.spec
    d = sd.draft
    n = 128
    cache = KVCache(num_layers=len(r.layers), max_batch=1, kv_heads=r.groups, capacity=n + 8,
                    head_dim=r.head_dim, dtype=r.dtype, device=r.device)
    dcache = KVCache(num_layers=len(d.layers), max_batch=1, kv_heads=d.groups, capacity=n + 8,
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


class Modes:
    """Plain, fixed-strategy and adaptive runs on one engine; the adaptive tuner is
    kept (reset with ``new_tuner``) like an engine keeps it across rollouts."""

    def __init__(self, engine, drafter, adaptive_cfg):
        self.engine, self.drafter, self.adaptive_cfg = engine, drafter, adaptive_cfg
        self.tuner = None

    def new_tuner(self) -> None:
        self.tuner = None

    def run(self, mode: str, prompts, sp, fixed_cfg=None):
        e = self.engine
        e.detach_drafter()
        if mode == "fixed":
            e.config.speculative = fixed_cfg
            e.attach_drafter(self.drafter)
        elif mode == "adaptive":
            e.config.speculative = self.adaptive_cfg
            e.attach_drafter(self.drafter, self.tuner)
            self.tuner = e.tuner
        t0 = time.perf_counter()
        outs = e.generate(prompts, sp)
        return time.perf_counter() - t0, [o.token_ids for o in outs], e.last_stats


def run_ratio(run, plain_run) -> float:
    """``rate_ratio`` of two ``Modes.run`` results (seconds, outputs, stats)."""
    return rate_ratio(sum(map(len, run[1])), run[0], sum(map(len, plain_run[1])), plain_run[0])


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def held_out_alpha(engine, drafter, prompts, temperature, strategy, max_new, seed):
    """The drafter's exact alpha at depths 1..(the batch-1 chain's depth) on sampled
    responses to ``prompts`` at ``temperature`` (T=1 for a greedy benchmark: what RL
    rollouts would accept), as a dict (``drafter_training.alpha.AlphaReport``)."""
    if not prompts:
        return None
    from megatron_tlt.drafter_training.alpha import held_out_samples, measured_accept_len
    from megatron_tlt.drafter_training.alpha_kinds import alpha_by_kind
    from megatron_tlt.rollout import SamplingParams
    from megatron_tlt.spec_strategy import Strategy

    t = temperature or 1.0
    s = Strategy.parse(strategy)
    depth = s.depth if s.is_chain else 4
    sp = SamplingParams(temperature=t, max_new_tokens=max_new, seed=seed + 7)
    held = held_out_samples(engine, prompts, sp, feature_layers=drafter.feature_layers)
    rep = alpha_by_kind(engine.runner, {drafter.name: drafter}, held, temperature=t,
                        depth=depth)[drafter.name]
    # the same prompts and sampling decoded with that chain always on: what the
    # prediction from alpha should match
    rep.measured_accept_len = measured_accept_len(engine, drafter, prompts, sp,
                                                  depth)["accept_len"]
    print(f"held-out {rep.line()}", flush=True)
    return rep.to_dict()


RECIPE_SEED_OFFSET = 7919  # --config: prompts unrelated to the warm-up's (seed data.seed)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--drafter", default=None,
                    help="drafter checkpoint, or full | quick | random | self (default: full, or "
                         "quick under --quick when no full drafter is cached)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                    help="fixed strategy per batch size for (a): 'bs:depth_topk_verify,...'")
    ap.add_argument("--prompts", type=int, default=8, help="prompts for (a)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=None, help="interleaved runs per batch size "
                    "(default 2; 1 under --quick)")
    ap.add_argument("--tail-prompts", type=int, default=32)
    ap.add_argument("--tail-tokens", type=int, default=384)
    ap.add_argument("--tail-pairs", type=int, default=None,
                    help="long-tail pairs (default 2; 1 under --quick)")
    ap.add_argument("--tail-fixed", default=None,
                    help="fixed strategies also run on the long-tail batch, comma-separated "
                         "(default: those of --strategies; 'none': skip)")
    ap.add_argument("--threshold", type=int, default=None,
                    help="adaptive engine's speculation threshold (default: the config's)")
    ap.add_argument("--break-even", choices=("on", "off"), default="on",
                    help="adaptive engine's break-even gate (off: the bandit alone)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (0 = greedy, outputs checked against plain "
                         "decoding; > 0: seeded samples, speeds in tokens/s, no check)")
    ap.add_argument("--sampling-mode", choices=("standard", "coupled"), default="standard",
                    help="rollout.sampling_mode (coupled: sampled outputs are compared "
                         "with plain decoding's token for token)")
    ap.add_argument("--tie-margin", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="batch sizes 1,2 over 2 prompts; 64 tokens; 1 pair; tail of 8 prompts, "
                         "128 tokens (--pairs / --tail-pairs given explicitly are kept)")
    ap.add_argument("--alpha-prompts", type=int, default=4,
                    help="prompts (the last of the benchmark pool, unseen in warm-up) whose sampled responses "
                         "measure the drafter's exact alpha by depth (0: skip)")
    ap.add_argument("--config", default=None,
                    help="RL recipe (YAML): prompts of its task in its prompt format, drawn "
                         "with a seed its warm-up does not use (default: basic_arithmetic)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="rollout.cuda_graphs=true (CUDA: decode, verification and "
                         "one-layer drafting steps replayed from graphs; without the "
                         "flag the bench runs eager steps, cuda_graphs=false)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.new_tokens, args.prompts = "1,2", 64, 2
        args.tail_prompts, args.tail_tokens = 8, 128
    args.pairs = args.pairs or (1 if args.quick else 2)
    args.tail_pairs = args.tail_pairs or (1 if args.quick else 2)
    return args


def prompt_pool(args, engine, n: int) -> list[list[int]]:
    """``n`` benchmark prompts: of the recipe's task (--config; a seed its warm-up never
    uses), else of basic_arithmetic, seed --seed."""
    if args.config:  # the recipe's task; seed offset so its warm-up never saw them
        from megatron_tlt.drafter_training.warmup import WarmupConfig, recipe_prompts

        rcfg = WarmupConfig.from_recipe(args.config)
        return recipe_prompts(rcfg, engine.tokenizer, n,
                              seed=rcfg.seed + RECIPE_SEED_OFFSET + args.seed)
    from megatron_tlt.tasks import reasoning_gym_prompts

    return [p.token_ids for p in reasoning_gym_prompts(engine.tokenizer, n=n, seed=args.seed)]


class Outputs:
    """The runs' sampling and how their outputs are held against plain decoding's:
    greedy outputs identical up to near-ties (``check_against_engine``), coupled samples
    identical (counted), standard samples not compared (exact in distribution only)."""

    def __init__(self, engine, args):
        self.engine, self.tie_margin, self.seed = engine, args.tie_margin, args.seed
        self.greedy = args.temperature <= 0
        self.temp = 0.0 if self.greedy else args.temperature
        self.coupled = args.sampling_mode == "coupled" and not self.greedy
        self.compared = self.greedy or self.coupled

    def params(self, max_new: int):
        from megatron_tlt.rollout import SamplingParams

        return SamplingParams(temperature=self.temp, max_new_tokens=max_new,
                              seed=None if self.greedy else self.seed)

    def check(self, prompts, got, ref) -> dict:
        if self.coupled:  # the same samples with and without speculation
            return dict(identical=sum(a == b for a, b in zip(got, ref)), tie_splits=None,
                        worst_tie_gap=None)
        if not self.greedy:  # samples: exact in distribution, not token by token
            return dict(identical=None, tie_splits=None, worst_tie_gap=None)
        return check_against_engine(self.engine, prompts, got, ref, self.tie_margin)

    def merge(self, checks) -> dict:
        if self.coupled:
            return dict(identical=sum(c["identical"] for c in checks), tie_splits=None,
                        worst_tie_gap=None)
        if not self.greedy:
            return dict(identical=None, tie_splits=None, worst_tie_gap=None)
        return dict(identical=sum(c["identical"] for c in checks),
                    tie_splits=sum(c["tie_splits"] for c in checks),
                    worst_tie_gap=max(c["worst_tie_gap"] for c in checks))


def batch_pairs(args, modes: Modes, out: Outputs, groups, fixed_cfg, sp) -> dict:
    """--pairs rounds over one batch size's groups: plain, fixed, adaptive and plain
    again (the A/A control), the order alternating from group to group."""
    runs = {m: [] for m in ("plain", "fixed", "adaptive", "aa")}
    got = dict(runs=runs, accept=[], checks=[], adaptive_checks=[], decisions=[],
               step_ratios=[])
    for pair in range(args.pairs):
        tot = {m: [0.0, 0] for m in runs}
        acc_rows, acc_sum = 0, 0
        for gi, g in enumerate(groups):
            # the order alternates (plain first, then last), so a drift of the
            # machine within a group's runs does not favour one mode; "aa" is plain
            # decoding again, the A/A control: how far identical work measures apart
            order = ("plain", "fixed", "adaptive", "aa") if (pair + gi) % 2 == 0 else \
                ("aa", "adaptive", "fixed", "plain")
            res = {}
            for m in order:
                res[m] = modes.run("plain" if m == "aa" else m, g, sp, fixed_cfg)
                tot[m][0] += res[m][0]
                tot[m][1] += sum(map(len, res[m][1]))
            ref = res["plain"][1]
            _, outs, st = res["fixed"]
            got["checks"].append(out.check(g, outs, ref))
            acc_rows += st.spec.rows
            acc_sum += st.spec.emitted
            _, outs, st = res["adaptive"]
            got["adaptive_checks"].append(out.check(g, outs, ref))
            got["decisions"].append(tuned_summary(st))
            got["step_ratios"].append(declined_step_ratio(st, res["plain"][2]))
        for m, (sec, tok) in tot.items():
            runs[m].append((sec, tok))
        got["accept"].append(acc_sum / max(1, acc_rows))
    return got


def batch_row(b: int, s: str, got: dict, out: Outputs, tuner) -> dict:
    """One batch size's row: median speeds and ratios over the pairs, the checks, the
    adaptive engine's decisions."""
    runs, decisions = got["runs"], got["decisions"]
    tps = {m: [tok / sec for sec, tok in runs[m]] for m in runs}
    ratios = {m: [rate_ratio(a[1], a[0], p[1], p[0]) for a, p in zip(runs[m], runs["plain"])]
              for m in ("fixed", "adaptive", "aa")}
    declined = sum(d["declined"] for d in decisions) / max(1, sum(
        d["tuned_steps"] for d in decisions))
    return dict(batch=b, strategy=s, plain_tok_s=statistics.median(tps["plain"]),
                spec_tok_s=statistics.median(tps["fixed"]),
                speedup=statistics.median(ratios["fixed"]),
                speedup_min=min(ratios["fixed"]), speedup_max=max(ratios["fixed"]),
                accept_len=statistics.median(got["accept"]), **out.merge(got["checks"]),
                adaptive_tok_s=statistics.median(tps["adaptive"]),
                adaptive_speedup=statistics.median(ratios["adaptive"]),
                adaptive_speedup_min=min(ratios["adaptive"]),
                adaptive_speedup_max=max(ratios["adaptive"]),
                adaptive_spec_fraction=statistics.mean(d["spec_fraction"] for d in decisions),
                adaptive_declined_fraction=declined,
                adaptive_probes=sum(d["probes"] for d in decisions),
                adaptive_check=out.merge(got["adaptive_checks"]),
                adaptive_vs_fixed=statistics.median(
                    a / f for a, f in zip(ratios["adaptive"], ratios["fixed"])),
                declined_step_ratio=median_or_none(got["step_ratios"]),
                aa_ratio=statistics.median(ratios["aa"]), aa_ratio_min=min(ratios["aa"]),
                aa_ratio_max=max(ratios["aa"]),
                adaptive_tuner=tuner.gate_stats() if tuner is not None else None)


def print_batch_row(row: dict, outputs: int, out: Outputs) -> None:
    b, s = row["batch"], row["strategy"]
    ident = (f"identical {row['identical']}/{outputs} (tie splits "
             f"{row['tie_splits']}), adaptive {row['adaptive_check']['identical']}"
             if out.compared else "sampled")
    print(f"bs {b:>2} {s:>7}: plain {row['plain_tok_s']:6.1f} tok/s  spec "
          f"{row['spec_tok_s']:6.1f} tok/s  speedup {row['speedup']:.2f} "
          f"[{row['speedup_min']:.2f}, {row['speedup_max']:.2f}]  accept "
          f"{row['accept_len']:.2f}  | adaptive {row['adaptive_tok_s']:6.1f} tok/s  "
          f"{row['adaptive_speedup']:.2f} [{row['adaptive_speedup_min']:.2f}, "
          f"{row['adaptive_speedup_max']:.2f}]  speculating "
          f"{row['adaptive_spec_fraction']:.0%}, declined "
          f"{row['adaptive_declined_fraction']:.0%}, {row['adaptive_probes']} probes, "
          f"declined step {_fmt(row['declined_step_ratio'])}x plain's  | A/A "
          f"{row['aa_ratio']:.2f} [{row['aa_ratio_min']:.2f}, {row['aa_ratio_max']:.2f}]  "
          f"| {ident}", flush=True)


def batch_sizes_part(args, modes: Modes, out: Outputs, prompts, sizes, strat, cfg) -> list:
    """(a): per batch size, plain, a fixed strategy (speculation on throughout) and the
    adaptive engine (one tuner per batch size, kept across its runs)."""
    from megatron_tlt.config import SpeculativeConfig

    sp = out.params(args.new_tokens)
    rows = []
    for b in sizes:
        s = strat.get(str(b)) or strat[max(strat, key=lambda k: (int(k) <= b, int(k)))]
        groups = [prompts[i: i + b] for i in range(0, len(prompts), b)]
        fixed_cfg = SpeculativeConfig(policy="fixed", strategy=s, threshold=1 << 30)
        modes.adaptive_cfg = dataclasses.replace(cfg, threshold=max(cfg.threshold, b))
        modes.new_tuner()
        warm = out.params(4)
        for mode in ("plain", "fixed", "adaptive"):  # warm-up (the tuner starts here)
            modes.run(mode, groups[0], warm, fixed_cfg)
        got = batch_pairs(args, modes, out, groups, fixed_cfg, sp)
        rows.append(batch_row(b, s, got, out, modes.tuner if cfg.break_even else None))
        print_batch_row(rows[-1], len(prompts) * args.pairs, out)
    return rows


def tail_pair(pair: int, modes: Modes, out: Outputs, prompts, tsp, fixed_cfgs: dict,
              speedup_at: dict, threshold: int) -> dict:
    """One long-tail pair: plain, adaptive, each fixed strategy and the A/A control (the
    order reversed on odd pairs); its entry, printed."""
    order = ["plain", "adaptive", *fixed_cfgs, "aa"]
    if pair % 2:  # alternating order, as in (a)
        order.reverse()
    res = {}
    for m in order:
        res[m] = modes.run("plain" if m == "aa" else "fixed" if m in fixed_cfgs else m,
                           prompts, tsp, fixed_cfgs.get(m))
    tp, ref, pst = res["plain"]
    ts, got, st = res["adaptive"]
    c = out.check(prompts, got, ref)
    ratio = run_ratio(res["adaptive"], res["plain"])
    fixed = {}
    for m in fixed_cfgs:
        fs, fgot, fst = res[m]
        fixed[m.split(":", 1)[1]] = dict(
            seconds=fs, ratio=run_ratio(res[m], res["plain"]),
            identical=out.check(prompts, fgot, ref)["identical"],
            accept_len=fst.spec.accept_len, spec_fraction=fst.spec_fraction)
    entry = dict(plain_s=tp, adaptive_s=ts, ratio=ratio,
                 plain_tokens=sum(map(len, ref)), adaptive_tokens=sum(map(len, got)),
                 aa_s=res["aa"][0], aa_ratio=run_ratio(res["aa"], res["plain"]),
                 declined_step_ratio=declined_step_ratio(st, pst), fixed=fixed,
                 **tuned_summary(st), **c, spec=st.spec.summary(),
                 graphs=st.graphs,  # rollout.cuda_graphs=auto's choice per key
                 bound=tail_speedup_bound(pst, speedup_at, threshold))
    lengths = sorted(map(len, ref))
    ident = f"identical {c['identical']}/{len(prompts)}" if out.compared else "sampled"
    fixed_text = "".join(f"  {f} {v['ratio']:.2f}" for f, v in fixed.items())
    print(f"tail batch of {len(prompts)} (lengths {lengths[0]}..{lengths[-1]}, "
          f"median {statistics.median(lengths)}): plain {tp:.1f}s  adaptive {ts:.1f}s  "
          f"speedup {ratio:.2f}  speculating in {st.spec_fraction:.0%} of steps, "
          f"declined {entry['declined_fraction']:.0%} of the tuned steps  "
          f"accept {st.spec.accept_len:.2f}  {ident}  | fixed:{fixed_text or ' -'}  "
          f"| A/A {entry['aa_ratio']:.2f}  declined step "
          f"{_fmt(entry['declined_step_ratio'])}x plain's", flush=True)
    return entry


def long_tail_part(args, modes: Modes, out: Outputs, prompts, strat, cfg, rows):
    """(b): the long-tail batch, --tail-pairs pairs (one tuner across them: it keeps
    learning); (its entries, the fixed strategies run on it)."""
    from megatron_tlt.config import SpeculativeConfig

    tsp = out.params(args.tail_tokens)
    modes.adaptive_cfg = cfg
    modes.new_tuner()
    tail_fixed = [] if args.tail_fixed == "none" else list(dict.fromkeys(
        (args.tail_fixed or ",".join(strat.values())).split(",")))
    fixed_cfgs = {f"fixed:{f}": SpeculativeConfig(policy="fixed", strategy=f,
                                                  threshold=cfg.threshold)
                  for f in tail_fixed}
    # the best measured speedup at each batch size of (a): the tail's upper bound
    speedup_at = {r["batch"]: max(r["speedup"], r["adaptive_speedup"]) for r in rows}
    tail = [tail_pair(pair, modes, out, prompts, tsp, fixed_cfgs, speedup_at, cfg.threshold)
            for pair in range(args.tail_pairs)]
    return tail, tail_fixed


def config_record(args, engine, drafter, dname, cfg, out: Outputs, sizes, strat,
                  tail_fixed) -> dict:
    import megatron.core

    return dict(model="SmolLM2-135M-Instruct",
                dtype=str(engine.runner.dtype).replace("torch.", ""), drafter=dname,
                drafter_config=drafter.settings(), batch_sizes=sizes,
                strategies=strat, prompts=args.prompts, new_tokens=args.new_tokens,
                pairs=args.pairs,
                tail_prompts=args.tail_prompts, tail_tokens=args.tail_tokens,
                tail_pairs=args.tail_pairs, tail_fixed=tail_fixed,
                threshold=cfg.threshold, arms=cfg.arms, self_arms=cfg.kinds.self.arms,
                seed=args.seed,
                break_even=cfg.break_even, probe_budget=cfg.probe_budget,
                temperature=out.temp, sampling_mode=args.sampling_mode, recipe=args.config,
                tie_margin=args.tie_margin, cuda_graphs=args.cuda_graphs,
                **cpu_description(engine),
                kernels_on=engine.runner.kernels is not None,
                torch=torch.__version__, megatron_core=megatron.core.__version__,
                device=(torch.cuda.get_device_name() if engine.device.type == "cuda"
                        else platform.processor() or platform.machine()),
                threads=torch.get_num_threads(), cpus=os.cpu_count())


def headline(rows, tail, tail_fixed, alpha) -> dict:
    """The summary keys (the module's docstring) from (a)'s rows and (b)'s pairs."""
    bs1 = next((r for r in rows if r["batch"] == 1), None)
    tail_ratio = statistics.median(t["ratio"] for t in tail)
    best_fixed = max(((f, statistics.median(t["fixed"][f]["ratio"] for t in tail))
                      for f in tail_fixed), key=lambda x: x[1], default=None)
    return {
        "speedup_bs1": bs1["speedup"] if bs1 else None,
        "accept_len_bs1": bs1["accept_len"] if bs1 else None,
        "tail_batch_speedup": tail_ratio,
        "adaptive_min_ratio": min([r["adaptive_speedup"] for r in rows] + [tail_ratio]),
        # the same statistic for plain decoding run twice: the noise floor of the above
        "aa_min_ratio": min([r["aa_ratio"] for r in rows]
                            + [statistics.median(t["aa_ratio"] for t in tail)]),
        "declined_step_ratio": median_or_none(
            [r["declined_step_ratio"] for r in rows]
            + [t["declined_step_ratio"] for t in tail]),
        "adaptive_vs_fixed_bs1": bs1["adaptive_vs_fixed"] if bs1 else None,
        "adaptive_vs_plain_bs1": bs1["adaptive_speedup"] if bs1 else None,
        "adaptive_vs_plain_tail": tail_ratio,
        # no choice of strategy per batch beats this with (a)'s speedups (stats.py)
        "tail_speedup_bound": median_or_none(
            [t["bound"]["bound"] for t in tail if t["bound"]]),
        "alpha": alpha,
        "tail_best_fixed": best_fixed[0] if best_fixed else None,
        "adaptive_vs_best_fixed_tail": tail_ratio / best_fixed[1] if best_fixed else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    from megatron_tlt.assets import require_smollm2, weights_are_random
    from megatron_tlt.rollout.speculative.drafters import is_untrained
    from megatron_tlt.bench.sync_budget import plain_and_spec_syncs
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.drafter_training.warmup import WarmupError
    from megatron_tlt.rollout import RolloutEngine

    engine = RolloutEngine.from_pretrained(
        require_smollm2(), RolloutConfig(max_batch_size=64, sampling_mode=args.sampling_mode,
                                         cuda_graphs=args.cuda_graphs))
    try:
        drafter, dname = resolve_drafter(args.drafter, args.quick, engine, args.seed)
    except WarmupError as e:  # the benchmark's own drafter could not be warmed up
        raise SystemExit(str(e)) from None
    print(f"drafter: {dname}", flush=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    strat = dict(item.split(":") for item in args.strategies.split(","))
    pool = prompt_pool(args, engine, max(sizes + [args.tail_prompts, args.prompts]))
    out = Outputs(engine, args)
    break_even = args.break_even == "on"
    cfg = SpeculativeConfig(break_even=break_even) if args.threshold is None else \
        SpeculativeConfig(threshold=args.threshold, break_even=break_even)
    modes = Modes(engine, drafter, cfg)
    rows = batch_sizes_part(args, modes, out, pool[: args.prompts], sizes, strat, cfg)
    tail, tail_fixed = long_tail_part(args, modes, out, pool[: args.tail_prompts], strat,
                                      cfg, rows)
    if engine.spec is None:  # the last run was plain: the drafter is measured attached
        engine.attach_drafter(drafter)
    cost = drafter_cost(engine)
    print(f"drafter forward {cost['drafter'] * 1e3:.2f} ms vs target decode step "
          f"{cost['target'] * 1e3:.2f} ms at batch 1: {cost['ratio']:.3f}x", flush=True)
    strategy = next((r for r in rows if r["batch"] == 1), rows[0])["strategy"]
    alpha = held_out_alpha(engine, drafter, pool[-args.alpha_prompts:] if args.alpha_prompts
                           else [], out.temp, strategy, args.tail_tokens, args.seed)
    syncs = plain_and_spec_syncs(engine, drafter, pool[:2], out.params(8), strategy)
    print(f"host syncs per step: plain {syncs['host_syncs_plain_step']}, speculative "
          f"{syncs['host_syncs_spec_step']}", flush=True)
    label = timing_only(target_random=weights_are_random(require_smollm2()),
                        drafter_random=is_untrained(str(args.drafter)))
    if label["timing_only"]:
        print(f"timing only: {label['timing_only_reason']}", flush=True)
    result = {"benchmark": "bench_spec", **label,
              "config": config_record(args, engine, drafter, dname, cfg, out, sizes, strat,
                                      tail_fixed),
              "results": rows, "tail": tail, "drafter_cost": cost,
              **headline(rows, tail, tail_fixed, alpha), **syncs}
    print(json.dumps({k: result[k] for k in (
        "speedup_bs1", "accept_len_bs1", "adaptive_vs_plain_bs1", "adaptive_vs_plain_tail",
        "tail_batch_speedup", "tail_speedup_bound", "adaptive_min_ratio",
        "aa_min_ratio", "declined_step_ratio", "adaptive_vs_fixed_bs1",
        "adaptive_vs_best_fixed_tail", "host_syncs_plain_step", "host_syncs_spec_step")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
