#!/usr/bin/env python
"""Rollout engine vs Hugging Face transformers ``generate`` on the same weights.

    python tools/bench_rollout.py --json bench_rollout.json          # full (~12 min)
    python tools/bench_rollout.py --quick                            # < 3 min
    torchrun --standalone --nproc_per_node 2 tools/bench_rollout.py --pp 2 --json X.json

(``--pp 2``: the pipeline-parallel engine against the PP = 1 engine and the recompute
loop instead, ``megatron_tlt/bench/rollout_pp.py``.)

SmolLM2-135M-Instruct, greedy, exactly ``--new-tokens`` tokens per sequence (EOS
ignored), batch sizes 1, 8, 32 of real reasoning-gym prompts (different lengths).
Engine and transformers run interleaved (warm-up, then A, B, A, B, ...); each pair
gives a throughput ratio and the result is the median ratio.

It also measures the physical floor of a decode step on this machine: streaming the
model's weight matrices once through matrix-vector products in the engine's dtype
(batch 1), and the same matmuls at batch 8 and 32 (the fastest of MKL's two GEMM forms
and the engine's own panel GEMM).

Outputs are compared: transformers runs the batch left-padded, so its float32
numerics differ slightly from the engine's; a sequence may therefore leave the
other's path only where the two candidate tokens are tied to within --tie-margin in
transformers' own logits (checked with a full forward). Any other difference fails.

It also times one GRPO step's prefill on the demo recipe (``grpo_prefill``: a step's
prompts x group size, rollout.share_prefill off and on interleaved;
``prefill_seconds_per_grpo_step`` is the shared one's median; ``--grpo-only`` runs only
this).

JSON summary keys: ``min_ratio`` (min over batch sizes of engine tok/s / transformers
tok/s) and ``bound_ratio_bs1`` (engine batch-1 decode step time / weight-streaming
floor, the floor re-measured next to each engine run; median over runs). ``config``
records the CPU (model name, its vector instruction-set flags), the CPU-kernel variant
the engine built (``kernel_isa``: avx512 / avx2 / portable, forced with
MEGATRON_TLT_CPU_ISA) and where it uses them (``kernel_policy``: rollout.cpu_kernels,
``--cpu-kernels``), so results from different CPU families can be told apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_tlt.bench.common import check_ties, cpu_description
from megatron_tlt.runtime_env import silence_expected_warnings


def weight_floor(runner, batch: int, reps: int = 9) -> float:
    """Seconds to push ``batch`` rows through every weight matrix of a decode step once
    (all layers' QKV, projection, fc1, fc2, and the LM head), in the weights' dtype.

    Every GEMM formulation at hand is timed and the fastest median is the floor: MKL's
    x @ W^T and (W @ x^T)^T (it picks different kernels for them) and, when the engine
    has its CPU kernels, their panel GEMM over the packed weight copies (faster than
    MKL's at 1-64 rows, so the floor is the lowest time this machine is known to stream
    the weights in).
    """
    mats = [lw_w for lw in runner.layers for lw_w in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w)]
    mats.append(runner.output_w)
    xs = {m.shape[1]: torch.randn(batch, m.shape[1], dtype=m.dtype, device=m.device)
          for m in mats}
    sync = torch.cuda.synchronize if mats[0].is_cuda else (lambda: None)
    forms = [lambda x, m: F.linear(x, m), lambda x, m: torch.mm(m, x.t())]
    if runner.kernels is not None and mats[0].dtype == torch.float32:
        runner.pack_weights()
        forms.append(lambda x, m: runner.kernels.linear(x, runner._panel(m), m.shape[0]))
    best = float("inf")
    with torch.no_grad():
        for form in forms:
            for _ in range(2):
                for m in mats:
                    form(xs[m.shape[1]], m)
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                for m in mats:
                    form(xs[m.shape[1]], m)
                sync()
                times.append(time.perf_counter() - t0)
            best = min(best, statistics.median(times))
    return best


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad_id: int):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=hf.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=hf.device)
        mask[i, width - len(p):] = 1
    # no EOS at all (not min_new_tokens, which would forbid EOS and change the argmax):
    # like the engine's ignore_eos, EOS may be generated and generation goes on
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def compare(hf, prompts, ours, theirs, tie_margin: float) -> dict:
    """Identical sequences, and sequences that part only at near-ties."""
    return check_ties(prompts, ours, theirs,
                      lambda ids: hf(torch.tensor([ids], device=hf.device)).logits[0, -1],
                      tie_margin,
                      ("engine", "transformers"))


def grpo_prefill(engine, pairs: int, new_tokens: int = 4,
                 recipe: str = "examples/rl/smollm2_cpu.yaml") -> dict:
    """Prefill per GRPO step on the demo recipe: one generate call over a step's
    prompts (``grpo.prompts_per_step`` of the recipe's task, in its prompt format) x
    ``grpo.group_size`` requests, with the RL rollout's request seeds, with
    rollout.share_prefill off and on, interleaved (off, on, off, on, ...; ``pairs``
    pairs after a warm-up pair). Responses are cut at ``new_tokens`` (the prefill is
    what is timed). Returns the median prefill seconds and the prefill tokens of each."""
    from megatron_tlt.config import load_config
    from megatron_tlt.rl.data import build_prompt_sets
    from megatron_tlt.rl.rollout import sample_seed, sampling_params

    cfg = load_config([Path(__file__).resolve().parents[1] / recipe],
                      ["data.eval_size=0", f"data.train_size={64}"])
    g = cfg.grpo
    train, _ = build_prompt_sets(cfg.data, engine.tokenizer)
    step = list(train)[: g.prompts_per_step]
    ids = [p.token_ids for p in step for _ in range(g.group_size)]
    seeds = [sample_seed(0, i, j, g.group_size) for i in range(len(step))
             for j in range(g.group_size)]
    sp = dataclasses.replace(sampling_params(g, 0), max_new_tokens=new_tokens)
    share, rows = engine.config.share_prefill, engine.config.max_batch_size
    engine.config.max_batch_size = cfg.rollout.max_batch_size  # the recipe's
    runs: dict[bool, list] = {False: [], True: []}
    outs = {}
    try:
        for k in range(pairs + 1):
            for on in (False, True):
                engine.config.share_prefill = on
                outs[on] = [o.token_ids for o in engine.generate(ids, sp, request_seeds=seeds)]
                if k:  # the first pair warms up
                    runs[on].append(engine.last_stats)
    finally:
        engine.config.share_prefill, engine.config.max_batch_size = share, rows
    res = {}
    for on, name in ((False, "unshared"), (True, "shared")):
        st = runs[on]
        res[name] = dict(prefill_seconds=statistics.median(s.prefill_seconds for s in st),
                         prefill_seconds_all=[s.prefill_seconds for s in st],
                         prefill_tokens=st[-1].prefill_tokens,
                         prefill_shared_rows=st[-1].prefill_shared_rows)
    return dict(recipe=recipe, prompts=len(step), group_size=g.group_size,
                requests=len(ids), prompt_tokens=[len(p.token_ids) for p in step],
                max_batch_size=cfg.rollout.max_batch_size, new_tokens=new_tokens,
                pairs=pairs, **res,
                tokens_ratio=res["shared"]["prefill_tokens"] / res["unshared"]["prefill_tokens"],
                seconds_ratio=res["shared"]["prefill_seconds"] / res["unshared"]["prefill_seconds"],
                identical=outs[False] == outs[True])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=5, help="interleaved A/B pairs per size")
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 2 pairs")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tie-margin", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="rollout.cuda_graphs=true (CUDA: decode, verification and "
                         "one-layer drafting steps replayed from graphs; without the "
                         "flag the bench runs eager steps, cuda_graphs=false)")
    ap.add_argument("--cpu-kernels", default="auto", choices=("auto", "true", "false"),
                    help="rollout.cpu_kernels for the engine (default auto: where this "
                         "machine's calibration measured them faster)")
    ap.add_argument("--grpo-pairs", type=int, default=5,
                    help="off/on pairs of the GRPO-step prefill measurement (0: skip)")
    ap.add_argument("--grpo-only", action="store_true",
                    help="only the GRPO-step prefill measurement (no transformers runs)")
    ap.add_argument("--pp", type=int, default=1,
                    help="> 1: benchmark the pipeline-parallel engine (under torchrun "
                         "with this many processes; megatron_tlt/bench/rollout_pp.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (--pp)")
    ap.add_argument("--pp1-threads", type=int, default=0,
                    help="--pp: the PP = 1 engine's threads (default --threads x --pp)")
    ap.add_argument("--pp1-alt-threads", type=int, default=1,
                    help="--pp: also time the PP = 1 engine at this many threads (0: no)")
    ap.add_argument("--no-tail", action="store_true",
                    help="--pp: skip the long-tail batch (a loaded machine)")
    ap.add_argument("--modes", default="gathered,pipelined",
                    help="--pp: rollout.pipeline_mode values to time (the first is the "
                         "headline)")
    ap.add_argument("--recompute-tokens", type=lambda v: [int(x) for x in v.split(",")],
                    default=[16, 64], help="lengths the recompute loop runs at (--pp)")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "mini"),
                    help="--pp: SmolLM2, or a random 8-layer 256-wide Llama with its "
                         "tokenizer (a loaded machine)")
    ap.add_argument("--spec-drafter", default="",
                    help="--pp: also time speculation at PP = 1 and PP = 2 with this "
                         "drafter ('demo': the demo's warm-up drafter; empty: skip)")
    ap.add_argument("--spec-strategy", default="4_1_4",
                    help="--pp: the fixed drafting strategy of --spec-drafter's runs")
    ap.add_argument("--spec-pairs", type=int, default=2,
                    help="--pp: interleaved plain/speculative pairs per --spec-drafter cell")
    ap.add_argument("--spec-temperatures", default="0,1",
                    help="--pp: temperatures of --spec-drafter's runs (coupled sampling "
                         "above 0, so plain and speculative runs emit the same tokens)")
    ap.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")],
                    default=[64, 256, 1024], help="batch-1 lengths of the per-token "
                                                  "time scaling (--pp)")
    return ap.parse_args(argv)


def run_pipeline(args) -> None:
    """--pp > 1: the pipeline-parallel benchmark (``megatron_tlt.bench.rollout_pp``)."""
    from megatron_tlt.bench import rollout_pp

    if args.spec_drafter == "demo":  # the demo's warm-up drafter, warmed up if absent
        from megatron_tlt.drafter_training.prepared import demo_drafter

        args.spec_drafter = str(demo_drafter())
    rollout_pp.run(args)


def print_grpo(grpo: dict) -> None:
    print(f"GRPO step prefill ({grpo['prompts']} prompts x {grpo['group_size']}): "
          f"unshared {grpo['unshared']['prefill_tokens']} tokens "
          f"{grpo['unshared']['prefill_seconds'] * 1e3:.1f} ms, shared "
          f"{grpo['shared']['prefill_tokens']} tokens "
          f"{grpo['shared']['prefill_seconds'] * 1e3:.1f} ms (tokens x"
          f"{grpo['tokens_ratio']:.3f}, seconds x{grpo['seconds_ratio']:.3f}, "
          f"identical {grpo['identical']})", flush=True)


def write_grpo_only(args, engine, grpo) -> None:
    """--grpo-only's JSON record."""
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            benchmark="rollout_grpo_prefill", date=str(date.today()),
            config=dict(dtype=args.dtype, device=str(engine.device),
                        threads=torch.get_num_threads(), **cpu_description(engine)),
            grpo_prefill=grpo,
            prefill_seconds_per_grpo_step=grpo and grpo["shared"]["prefill_seconds"]),
            indent=2))


