#!/usr/bin/env python
"""The self-drafter's copy on this CPU: its batch-1 decode step against the int8
weight-streaming floor, its refresh time and memory, and (``--alpha``) its acceptance.

    python tools/bench_self_drafter.py --json bench_self_drafter.json   # ~2 min
    python tools/bench_self_drafter.py --alpha 8                         # + acceptance

SmolLM2-135M-Instruct, float32 policy, the copy int8 (``--group``: inputs per scale,
0 = per output channel). Measured:

- the decode step at batch 1 (``extend`` of one token after a prompt of ~60 tokens) of
  the float32 policy and of the int8 copy, interleaved (A, B, A, B, ... after a
  warm-up; each side the median of ``--calls`` calls) so drift on a shared machine
  hits both; ``step_ratio`` is the median of the per-round ratios copy / policy;
- the weight-streaming floors: the float32 floor is the fastest way at hand to push one
  row through every matrix of a step (MKL's two GEMM forms and the kernels' panel
  GEMM, as ``tools/bench_rollout.py``), which gives the bandwidth the machine streams
  weights at; the int8 floor is the copy's bytes (int8 matrices and scales) at that
  bandwidth. ``int8_gemms_ms`` is the copy's int8 GEMMs alone (``linear_int8`` over
  every matrix), ``step_over_int8_floor`` the copy's step over its floor;
- ``refresh_ms``: re-quantizing the whole copy from the policy's weights (median of 3);
  ``copy_over_policy_bytes``: the copy's own bytes over the policy's parameters';
- ``--alpha N``: N demo-style prompts generated at T=1 (128 new tokens) with a fixed
  chain of depth 4 through the engine: the acceptance rate at each draft position and
  the tokens per verification.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_tlt.runtime_env import silence_expected_warnings


def stream_floor(mats, forms, reps: int = 7, clock=time.perf_counter) -> float:
    """Fastest median time over ``forms`` to push one row through every matrix."""
    xs = {m.shape[1]: torch.randn(1, m.shape[1]) for m in mats}
    best = float("inf")
    with torch.no_grad():
        for form in forms:
            for m in mats:
                form(xs[m.shape[1]], m)
            times = []
            for _ in range(reps):
                t0 = clock()
                for m in mats:
                    form(xs[m.shape[1]], m)
                times.append(clock() - t0)
            best = min(best, statistics.median(times))
    return best


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--act-block", type=int, default=32,
                    help="inputs per activation scale (int8 activations); 0 = float activations")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--alpha", type=int, default=0, help="prompts for the acceptance run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps by this process's CPU time instead of wall time (with "
                         "--threads 1 on a machine shared with other work: the cost of the "
                         "code, free of waiting for a core)")
    ap.add_argument("--json", default="")
    return ap.parse_args(argv)


def interleaved_steps(args, target, copy, clock):
    """Batch-1 decode steps of the policy and the copy after a ~60-token prompt, in
    --rounds interleaved rounds (each side the median of --calls calls): (policy
    seconds, copy seconds, copy / policy) per round."""
    from megatron_tlt.rollout.kv_cache import KVCache

    dev, prompt = target.device, torch.randint(0, 1000, (1, 60))
    caches = {}
    for name, r in (("policy", target), ("copy", copy)):
        caches[name] = KVCache(num_layers=len(r.layers), max_batch=1, kv_heads=r.groups,
                               capacity=128, head_dim=r.head_dim, dtype=r.dtype, device=dev)
        with torch.no_grad():
            r.extend(caches[name], slice(0, 1), prompt, torch.zeros(1, dtype=torch.long))
    tok, start = torch.tensor([[5]]), torch.tensor([60])

    def step(name, r) -> float:
        times = []
        with torch.no_grad():
            for _ in range(args.calls):
                t0 = clock()
                r.logits(r.extend(caches[name], slice(0, 1), tok, start)[:, 0])
                times.append(clock() - t0)
        return statistics.median(times)

    for _ in range(2):  # warm-up
        step("policy", target), step("copy", copy)
    pol, cop, ratios = [], [], []
    for i in range(args.rounds):
        order = [("policy", target), ("copy", copy)][:: 1 if i % 2 == 0 else -1]
        got = {name: step(name, r) for name, r in order}
        pol.append(got["policy"])
        cop.append(got["copy"])
        ratios.append(got["copy"] / got["policy"])
    return pol, cop, ratios


def floors(target, copy, clock) -> dict:
    """The float32 weight-streaming floor, the bandwidth it implies, the int8 floor at
    that bandwidth and the copy's int8 GEMMs alone (None without int8 kernels)."""
    mats = [w for lw in target.layers for w in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w)]
    mats.append(target.output_w)
    forms = [lambda x, m: F.linear(x, m), lambda x, m: torch.mm(m, x.t())]
    if target.kernels is not None:
        forms.append(lambda x, m: target.kernels.linear(x, target._panel(m), m.shape[0]))
    fp32_floor = stream_floor(mats, forms, clock=clock)
    fp32_bytes = sum(m.numel() * m.element_size() for m in mats)
    bandwidth = fp32_bytes / fp32_floor
    qmats = copy.quant_weights()
    int8_bytes = sum(w.nbytes for w in qmats)
    int8_gemms = None
    if copy._int8_kernels():
        xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in qmats}
        k = copy.kernels
        times = []
        for _ in range(9):
            t0 = clock()
            for w in qmats:
                k.linear_int8(xs[w.shape[1]], w.panel, w.panel_scale, w.shape[0], w.group, w.act_block)
            times.append(clock() - t0)
        int8_gemms = statistics.median(times[2:])
    return dict(fp32=fp32_floor, bandwidth=bandwidth, int8=int8_bytes / bandwidth,
                int8_gemms=int8_gemms)


