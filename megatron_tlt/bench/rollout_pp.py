"""Rollout at pipeline parallelism 2 against the PP = 1 engine and the recompute loop.

    torchrun --standalone --nproc_per_node 2 tools/bench_rollout.py --pp 2 \
        --json docs/results/bench_rollout_pp2_cpu.json

(``tools/bench_rollout.py --pp 2`` is its command line: ``run(args)`` with its flags.)
SmolLM2-135M-Instruct, greedy, EOS ignored, real reasoning-gym prompts. The two
processes hold:

- the PP = 2 engine in each ``--modes`` value of ``rollout.pipeline_mode`` (the first
  one is the headline): stage 0 (layers 0..14) on rank 0, stage 1 (15..29) on rank 1;
  ``gathered``: each rank also holds a copy of the other stage's layers, refreshed at
  every call, and decodes half the prompts; ``pipelined``: activations pass stage to
  stage; ``--threads`` torch threads per rank;
- a PP = 1 engine (the whole model) on rank 0 with ``--pp1-threads`` threads (default
  ``--threads`` x ``--pp``: the same cores), and in every pair also at
  ``--pp1-alt-threads`` (``ratio_vs_pp1_N_threads``: on a loaded machine a
  multi-threaded process loses far more than a single-threaded one, so the two bracket
  the comparison); while it runs, rank 1 waits at a barrier;
- ``bench.reference.recompute_generate`` at PP = 2 (megatron-core's pipeline
  schedule, the whole sequence recomputed per token; the path the trainer took at
  PP > 1 before the pipelined engine), at batch 1 and short lengths only (quadratic).

Runs interleave (warm-up, then PP=1, PP=2, PP=1, PP=2, ...; each pair a throughput
ratio, the median reported) at batch 1, 8 and 32 of ``--new-tokens`` tokens and on a
long-tail batch (32 prompts, log-normal lengths, median 32, cap 256). An A/A control
(PP=1 against itself, interleaved the same way) shows how much the shared machine
moves a ratio. Length scaling: batch-1 per-token decode time at 64, 256 and 1,024
new tokens, PP = 2 and PP = 1.

With ``--spec-drafter`` (a drafter file), speculation against pipeline depth: the
PP = 1 engine and each PP = 2 mode, plain and speculative runs interleaved at batch 1
and on the long-tail batch, greedy and at T = 1 (``--spec-temperatures``; coupled
sampling, so both emit the same tokens), with the fixed ``--spec-strategy``: the
speed-up, the acceptance length and the identity per cell (JSON ``speculation``).

Each case also reports the gathered mode's weight sync per call (``pack_seconds``:
the broadcasts and the kernels' weight packing) and its copies' bytes per rank.

JSON summary keys: ``pp2_vs_pp1_min`` (smallest PP=2 / PP=1 throughput ratio over
batches 8 and 32), ``tokens_identical`` (fraction of PP=2 sequences equal to PP=1's,
over every compared run), ``length_scaling`` (PP=2 per-token time at 1,024 tokens /
at 64, ``--lengths``; ``length_scaling_256`` at 256 / at 64; ``length_scaling_pp1``
the PP = 1 engine's).
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from .stats import median_or_none

__all__ = ["run", "PPEngines", "MINI"]

MINI = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4)
MINI_NOTE = ("random Llama, SmolLM2's tokenizer and vocabulary (49,152, tied), "
             + ", ".join(f"{k}={v}" for k, v in MINI.items()))


def _step_ms(stats, rows: int):
    """Median decode step (ms) of ``stats`` over its steps at ``rows`` running rows
    (None: no such step)."""
    got = [t for b, t in zip(stats.batch_sizes, stats.step_seconds) if b == rows]
    return 1e3 * statistics.median(got) if got else None


def _prefill_ms_per_token(stats):
    """Prefill time per prompt token (ms): summed over ranks when merged, as the
    ranks' prefills run at the same time, each on its own prompts."""
    return 1e3 * stats.prefill_seconds / stats.prefill_tokens if stats.prefill_tokens else None