def batch_row(args, engine, hf, prompts, sp, pad, floors) -> dict:
    """One batch size: a warm-up, then --pairs interleaved engine / transformers runs
    (the weight-streaming floor re-measured next to every engine run); the outputs
    checked; its row, printed."""
    from megatron_tlt.rollout import SamplingParams

    b = len(prompts)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4,
                                            ignore_eos=True))  # warm-up
    hf_generate(hf, prompts, 4, pad)
    ratios, eng_tps, hf_tps, steps, bounds = [], [], [], [], []
    for _ in range(args.pairs):
        # the floor is re-measured next to every engine run: the machine drifts
        floor_now = weight_floor(engine.runner, b, reps=5)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp)
        te = time.perf_counter() - t0
        st = engine.last_stats
        steps.append(st.decode_seconds / max(st.decode_steps, 1))
        bounds.append(steps[-1] / floor_now)
        t0 = time.perf_counter()
        theirs = hf_generate(hf, prompts, args.new_tokens, pad)
        th = time.perf_counter() - t0
        ours = [o.token_ids for o in outs]
        assert all(len(o) == args.new_tokens for o in ours + theirs)
        eng_tps.append(b * args.new_tokens / te)
        hf_tps.append(b * args.new_tokens / th)
        ratios.append(eng_tps[-1] / hf_tps[-1])
    check = compare(hf, prompts, ours, theirs, args.tie_margin)
    row = dict(batch=b, engine_tok_s=statistics.median(eng_tps),
               hf_tok_s=statistics.median(hf_tps), ratio=statistics.median(ratios),
               ratio_min=min(ratios), ratio_max=max(ratios),
               engine_step_ms=statistics.median(steps) * 1e3,
               floor_ms=floors.get(b, float("nan")) * 1e3,
               graphs=st.graphs,  # rollout.cuda_graphs=auto's choice per key
               step_over_floor=statistics.median(bounds),
               step_over_floor_min=min(bounds), step_over_floor_max=max(bounds),
               **check)
    print(f"bs {b:3d}: engine {row['engine_tok_s']:7.1f} tok/s  transformers "
          f"{row['hf_tok_s']:7.1f} tok/s  ratio {row['ratio']:.2f} "
          f"[{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]  step "
          f"{row['engine_step_ms']:.1f} ms = {row['step_over_floor']:.2f}x floor  "
          f"identical {check['identical']}/{b} (tie splits {check['tie_splits']})",
          flush=True)
    return row