def acceptance(eng, prompts: int) -> dict:
    """``prompts`` prompts at T=1 (128 new tokens) through the engine's fixed chain:
    the acceptance rate by draft position and the tokens per verification."""
    from megatron_tlt.rollout import SamplingParams
    from megatron_tlt.tasks import reasoning_gym_prompts

    pool = [p.token_ids for p in reasoning_gym_prompts(eng.tokenizer, n=prompts, seed=0)]
    eng.generate(pool, SamplingParams(temperature=1.0, max_new_tokens=128, seed=1))
    s = eng.last_stats.spec.summary()
    print(f"T=1, chain 4: acceptance by position {s['accept_rate_at_position']}, "
          f"{s['accept_len']:.2f} accepted per verification", flush=True)
    return dict(alpha_by_position=s["accept_rate_at_position"], accept_len=s["accept_len"])


def main(argv=None) -> None:
    args = parse_args(argv)
    silence_expected_warnings()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter

    from megatron_tlt.bench.common import cpu_description
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.rollout import RolloutEngine
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    torch.manual_seed(0)
    sc = SpeculativeConfig(policy="fixed", strategy="4_1_4", threshold=1 << 20)
    eng = RolloutEngine.from_pretrained("smollm2", RolloutConfig(speculative=sc))
    eng.attach_drafter(SelfDrafter(group=args.group, act_block=args.act_block))
    target, copy = eng.runner, eng.spec.draft
    target.pack_weights()
    print(f"kernels: {target.kernels!r}; copy int8 kernels: {copy._int8_kernels()}",
          flush=True)

    refresh = []
    for _ in range(3):
        copy.refresh()
        refresh.append(copy.refresh_seconds)
    policy_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    pol, cop, ratios = interleaved_steps(args, target, copy, clock)
    fl = floors(target, copy, clock)
    out = dict(
        group=args.group, act_block=args.act_block, threads=torch.get_num_threads(),
        clock="cpu" if args.cpu_time else "wall", policy_step_ms=statistics.median(pol) * 1e3,
        copy_step_ms=statistics.median(cop) * 1e3, step_ratio=statistics.median(ratios),
        step_ratio_min=min(ratios), step_ratio_max=max(ratios),
        fp32_floor_ms=fl["fp32"] * 1e3, bandwidth_gbs=fl["bandwidth"] / 1e9,
        int8_floor_ms=fl["int8"] * 1e3,
        int8_gemms_ms=None if fl["int8_gemms"] is None else fl["int8_gemms"] * 1e3,
        step_over_int8_floor=statistics.median(cop) / fl["int8"],
        refresh_ms=statistics.median(refresh) * 1e3,
        copy_bytes=copy.nbytes, copy_over_policy_bytes=copy.nbytes / policy_bytes,
        config=cpu_description(eng))
    print(f"batch-1 step: policy {out['policy_step_ms']:.1f} ms, int8 copy "
          f"{out['copy_step_ms']:.1f} ms (ratio {out['step_ratio']:.3f} "
          f"[{out['step_ratio_min']:.3f}, {out['step_ratio_max']:.3f}])", flush=True)
    print(f"floors: fp32 {out['fp32_floor_ms']:.1f} ms ({out['bandwidth_gbs']:.1f} GB/s), "
          f"int8 {out['int8_floor_ms']:.1f} ms; int8 GEMMs alone "
          f"{out['int8_gemms_ms'] or float('nan'):.1f} ms; copy step / int8 floor "
          f"{out['step_over_int8_floor']:.2f}", flush=True)
    print(f"refresh {out['refresh_ms']:.0f} ms; copy {copy.nbytes / 1e6:.1f} MB = "
          f"{out['copy_over_policy_bytes']:.3f} x the policy's parameters", flush=True)
    if args.alpha:
        out.update(acceptance(eng, args.alpha))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
