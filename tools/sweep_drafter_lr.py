#!/usr/bin/env python
"""Choose the drafter group's learning rate by measurement (offline, one process).

    python tools/sweep_drafter_lr.py --json docs/results/drafter_lr_sweep_cpu.json
    python tools/sweep_drafter_lr.py --lrs 1e-4,3e-4,1e-3,3e-3 --steps 32

The protocol mimics one window of the drafter group: SmolLM2 samples responses to
``--prompts`` training prompts (the buffer of step t, with the features decoding
returns) and to as many different prompts (step t+1's responses); from the warm-up
drafter the demo uses (``--drafter``), each learning rate trains a copy with the
group's settings (``DrafterGroupConfig``: loss preset, warm-up, clipping, AdamW,
``batch_tokens``) for up to ``--steps`` micro-steps (the group's
``max_steps_per_window``) and the exact depth-1 alpha (``alpha.measure_alpha``, the
per-token rate speculative sampling accepts, at the recipe's sampling settings) and the
predicted acceptance length of a depth-4 chain are measured on the step-t+1 responses
at several step counts. Alpha is an expectation over every token, not a timing: the
table is exact on its data whatever the machine's load.

The policy does not move between the two sets here (the online benchmark,
``tools/bench_drift.py``, covers drift); what this isolates is how far one window's
steps at each rate carry the drafter on responses it has not seen.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from megatron_tlt.fileio import write_json


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--checkpoints", default="4,8,16,32",
                    help="micro-step counts at which alpha is measured")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0, help="the recipe's")
    ap.add_argument("--drafter", default=None, help="warm-up drafter (default: the demo's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def sampled_sets(engine, a, t0: float):
    """Responses with their features to ``--prompts`` training prompts and as many
    held-out ones, at ``--temperature``."""
    from megatron_tlt.drafter_training.alpha import held_out_samples
    from megatron_tlt.rollout import SamplingParams
    from megatron_tlt.tasks import reasoning_gym_prompts

    pool = [p.token_ids for p in reasoning_gym_prompts(engine.tokenizer, n=2 * a.prompts,
                                                        seed=a.seed)]
    sp = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                        seed=a.seed + 1)
    train = held_out_samples(engine, pool[:a.prompts], sp)
    held = held_out_samples(engine, pool[a.prompts:], sp)
    print(f"[lr] {len(train)} training / {len(held)} held-out responses, "
          f"{sum(len(s.tokens) - s.prompt_len for s in held)} held-out response tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return train, held


def alpha(drafter, engine, held, temperature: float) -> dict:
    """Depth-1 alpha, alpha by depth and the depth-4 chain's predicted acceptance."""
    from megatron_tlt.drafter_training.alpha import measure_alpha

    rep = measure_alpha(drafter, engine.runner, held, temperature=temperature, depth=4)
    return {"alpha": rep.alpha[0], "alpha_by_depth": rep.alpha,
            "predicted_accept_len": rep.predicted_accept_len}


def train_at(lr: float, path: Path, engine, train, held, a, dg, marks) -> list[dict]:
    """A fresh copy of the drafter at ``path`` trained at ``lr`` with the group's
    settings for ``--steps`` micro-steps; alpha and the mean loss at each of ``marks``."""
    from megatron_tlt.drafter_training.losses import LossConfig
    from megatron_tlt.drafter_training.trainer import DrafterTrainer, length_batches
    from megatron_tlt.models.drafter import load_drafter

    loss = LossConfig.for_sampling(dg.loss, a.temperature)
    plan = length_batches(train, dg.batch_tokens)
    drafter = load_drafter(path, engine.arch, dtype=engine.runner.dtype,
                           device=engine.device)
    tr = DrafterTrainer(drafter, engine.runner, lr=lr, weight_decay=dg.weight_decay,
                        warmup_steps=dg.lr_warmup_steps, total_steps=a.steps,
                        min_lr_ratio=1.0, grad_clip=dg.grad_clip, loss=loss)
    rows, losses = [], []
    order = itertools.cycle(plan)
    for k in range(1, a.steps + 1):
        losses.append(float(tr.step([train[i] for i in next(order)])["loss"]))
        if k in marks:
            rows.append(dict(alpha(drafter, engine, held, a.temperature), steps=k,
                             loss=sum(losses) / len(losses)))
            print(f"[lr] lr {lr:g} after {k:>3} steps: alpha {rows[-1]['alpha']:.4f}"
                  f"  predicted accept len {rows[-1]['predicted_accept_len']:.3f}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)

    import torch

    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    torch.set_num_threads(a.threads)
    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.config import DrafterGroupConfig, RolloutConfig
    from megatron_tlt.drafter_training.prepared import demo_drafter
    from megatron_tlt.models.drafter import load_drafter
    from megatron_tlt.rollout import RolloutEngine

    t0 = time.perf_counter()
    dg = DrafterGroupConfig()
    engine = RolloutEngine.from_pretrained(require_smollm2(), RolloutConfig(max_batch_size=32))
    path = Path(a.drafter) if a.drafter else demo_drafter()
    base = load_drafter(path, engine.arch, dtype=engine.runner.dtype, device=engine.device)
    train, held = sampled_sets(engine, a, t0)
    marks = sorted({int(x) for x in a.checkpoints.split(",") if int(x) <= a.steps})

    res: dict = {"start": alpha(base, engine, held, a.temperature), "lrs": {}}
    print(f"[lr] start: alpha {res['start']['alpha']:.4f}", flush=True)
    for lr in (float(x) for x in a.lrs.split(",")):
        res["lrs"][f"{lr:g}"] = train_at(lr, path, engine, train, held, a, dg, marks)
        if a.json:  # after every rate: a cut-short sweep keeps what it measured
            write_json(a.json, res)
    best = max(res["lrs"], key=lambda k: res["lrs"][k][-1]["alpha"])
    res["best_lr"] = float(best)
    res["config"] = {"prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
                     "temperature": a.temperature, "steps": a.steps,
                     "batch_tokens": dg.batch_tokens, "loss": dg.loss,
                     "warmup_steps": dg.lr_warmup_steps, "drafter": str(path),
                     "minutes": (time.perf_counter() - t0) / 60}
    print(f"[lr] best after {a.steps} steps: lr {best}", flush=True)
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