def _mini_model(smollm2: Path, rank: int) -> Path:
    """``--model mini``: a random 8-layer, 256-wide Llama with SmolLM2's tokenizer (for
    machines too loaded to time SmolLM2 in reasonable time); built by rank 0."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.gettempdir()) / "megatron_tlt_bench_mini"
    if rank == 0 and not (out / "model.safetensors").exists():
        cfg = AutoConfig.from_pretrained(smollm2)
        for k, v in MINI.items():
            setattr(cfg, k, v)
        cfg.head_dim = MINI["hidden_size"] // MINI["num_attention_heads"]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        for f in Path(smollm2).iterdir():
            if f.name.startswith(("tokenizer", "chat_template")):
                shutil.copy(f, out / f.name)
    collectives.barrier()
    return out


class PPEngines:
    """The PP = 1 engine (rank 0, ``--pp1-threads``) and one PP = 2 engine per
    ``--modes`` value (every rank, ``--threads``) on the same weights, and their timed
    runs: every rank calls ``run_pp1`` / ``run_pp2`` together."""

    def __init__(self, args, plat):
        from megatron.core import parallel_state as ps

        from ..assets import require_smollm2
        from ..config import RolloutConfig
        from ..models import load_model, load_tokenizer
        from ..parallel import initialize_model_parallel
        from ..rollout import RolloutEngine

        self.args, self.rank = args, dist.get_rank()
        self.pp1_threads = args.pp1_threads or args.threads * args.pp
        self.modes = args.modes.split(",")
        self.alt = args.pp1_alt_threads if args.pp1_alt_threads != self.pp1_threads else 0
        src = require_smollm2() if args.model == "smollm2" else _mini_model(
            require_smollm2(), plat.rank)
        self.tok = tok = load_tokenizer(src)
        # coupled sampling: a sampled run emits the same tokens whatever the engine's
        # depth and whether it speculates (greedy runs are unaffected)
        cfg = RolloutConfig(cpu_kernels=args.cpu_kernels, sampling_mode="coupled")
        # the PP = 1 model first (every rank builds one: the groups are collective),
        # then the stages of the PP = 2 one; each engine's runner keeps its own groups
        initialize_model_parallel(1, 1, seed=1234)
        model1, self.arch = load_model(src, device=plat.device, dtype=args.dtype)
        torch.set_num_threads(self.pp1_threads)  # (the kernels' calibration is per thread count)
        self.pp1 = RolloutEngine(model1, tok, cfg, arch=self.arch) if self.rank == 0 else None
        torch.set_num_threads(args.threads)
        if self.rank != 0:
            del model1
        ps.destroy_model_parallel()
        initialize_model_parallel(1, args.pp, seed=1234)
        self.model2, _ = load_model(src, device=plat.device, dtype=args.dtype)
        self.engines = {m: RolloutEngine(self.model2, tok, replace(cfg, pipeline_mode=m),
                                         arch=self.arch) for m in self.modes}
        self.pp2 = self.engines[self.modes[0]]
        self.log(f"engines ready: PP=1 on rank 0 ({self.pp1_threads} threads), PP=2 "
                 f"{'/'.join(self.modes)} on both ranks ({args.threads} threads each), "
                 f"stages of {self.model2.decoder.layers.__len__()} layers")

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def run_pp1(self, prompts, params, threads=None):
        """The PP = 1 engine on rank 0 (rank 1 idle at the barrier); (outputs, seconds)."""
        out, sec = None, 0.0
        if self.rank == 0:
            torch.set_num_threads(threads or self.pp1_threads)
            t0 = time.perf_counter()
            out = self.pp1.generate(prompts, params)
            sec = time.perf_counter() - t0
            torch.set_num_threads(self.args.threads)
        collectives.barrier()
        return out, sec

    def run_pp2(self, prompts, params, mode=None):
        """A PP = 2 engine (the headline mode by default); (outputs, seconds)."""
        collectives.barrier()
        t0 = time.perf_counter()
        out = self.engines[mode or self.modes[0]].generate(prompts, params)
        return out, time.perf_counter() - t0


class Tally:
    """PP = 2 sequences compared with PP = 1's, and how many were identical."""

    def __init__(self):
        self.compared = self.identical = 0

    def add(self, ref, got) -> int:
        same = sum(a.token_ids == b.token_ids for a, b in zip(ref, got))
        self.compared += len(ref)
        self.identical += same
        return same


