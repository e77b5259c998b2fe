#!/usr/bin/env python
"""Paged KV cache vs fixed slots at an equal KV budget, on the long-tail workload.

    python tools/bench_paged.py --json docs/results/bench_paged_cpu.json
    python tools/bench_paged.py --quick

SmolLM2-135M-Instruct on the CPU, coupled sampling at T = 1, GRPO groups of ``--group``
responses per prompt with log-normal response lengths (median ``--median`` of the cap
``--max-new``). The slot engine holds ``--slot-rows`` full-length rows (the budget);
the paged engine gets the same bytes (``rollout.kv_cache_gib``) and every request as
its most rows in flight. Rounds of slots, paged, slots (A/A control), interleaved
(``megatron_tlt/bench/paged_kv.py``); the JSON holds rows in flight, wall time, their
ratios (median over rounds), the A/A ratio, the host syncs of a paged step, whether
the outputs were identical, the CPU and the command; with the CPU kernels built, also
one layer's fused attention on a paged cache read in place through the block table
against gathering the blocks into a contiguous copy first (``attend_layouts``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96))
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--median", type=float, default=51.0)
    ap.add_argument("--slot-rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-kernels", default="auto")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 8, cap 96, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new, args.median, args.rounds = 2, 96, 20.0, 1

    from megatron_tlt.bench.common import cpu_description
    from megatron_tlt.bench.paged_kv import attend_layouts, compare, workload
    from megatron_tlt.bench.sync_budget import measure, summary
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.rollout import RolloutEngine
    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    base = RolloutConfig(sampling_mode="coupled", cpu_kernels=args.cpu_kernels)
    eng = RolloutEngine.from_pretrained("smollm2", replace(base, max_batch_size=args.slot_rows),
                                        dtype="float32", device="cpu")
    model, tok, arch = eng.runner.model, eng.tokenizer, eng.arch
    prompts, params = workload(arch.vocab_size, prompts=args.prompts, group=args.group,
                               prompt_len=tuple(args.prompt_len), median_len=args.median,
                               max_len=args.max_new)
    result = compare(model, tok, arch, base, slot_rows=args.slot_rows, prompts=prompts,
                     params=params, rounds=args.rounds)
    # host syncs of a paged decode step (budget 1), at the benchmark's budget
    paged = RolloutEngine(model, tok, replace(base, kv_cache="paged",
                                              max_batch_size=len(prompts),
                                              kv_cache_gib=result["kv_cache_gib"]),
                          arch=arch, eos_token_ids=[])
    syncs = summary(measure(paged, prompts[: 2 * args.group], params[: 2 * args.group]))
    result.update(
        benchmark="paged_kv",
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command="python tools/bench_paged.py " + " ".join(sys.argv[1:]),
        config=dict(model="SmolLM2-135M-Instruct", dtype="float32", sampling="coupled T=1",
                    prompts=args.prompts, group=args.group, prompt_len=list(args.prompt_len),
                    max_new_tokens=args.max_new, median_len=args.median,
                    slot_rows=args.slot_rows, rounds=args.rounds,
                    kv_block_size=base.kv_block_size, threads=torch.get_num_threads(),
                    **cpu_description(eng)),
        host_syncs_plain_step_paged=syncs["host_syncs_plain_step"],
    )
    kern = eng.runner.kernels
    if kern is not None:  # one layer's attention: paged in place vs gathered pages
        result["attend_layouts"] = attend_layouts(
            kern, groups=arch.num_query_groups,
            heads_per_group=arch.num_attention_heads // arch.num_query_groups,
            head_dim=arch.kv_channels, block_size=base.kv_block_size)
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("slots", "paged", "slots_aa", "config")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