def result_record(args, engine, sizes, floors, rows, grpo, syncs) -> dict:
    import megatron.core
    import transformers

    by_b = {r["batch"]: r for r in rows}
    return dict(
        benchmark="rollout",
        date=str(date.today()),
        config=dict(model="SmolLM2-135M-Instruct", dtype=args.dtype, batch_sizes=sizes,
                    new_tokens=args.new_tokens, pairs=args.pairs, seed=args.seed,
                    prompts="reasoning_gym basic_arithmetic (workload default)",
                    torch=torch.__version__, megatron_core=megatron.core.__version__,
                    transformers=transformers.__version__, device=str(engine.device),
                    cuda_graphs=args.cuda_graphs,
                    gpu=(torch.cuda.get_device_name() if engine.device.type == "cuda"
                         else None),
                    threads=torch.get_num_threads(), **cpu_description(engine)),
        floor_ms={str(b): t * 1e3 for b, t in floors.items()},
        results=rows,
        min_ratio=min(r["ratio"] for r in rows),
        bound_ratio_bs1=by_b[1]["step_over_floor"] if 1 in by_b else None,
        # one GRPO step's prefill on the demo recipe (rollout.share_prefill on; the
        # unshared engine's beside it in grpo_prefill)
        grpo_prefill=grpo,
        prefill_seconds_per_grpo_step=grpo and grpo["shared"]["prefill_seconds"],
        host_syncs_plain_step=syncs["host_syncs_plain_step"],
        host_syncs_spec_step=None,  # no drafter here: tools/bench_spec.py measures it
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    silence_expected_warnings()
    if args.pp > 1:
        run_pipeline(args)
        return
    if args.quick:
        args.new_tokens, args.pairs, args.grpo_pairs = 32, 2, min(args.grpo_pairs, 2)
    from transformers import AutoModelForCausalLM

    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.bench.sync_budget import measure, summary
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.tasks import reasoning_gym_prompts

    src = require_smollm2()
    engine = RolloutEngine.from_pretrained(
        src, RolloutConfig(cpu_kernels=args.cpu_kernels, cuda_graphs=args.cuda_graphs),
        dtype=args.dtype)
    grpo = grpo_prefill(engine, args.grpo_pairs) if args.grpo_pairs > 0 else None
    if grpo:
        print_grpo(grpo)
    if args.grpo_only:
        write_grpo_only(args, engine, grpo)
        return
    # transformers on the engine's device (the same GPU on a CUDA machine)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, args.dtype)) \
        .to(engine.device).eval()
    tok = engine.tokenizer
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    pool = [p.token_ids for p in reasoning_gym_prompts(tok, n=max(sizes), seed=args.seed)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    cpu = cpu_description(engine)
    print(f"cpu: {cpu['cpu']} ({' '.join(cpu['cpu_isa_flags'])}); kernels: "
          f"{cpu['kernel_isa'] or 'none'} build, rollout.cpu_kernels={cpu['cpu_kernels']}: "
          f"{cpu['kernel_policy']}", flush=True)
    floors = {b: weight_floor(engine.runner, b) for b in sorted(set([1, 8, 32] + sizes))}
    print(f"weight-streaming floor ({args.dtype}): " + ", ".join(
        f"bs{b} {t * 1e3:.1f} ms" for b, t in floors.items()), flush=True)
    rows = [batch_row(args, engine, hf, pool[:b], sp, pad, floors) for b in sizes]

    # host synchronisations per decode step (bench.sync_budget; a counting pass,
    # not timed): plain decoding here, speculation's in bench_spec
    syncs = summary(measure(engine, pool[:min(sizes)], SamplingParams(
        temperature=0.0, max_new_tokens=8, ignore_eos=True)))
    print(f"host syncs per plain step: {syncs['host_syncs_plain_step']}", flush=True)
    result = result_record(args, engine, sizes, floors, rows, grpo, syncs)
    print(f"min_ratio {result['min_ratio']:.2f}  bound_ratio_bs1 "
          f"{result['bound_ratio_bs1'] if result['bound_ratio_bs1'] is None else round(result['bound_ratio_bs1'], 3)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
