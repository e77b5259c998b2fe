#!/usr/bin/env python
"""Offline drafter warm-up: self-distillation on the target's own responses.

    python tools/warmup_drafter.py --out drafters/smollm2.safetensors          # SmolLM2
    python tools/warmup_drafter.py --model /path/to/hf --task chain_sum --train-prompts 512

1. Generates responses with the target on reasoning-gym prompts (the rollout engine,
   greedy unless --temperature > 0; --samples-per-prompt for several per prompt).
2. Runs the target once over every prompt + response to capture its features (final
   hidden states, or three layers with --eagle3).
3. Trains the drafter (smooth-L1 on the next hidden state + 0.1 x soft cross-entropy
   against the target's next-token distribution, response positions only; AdamW with
   warm-up and cosine decay).
4. Saves the checkpoint (drafter-owned weights + config, safetensors) and prints the
   acceptance length of speculative decoding on held-out prompts, checking that the
   greedy outputs equal plain decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_tlt.platform import silence_expected_warnings  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", default="smollm2", help="HF folder, checkpoint or 'smollm2'")
    ap.add_argument("--out", required=True, help="drafter checkpoint (.safetensors or folder)")
    ap.add_argument("--task", default=None, help="reasoning-gym task (default: the workload's)")
    ap.add_argument("--train-prompts", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--samples-per-prompt", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the training responses (0 = greedy)")
    ap.add_argument("--epochs", type=int, default=6,
                    help="training epochs; 0 with --init: no training, only --draft-vocab's "
                         "re-selection and the held-out evaluation")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="prune the draft vocabulary to the N most frequent response tokens "
                         "(0 = full; with --init: re-select, 0 keeps the checkpoint's)")
    ap.add_argument("--eagle3", action="store_true", help="three target layers as features")
    ap.add_argument("--unroll", type=int, default=1,
                    help="training passes; pass k feeds the drafter its own outputs (as "
                         "drafting k tokens ahead does)")
    ap.add_argument("--eval-strategy", default="6_1_6", help="depth_topk_verifytokens")
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--responses", default=None,
                    help="keep generated responses in this JSON-lines file and reuse them: "
                         "an interrupted or extended run generates only what is missing")
    ap.add_argument("--generate-only", action="store_true",
                    help="stop after generating the responses (needs --responses): data "
                         "made now, or on another machine, for a later training run")
    ap.add_argument("--chunk", type=int, default=256,
                    help="prompts per generate call (progress and --responses granularity)")
    ap.add_argument("--init", default=None, help="start from this drafter checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write a summary here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.drafter_training.trainer import draft_vocabulary
    from megatron_tlt.models.drafter import (DrafterConfig, EagleDrafter, load_drafter,
                                             save_drafter)
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.rollout.tuner import Strategy
    from megatron_tlt.rollout.workload import DEFAULT_TASK, reasoning_gym_prompts

    if args.train_prompts < 1 or args.eval_prompts < 0 or args.epochs < 0 or args.chunk < 1:
        raise SystemExit("--train-prompts and --chunk must be >= 1, --epochs and "
                         "--eval-prompts >= 0")
    if args.epochs == 0 and not args.init:
        raise SystemExit("--epochs 0 (no training) needs --init: a drafter to re-select the "
                         "draft vocabulary of and evaluate")
    if args.generate_only and not args.responses:
        raise SystemExit("--generate-only needs --responses (where the responses are kept)")
    Strategy.parse(args.eval_strategy)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    src = args.model
    if src == "smollm2":
        from megatron_tlt.assets import require_smollm2

        src = require_smollm2()
    engine = RolloutEngine.from_pretrained(src, RolloutConfig(max_batch_size=32))
    arch, tok = engine.arch, engine.tokenizer
    task = args.task or DEFAULT_TASK
    n_total = args.train_prompts + args.eval_prompts
    prompts = [p.token_ids for p in reasoning_gym_prompts(tok, task, n=n_total, seed=args.seed)]
    train_p, eval_p = prompts[: args.train_prompts], prompts[args.train_prompts:]

    # 1. responses
    print(f"[1/4] generating {len(train_p) * args.samples_per_prompt} responses "
          f"({task}, max {args.max_new_tokens} tokens, temperature {args.temperature})",
          flush=True)
    t0 = time.perf_counter()
    reqs = [p for p in train_p for _ in range(args.samples_per_prompt)]
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        seed=args.seed)
    store = None
    if args.responses:
        from megatron_tlt.drafter_training.responses import (ResponseStore,
                                                             ResponseStoreMismatch,
                                                             weights_signature)

        meta = {"model": str(args.model), "weights": weights_signature(engine.runner.model),
                "task": task, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "samples_per_prompt": args.samples_per_prompt}
        try:
            store = ResponseStore(args.responses, meta)
        except ResponseStoreMismatch as e:
            raise SystemExit(f"--responses: {e}") from None
    resp: list = [None] * len(reqs)
    if store is not None:
        resp = [store.get(i, p) for i, p in enumerate(reqs)]
        print(f"  {sum(r is not None for r in resp)}/{len(reqs)} responses reused from "
              f"{args.responses}", flush=True)
    todo = [i for i, r in enumerate(resp) if r is None]
    for c in range(0, len(todo), args.chunk):
        idx = todo[c: c + args.chunk]
        for i, o in zip(idx, engine.generate([reqs[i] for i in idx], sp)):
            resp[i] = o.token_ids
        if store is not None:
            store.add_many((i, reqs[i], resp[i]) for i in idx)
        print(f"  {c + len(idx)}/{len(todo)} generated ({time.perf_counter() - t0:.0f}s)",
              flush=True)
    if args.generate_only:
        print(f"{len(resp)} responses ({sum(len(r) for r in resp)} tokens) in "
              f"{args.responses}; done in {time.perf_counter() - t_start:.0f}s", flush=True)
        return 0
    seqs = [p + r for p, r in zip(reqs, resp)]
    n_resp = sum(len(r) for r in resp)

    # 2. features
    if args.init:
        drafter = load_drafter(args.init, arch, dtype=engine.runner.dtype, device=engine.device)
    else:
        cfg = DrafterConfig.for_target(arch, feature_layers="auto" if args.eagle3 else ())
        drafter = EagleDrafter(cfg, arch, dtype=engine.runner.dtype, device=engine.device)
        drafter.reset_parameters(args.seed)
    if args.draft_vocab:  # (the head is the target's: re-selecting keeps --init's training)
        drafter.set_draft_vocabulary(draft_vocabulary(resp, args.draft_vocab, arch.vocab_size,
                                                      always=list(engine.eos_token_ids)))
        covered = torch.isin(torch.tensor([t for r in resp for t in r]),
                             drafter.d2t.cpu()).float().mean()
        print(f"  draft vocabulary {args.draft_vocab} tokens covers {covered:.1%} of "
              f"response tokens", flush=True)
    t1 = time.perf_counter()
    if args.epochs == 0:
        print("[2/4] [3/4] no training (--epochs 0)", flush=True)
        hist: list[dict] = []
        t2 = time.perf_counter()
    else:
        hist, t2 = _train(args, engine, drafter, seqs, reqs, n_resp)
    extra = {"task": task, "temperature": args.temperature}
    if args.epochs:  # (without training the checkpoint keeps its own training record)
        extra.update(train_prompts=args.train_prompts, response_tokens=n_resp,
                     epochs=args.epochs)
    if args.init:
        extra["init"] = Path(args.init).name
    out = save_drafter(drafter, args.out, extra=extra)
    print(f"  saved {out}", flush=True)

    # 4. evaluation
    result = {"checkpoint": str(out), "task": task, "response_tokens": n_resp,
              "train_steps": len(hist),
              "final_loss": hist[-1]["loss"] if hist else None,
              "final_top1": hist[-1]["top1"] if hist else None, "generate_seconds": t1 - t0,
              "train_seconds": time.perf_counter() - t2}
    if eval_p:
        print(f"[4/4] held-out: {len(eval_p)} prompts, strategy {args.eval_strategy}, "
              f"greedy, {args.eval_new_tokens} tokens", flush=True)
        esp = SamplingParams(temperature=0.0, max_new_tokens=args.eval_new_tokens)
        plain = [o.token_ids for o in engine.generate(eval_p, esp)]
        engine.config.speculative = SpeculativeConfig(policy="fixed", strategy=args.eval_strategy,
                                                      threshold=1 << 30)
        engine.attach_drafter(drafter)
        spec = [o.token_ids for o in engine.generate(eval_p, esp)]
        summ = engine.last_stats.spec.summary()
        same = sum(a == b for a, b in zip(plain, spec))
        result.update(accept_len=summ["accept_len"], identical=same, eval_prompts=len(eval_p),
                      accept_rate_at_position=summ["accept_rate_at_position"])
        print(f"  acceptance length {summ['accept_len']:.2f} tokens per step; outputs "
              f"identical to plain decoding for {same}/{len(eval_p)} prompts", flush=True)
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _train(args, engine, drafter, seqs, reqs, n_resp):
    """Steps 2 and 3: the target's features over every sequence, then training.
    Returns the training history and the time training started."""
    from megatron_tlt.drafter_training.trainer import (DraftSample, DrafterTrainer,
                                                       target_features)

    print(f"[2/4] target features for {len(seqs)} sequences ({n_resp} response tokens)",
          flush=True)
    t1 = time.perf_counter()
    every = max(1, len(seqs) // 10)
    feats = target_features(
        engine.runner, seqs, drafter.config.feature_layers,
        progress=lambda k: (k % every == 0 or k == len(seqs)) and print(
            f"  {k}/{len(seqs)} sequences ({time.perf_counter() - t1:.0f}s)", flush=True))
    samples = [DraftSample(s, len(p), f, h)
               for s, p, (f, h) in zip(seqs, reqs, feats)]

    # 3. training
    n_batches = max(1, sum(len(s) for s in seqs) // args.batch_tokens)
    total = args.epochs * n_batches
    print(f"[3/4] training: {args.epochs} epochs, ~{total} steps, lr {args.lr}", flush=True)
    t2 = time.perf_counter()
    trainer = DrafterTrainer(drafter, engine.runner, lr=args.lr, total_steps=total,
                             warmup_steps=max(1, total // 20), unroll=args.unroll)
    hist = trainer.fit(samples, epochs=args.epochs, batch_tokens=args.batch_tokens,
                       seed=args.seed, log_every=max(1, total // 20))
    return hist, t2


if __name__ == "__main__":
    raise SystemExit(main())