def case_row(args, E: PPEngines, tally: Tally, name, prompts, params, n_tokens):
    """One case: a warm-up, then --pairs rounds of PP=1, PP=2, PP=1 again (A/A), PP=1 at
    the other thread count and the other modes; its row on rank 0 (None elsewhere)."""
    from ..rollout import SamplingParams

    warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    E.run_pp1(prompts, warm)
    for m in E.modes:
        E.run_pp2(prompts, warm, m)
    ratios, aa, t1s, t2s, same_here = [], [], [], [], 0
    other = {m: [] for m in E.modes[1:]}  # the other modes' ratios to PP = 1
    packs, alt_ratios = [], []
    steps1, steps2, pre1, pre2 = [], [], [], []
    share = -(-len(prompts) // args.pp)  # a PP = 2 rank's rows
    for _ in range(args.pairs):
        o1, s1 = E.run_pp1(prompts, params)
        if E.rank == 0:
            steps1.append(_step_ms(E.pp1.last_stats, len(prompts)))
            pre1.append(_prefill_ms_per_token(E.pp1.last_stats))
        o2, s2 = E.run_pp2(prompts, params)
        packs.append(E.pp2.last_stats.pack_seconds)
        # each rank's own decode steps at its full share of the batch (the merged
        # stats hold every rank's steps): two 1-thread engines side by side
        steps2.append(_step_ms(E.pp2.last_stats, share))
        pre2.append(_prefill_ms_per_token(E.pp2.last_stats))
        o1b, s1b = E.run_pp1(prompts, params)  # A/A: PP=1 against itself
        if E.alt:  # PP = 1 at another thread count (a loaded machine punishes threads)
            _, sa = E.run_pp1(prompts, params, E.alt)
            alt_ratios.append(sa / s2)
        for m in E.modes[1:]:
            om, sm = E.run_pp2(prompts, params, m)
            if E.rank == 0:
                other[m].append(s1b / sm)
                tally.add(o1, om)
        if E.rank == 0:
            same_here += tally.add(o1, o2)
            ratios.append(s1 / s2)
            aa.append(s1 / s1b)
            t1s.append(n_tokens / s1)
            t2s.append(n_tokens / s2)
    if E.rank != 0:
        return None
    return dict(case=name, tokens=n_tokens, pp1_tok_s=statistics.median(t1s),
                pp2_tok_s=statistics.median(t2s), ratio=statistics.median(ratios),
                ratio_min=min(ratios), ratio_max=max(ratios),
                aa_ratio=statistics.median(aa), aa_min=min(aa), aa_max=max(aa),
                identical=same_here / (len(prompts) * args.pairs),
                pp2_kv_cache_bytes_per_stage=E.pp2.last_stats.kv_cache_bytes,
                pp2_pack_seconds=statistics.median(packs),
                # per decode step of one engine at its running batch: PP = 1 at the
                # whole batch, and a PP = 2 rank at its share beside the other rank
                # (the planner's co-run table); prefill per prompt token
                pp1_step_ms=median_or_none(steps1), pp2_rows_per_rank=share,
                pp2_step_ms=median_or_none(steps2),
                pp1_prefill_ms_per_token=median_or_none(pre1),
                pp2_prefill_ms_per_token=median_or_none(pre2),
                **{f"ratio_{m}": statistics.median(v) for m, v in other.items()},
                **({f"ratio_vs_pp1_{E.alt}_threads": statistics.median(alt_ratios)}
                   if E.alt else {}))


def log_case(E: PPEngines, row: dict) -> None:
    alt = E.alt
    E.log(f"{row['case']:>9}: PP=1 {row['pp1_tok_s']:7.1f} tok/s  PP=2 "
          f"{row['pp2_tok_s']:7.1f} tok/s  PP2/PP1 {row['ratio']:.2f} [{row['ratio_min']:.2f}, "
          f"{row['ratio_max']:.2f}]  A/A {row['aa_ratio']:.2f} [{row['aa_min']:.2f}, "
          f"{row['aa_max']:.2f}]  identical to PP=1 {row['identical']:.2f}  sync+pack "
          f"{row['pp2_pack_seconds'] * 1e3:.0f} ms"
          + "".join(f"  {m} / PP=1 {row['ratio_' + m]:.2f}" for m in E.modes[1:])
          + (f"  PP2 / PP=1 at {alt} threads {row[f'ratio_vs_pp1_{alt}_threads']:.2f}"
             if alt else ""))


def spec_by_depth(args, E: PPEngines, pool, tail) -> dict:
    """Speculation against pipeline depth: for the PP = 1 engine and each PP = 2 mode,
    plain and speculative runs interleaved (``--spec-pairs`` pairs) at batch 1 and on the
    long-tail batch, at every ``--spec-temperatures`` value, with ``--spec-drafter`` (a
    drafter file) and the fixed ``--spec-strategy``. Per cell: tokens per second plain
    and speculative, their ratio (the speed-up), the acceptance length and whether both
    emitted the same tokens (exact speculation: they must)."""
    from ..config import SpeculativeConfig
    from ..models.drafter import load_drafter
    from ..rollout import SamplingParams
    from ..rollout.speculative.tuner import StrategyTuner

    path = args.spec_drafter
    tuner_cfg = SpeculativeConfig(policy="fixed", strategy=args.spec_strategy)
    depths = {"pp1": E.pp1 if E.rank == 0 else None,
              **{f"pp2_{m}": E.engines[m] for m in E.modes}}
    temps = [float(t) for t in args.spec_temperatures.split(",")]
    out = {"drafter": path, "strategy": args.spec_strategy, "cells": []}

    def workload(case: str, temp: float):
        """A cell's prompts, sampling parameters and tokens to generate."""
        if case == "batch 1":
            return pool[:1], SamplingParams(temperature=temp, max_new_tokens=args.new_tokens,
                                            ignore_eos=True, seed=args.seed), args.new_tokens
        return pool[:32], [SamplingParams(temperature=temp, max_new_tokens=r.target_len,
                                          ignore_eos=True, seed=args.seed + i)
                           for i, r in enumerate(tail)], sum(r.target_len for r in tail)

    def run(name, engine, prompts, params, spec_on):
        """One timed generate of a cell, plain or speculative: outputs, seconds and the
        acceptance length."""
        if engine is not None:
            if spec_on:
                engine.attach_drafter(load_drafter(path, E.arch, dtype=engine.runner.dtype,
                                                   device=engine.device),
                                      StrategyTuner.from_config(tuner_cfg))
            else:
                engine.detach_drafter()
        if name == "pp1":
            o, sec = E.run_pp1(prompts, params)
            st = E.pp1.last_stats if E.rank == 0 else None
        else:
            o, sec = E.run_pp2(prompts, params, name.split("_", 1)[1])
            st = engine.last_stats
        return o, sec, st.spec.accept_len if st is not None and st.spec else None

    cases = ("batch 1",) if args.no_tail else ("batch 1", "long tail")
    for (name, engine), temp, case in itertools.product(depths.items(), temps, cases):
        prompts, params, n_tokens = workload(case, temp)
        cell_run = functools.partial(run, name, engine, prompts, params)
        cell_run(False)  # warm-up of this cell's shapes
        ratios, plain_rate, spec_rate, accs, same = [], [], [], [], True
        for _ in range(args.spec_pairs):
            o0, s0, _ = cell_run(False)
            o1, s1, acc = cell_run(True)
            if E.rank == 0:
                ratios.append(s0 / s1)
                plain_rate.append(n_tokens / s0)
                spec_rate.append(n_tokens / s1)
                accs.append(acc)
                same &= all(a.token_ids == b.token_ids for a, b in zip(o0, o1))
        if engine is not None:
            engine.detach_drafter()
        if E.rank == 0:
            cell = dict(engine=name, temperature=temp, case=case,
                        plain_tok_s=statistics.median(plain_rate),
                        spec_tok_s=statistics.median(spec_rate),
                        speedup=statistics.median(ratios), speedup_min=min(ratios),
                        speedup_max=max(ratios), accept_len=statistics.median(accs),
                        identical=same)
            out["cells"].append(cell)
            E.log(f"spec {name:>12} T={temp:g} {case:>9}: plain "
                  f"{cell['plain_tok_s']:6.1f} tok/s, speculative "
                  f"{cell['spec_tok_s']:6.1f} tok/s ({cell['speedup']:.2f}x "
                  f"[{cell['speedup_min']:.2f}, {cell['speedup_max']:.2f}]), accept "
                  f"{cell['accept_len']:.2f}, identical {same}")
    return out


def recompute_runs(args, E: PPEngines, pool) -> dict:
    """The recompute loop at PP = 2 against the PP = 2 engine, batch 1 (it runs one
    sequence at a time anyway), at each --recompute-tokens length."""
    from ..rollout import SamplingParams
    from .reference import recompute_generate

    recompute = {}
    for n in args.recompute_tokens:
        sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        collectives.barrier()
        t0 = time.perf_counter()
        ref = recompute_generate(E.model2, E.arch, (), E.arch.max_position_embeddings,
                                 pool[:1], sp)
        sec = time.perf_counter() - t0
        out, s2 = E.run_pp2(pool[:1], sp)
        recompute[str(n)] = dict(recompute_tok_s=n / sec, pp2_engine_tok_s=n / s2,
                                 speedup=sec / s2,
                                 same_tokens=ref[0].token_ids == out[0].token_ids)
        E.log(f"recompute_generate PP=2, {n} tokens: {n / sec:.1f} tok/s; engine PP=2 "
              f"{n / s2:.1f} tok/s ({sec / s2:.1f}x); same tokens "
              f"{recompute[str(n)]['same_tokens']}")
    return recompute


def length_scaling(args, E: PPEngines, pool) -> dict:
    """Per-token decode time against length at batch 1, PP = 2 and PP = 1."""
    from ..rollout import SamplingParams

    scaling = {}
    for n in args.lengths:
        sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        E.run_pp2(pool[:1], sp)
        st2 = E.pp2.last_stats
        per2 = st2.decode_seconds / max(st2.decode_steps, 1)
        E.run_pp1(pool[:1], sp)
        per1 = (E.pp1.last_stats.decode_seconds / max(E.pp1.last_stats.decode_steps, 1)
                if E.rank == 0 else 0.0)
        scaling[str(n)] = dict(pp2_ms_per_token=per2 * 1e3, pp1_ms_per_token=per1 * 1e3)
        E.log(f"length {n:5d}: per-token decode PP=2 {per2 * 1e3:.2f} ms, PP=1 "
              f"{per1 * 1e3:.2f} ms")
    return scaling


def result_record(args, E: PPEngines, sizes, rows, recompute, scaling, spec,
                  tally: Tally) -> dict:
    """The JSON record (rank 0) with its summary keys."""
    import megatron.core

    from .common import cpu_description

    by = {r["case"]: r for r in rows}
    mid = [by[f"batch {b}"]["ratio"] for b in (8, 32) if f"batch {b}" in by]
    result = dict(
        benchmark="rollout_pp",
        date=str(date.today()),
        config=dict(model="SmolLM2-135M-Instruct" if args.model == "smollm2" else
                    MINI_NOTE, dtype=args.dtype, pp=args.pp,
                    batch_sizes=sizes, new_tokens=args.new_tokens, pairs=args.pairs,
                    seed=args.seed, threads_per_rank=args.threads,
                    pp1_threads=E.pp1_threads, pp1_alt_threads=E.alt or None,
                    modes=E.modes,
                    gathered_copy_bytes_per_rank=getattr(
                        E.engines.get("gathered", E.pp2).runner, "copy_bytes", None),
                    torch=torch.__version__, megatron_core=megatron.core.__version__,
                    backend=dist.get_backend(),
                    note="shared machine: see aa_ratio (PP=1 against itself)",
                    **cpu_description(E.pp2)),
        results=rows,
        recompute=recompute,
        length=scaling,
        speculation=spec,
        pp2_vs_pp1_min=min(mid) if mid else None,
        tokens_identical=tally.identical / tally.compared if tally.compared else None,
    )
    lo, hi = str(args.lengths[0]), str(args.lengths[-1])
    for key, which in (("length_scaling", "pp2"), ("length_scaling_pp1", "pp1")):
        result[key] = (scaling[hi][f"{which}_ms_per_token"]
                       / scaling[lo][f"{which}_ms_per_token"])
    if len(args.lengths) == 3:
        m = str(args.lengths[1])
        result[f"length_scaling_{m}"] = (scaling[m]["pp2_ms_per_token"]
                                         / scaling[lo]["pp2_ms_per_token"])
    return result


def run(args) -> None:
    """The benchmark under torchrun with ``args.pp`` processes (bench_rollout's flags;
    ``args.spec_drafter`` a drafter file or empty)."""
    from ..rollout import SamplingParams
    from ..runtime_env import apply_cpu_redirection, init_distributed
    from ..tasks import reasoning_gym_prompts
    from .workload import synthetic_workload

    plat = init_distributed("cpu", "auto")
    if plat.world_size != args.pp:
        raise SystemExit(f"--pp {args.pp} needs {args.pp} processes (torchrun "
                         f"--nproc_per_node {args.pp}); got {plat.world_size}")
    apply_cpu_redirection()
    E = PPEngines(args, plat)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    pool = [p.token_ids for p in reasoning_gym_prompts(E.tok, n=max(sizes + [32]),
                                                       seed=args.seed)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    cases = [(f"batch {b}", pool[:b], greedy, b * args.new_tokens) for b in sizes]
    tail = synthetic_workload(32, vocab_size=E.arch.vocab_size, median_len=32, max_len=256,
                              seed=args.seed)
    tail_params = [SamplingParams(temperature=0.0, max_new_tokens=r.target_len,
                                  ignore_eos=True) for r in tail]
    if not args.no_tail:
        cases.append(("long tail", pool[:32], tail_params, sum(r.target_len for r in tail)))
    tally, rows = Tally(), []
    for case in cases:
        row = case_row(args, E, tally, *case)
        if row is not None:
            rows.append(row)
            log_case(E, row)
    spec = spec_by_depth(args, E, pool, tail) if args.spec_drafter else None
    recompute = recompute_runs(args, E, pool)
    scaling = length_scaling(args, E, pool)
    if E.rank == 0:
        result = result_record(args, E, sizes, rows, recompute, scaling, spec, tally)
        E.log("  ".join(f"{k} {result[k]:.3f}" if result[k] is not None else f"{k} -"
                        for k in ("pp2_vs_pp1_min", "tokens_identical", "length_scaling")))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    collectives.barrier()
    dist.destroy_process_group()
