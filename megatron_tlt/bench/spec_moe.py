"""Speculation on a small random Qwen3-MoE (``tools/bench_moe.py --part spec``): the
self-drafter (the policy's int8 copy, int8 experts) and the one-layer drafter, their
acceptance at T = 1 and the time of a draft step against the target's decode step.

The model is ``replay_mismatch.MOE`` with its last layer dense (``mlp_only_layers``),
so the one-layer drafter can be made of it without training: that layer, ``fc``
passing the token embedding through and the target's final norm (random weights: a
stand-in, not a trained drafter). Each drafter decodes the same prompts with a fixed
depth-``depth`` chain (float32, T = 1, EOS ignored); reported per batch size: α (the
share of steps whose first draft was accepted), tokens per step (accepted drafts + the
target's token, per row), the drafting time per draft token and the verification time
per step (wall-clock, from the engine's counters) next to the target's plain decode
step (the same batch decoded without speculation, process CPU time per step) and the
CPU-time speed-up; medians of ``reps`` generates. And one MoE layer's expert step,
target against the copy (``moe_layer_ms``, CPU time). Random models say little about real
acceptance; the times say what a draft step costs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .replay_mismatch import MOE, save_random

SPEC_MOE = dict(MOE, mlp_only_layers=[MOE["num_hidden_layers"] - 1])
BATCHES = (1, 4)


def _layer_drafter(model, arch):
    from ..models.drafter import DrafterConfig, EagleDrafter

    d = EagleDrafter(DrafterConfig.for_target(arch), arch)
    with torch.no_grad():
        d.layer.load_state_dict(model.decoder.layers[-1].state_dict())
        h = arch.hidden_size
        d.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        d.norm.copy_(model.decoder.final_layernorm.weight)
    return d


def _engine(model, arch, drafter, depth: int):
    from ..config import RolloutConfig, SpeculativeConfig
    from ..rollout import RolloutEngine

    sc = SpeculativeConfig(policy="fixed", strategy=f"{depth}_1_{depth}",
                           threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc if drafter else
                                                   SpeculativeConfig()),
                        arch=arch, eos_token_ids=[])
    if drafter is not None:
        eng.attach_drafter(drafter)
    return eng


def _run(eng, prompts, new_tokens: int, reps: int) -> tuple[float, dict]:
    """The median over ``reps`` generates (seeds 3, 4, ...) of the call's process CPU
    time (robust to other processes on a shared machine) and of its speculation
    counters and times (the seconds are wall-clock)."""
    from ..rollout import SamplingParams

    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=0,
                                         ignore_eos=True))  # warm-up
    cpu, runs = [], []
    for r in range(reps):
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=3 + r,
                            ignore_eos=True)
        t0 = time.process_time()
        eng.generate(prompts, sp)
        cpu.append(time.process_time() - t0)
        spec = eng.last_stats.spec
        runs.append({} if spec is None else spec.summary())
    med = statistics.median
    out = {}
    if runs[0]:
        out = {"steps": med(x["steps"] for x in runs),
               "alpha": med(x["accept_rate_at_position"].get("1", 0.0) for x in runs),
               "accept_len": med(x["accept_len"] for x in runs),
               "draft_seconds": med(x["draft_seconds"] for x in runs),
               "verify_seconds": med(x["verify_seconds"] for x in runs)}
    return med(cpu), out


def moe_layer_ms(eng, rows: int, calls: int = 50) -> dict:
    """Process CPU time (ms) of one MoE layer's expert step for ``rows`` tokens: the
    target's (``experts.moe`` over the stacked float experts) and the self-drafter's
    copy's (``moe_int8``: the rank's int8 experts dequantized at every call), on the
    same hidden states; ``eng`` has generated with the self-drafter attached."""
    from ..rollout import experts
    from ..rollout.speculative.quantize_experts import moe_int8

    target, copy = eng.runner, eng.spec.draft
    i = next(iter(target.moe_index))
    x = torch.randn(rows, target.layers[i].router_w.shape[1],
                    generator=torch.Generator().manual_seed(rows))

    def ms(fn) -> float:
        fn()
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        return 1e3 * (time.process_time() - t0) / calls

    tl, cl = target.layers[i], copy.layers[i]
    with torch.no_grad():
        return {"rows": rows,
                "target_ms": ms(lambda: experts.moe(x, tl.router_w, tl.w13, tl.w2,
                                                    target.moe_shape)),
                "copy_ms": ms(lambda: moe_int8(x, cl.router_w, cl.w13, cl.w2,
                                               copy.moe_shape))}


def run(root: Path, *, new_tokens: int, depth: int = 4, reps: int = 3) -> dict:
    from ..models import load_model
    from ..rollout.speculative.self_drafter import SelfDrafter

    folder = save_random(Path(root) / "spec_moe", SPEC_MOE)
    model, arch = load_model(folder, device=torch.device("cpu"), dtype="float32",
                             impl="local")
    g = torch.Generator().manual_seed(1)
    out = {"part": "spec", "model": SPEC_MOE, "depth": depth, "new_tokens": new_tokens,
           "temperature": 1.0, "reps": reps, "threads": torch.get_num_threads(),
           "rows": []}
    for batch in BATCHES:
        prompts = [torch.randint(0, arch.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 33, (batch,), generator=g)]
        plain_s, _ = _run(_engine(model, arch, None, depth), prompts, new_tokens, reps)
        step_ms = 1e3 * plain_s / new_tokens  # CPU time per plain decode step
        # (label, drafter, whether to time the copy's MoE layer: the self-drafter's)
        for kind, drafter, copy_layer in (("self", SelfDrafter(), True),
                                          ("one-layer", _layer_drafter(model, arch), False)):
            eng = _engine(model, arch, drafter, depth)
            seconds, st = _run(eng, prompts, new_tokens, reps)
            if copy_layer:
                layer = moe_layer_ms(eng, batch)
                out.setdefault("moe_layer", []).append(layer)
                print(f"MoE layer, {batch} rows: target {layer['target_ms']:.3f} ms, "
                      f"self-drafter copy {layer['copy_ms']:.3f} ms (CPU time)", flush=True)
            drafts = st["steps"] * depth
            row = {"kind": kind, "batch": batch, "steps": st["steps"],
                   "alpha": st["alpha"], "tokens_per_step": st["accept_len"],
                   "draft_ms_per_token": 1e3 * st["draft_seconds"] / max(drafts, 1),
                   "verify_ms_per_step": 1e3 * st["verify_seconds"] / max(st["steps"], 1),
                   "target_plain_step_ms": step_ms,
                   "cpu_speedup": plain_s / seconds}
            out["rows"].append(row)
            print(f"{kind:>9} batch {batch}: alpha {row['alpha']:.3f}, "
                  f"{row['tokens_per_step']:.2f} tokens/step, draft "
                  f"{row['draft_ms_per_token']:.2f} ms/token vs target step "
                  f"{step_ms:.2f} ms (verify {row['verify_ms_per_step']:.2f} ms), "
                  f"CPU-time speed-up {row['cpu_speedup']:.2f}x", flush=True)
    return out
