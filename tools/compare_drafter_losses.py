#!/usr/bin/env python
"""Drafter losses, draft vocabularies and unroll depths compared by the exact α.

    python tools/compare_drafter_losses.py --config examples/rl/smollm2_cpu.yaml \\
        --responses resp.jsonl --variants kl,tv,log_accept,kl+tv,eagle --vocab 1024 \\
        --json docs/results/drafter_losses.json

One data set (the recipe's sampled responses, kept in --responses and reused), one
held-out set (responses to unseen prompts at the same settings), one seeded initial
drafter; each variant trains a fresh copy for --epochs epochs and reports, after every
epoch, α at depths 1..--depth on the held-out set (``drafter_training.alpha``): α
against training tokens. A variant is ``LOSS[@uUNROLL][@hHIDDEN][@vVOCAB][@lLR][@iLAYER]``,
e.g. ``kl@u2``, ``log_accept@h0.1@v4096``, ``kl+tv@l5e-4@i-1`` (``@iL``: the drafter's
layer starts as a copy of target layer L, ``layer_init.py``). α is an expectation over
every held-out token, not a timing: the comparison holds on a busy machine.

``--eval-at 4000,8000,...`` also measures α whenever the training tokens seen (response
tokens, repeats counted) pass one of those counts: one pass over a large data set gives
α against training tokens without retraining per data size. ``--train-tokens N`` keeps
only the first responses up to N tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from megatron_tlt.runtime_env import silence_expected_warnings


def parse_variant(text: str, default_vocab: int, default_lr: float) -> dict:
    loss, *opts = text.split("@")
    v = {"name": text, "loss": loss, "unroll": 1, "hidden": None, "vocab": default_vocab,
         "lr": default_lr, "init_layer": None}
    for o in opts:
        key, val = o[0], o[1:]
        if key == "u":
            v["unroll"] = int(val)
        elif key == "h":
            v["hidden"] = float(val)
        elif key == "v":
            v["vocab"] = int(val)
        elif key == "l":
            v["lr"] = float(val)
        elif key == "i":
            v["init_layer"] = int(val)
        else:
            raise SystemExit(f"--variants: {text!r}: unknown option {o!r} (uN unroll, "
                             "hW hidden weight, vN draft vocabulary, lLR learning rate, "
                             "iL init from target layer L)")
    return v


def write_json(args, cfg, train, held, cov, rows, n_tok) -> None:
    import torch

    out = dict(benchmark="compare_drafter_losses", config=vars(args),
               temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
               train_responses=len(train), train_tokens=n_tok, held_out=len(held),
               coverage={str(k or "full"): x for k, x in cov.items()}, rows=rows,
               threads=torch.get_num_threads())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


def plot_curves(rows, path) -> None:
    """α at depth 1 against training tokens per variant, with the E[max p̃] bar and the
    draft vocabulary's mass (the ceiling of a pruned vocabulary) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in (r for r in rows if "curve" in r):
        c = r["curve"]
        line, = ax.plot([x["train_tokens"] for x in c], [x["alpha"][0] for x in c], "o-",
                        ms=3, label=r["variant"]["name"])
        ax.axhline(c[-1]["vocab_mass"], color=line.get_color(), ls=":", lw=0.8)
    last = [r for r in rows if "curve" in r][-1]["curve"][-1]
    ax.axhline(last["e_max_p"], color="k", ls="--", lw=1, label="E[max p̃] (top-token bar)")
    ax.axhline(0.65, color="r", ls="--", lw=1, label="goal 0.65")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen (response tokens, repeats counted)")
    ax.set_ylabel(f"held-out α at depth 1 (T={last['temperature']:g})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True, help="RL recipe (task and sampling)")
    ap.add_argument("--responses", default=None, help="resumable response store")
    ap.add_argument("--train-prompts", type=int, default=16)
    ap.add_argument("--samples-per-prompt", type=int, default=None)
    ap.add_argument("--eval-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--variants", default="kl,tv,log_accept,kl+tv,eagle")
    ap.add_argument("--vocab", type=int, default=1024, help="draft vocabulary (0 = full)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--eval-at", default="",
                    help="also measure alpha when the training tokens seen pass these "
                         "counts (comma-separated)")
    ap.add_argument("--train-tokens", type=int, default=0,
                    help="train on the first responses up to this many tokens (0 = all)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1,
                    help="cosine schedule floor, as a fraction of the peak lr")
    ap.add_argument("--samples-cache", default=None,
                    help="keep the training and held-out samples (with features) in this "
                         "torch file and reuse them")
    ap.add_argument("--gen-seconds", type=float, default=float("inf"),
                    help="stop generating new training responses after this long (the "
                         "samples cache keeps what was made; a later run continues)")
    ap.add_argument("--data-only", action="store_true",
                    help="stop after making the data (with --samples-cache)")
    ap.add_argument("--checkpoints", default="",
                    help="drafter checkpoints (comma-separated) whose alpha on the same "
                         "held-out set is reported next to the variants (no training)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--save-dir", default=None,
                    help="save each variant's trained drafter here as VARIANT.safetensors")
    ap.add_argument("--plot", default=None, help="α against training tokens (PNG)")
    return ap.parse_args(argv)


class Data:
    """The recipe's prompts (held-out first: the same whatever --train-prompts, so a
    data set can grow), its training requests and the sampling of both sets."""

    def __init__(self, cfg, engine):
        from megatron_tlt.drafter_training.warmup import recipe_prompts
        from megatron_tlt.rollout import SamplingParams

        prompts = recipe_prompts(cfg, engine.tokenizer, cfg.train_prompts + cfg.eval_prompts)
        self.eval_p, train_p = prompts[: cfg.eval_prompts], prompts[cfg.eval_prompts:]
        self.reqs = [p for p in train_p for _ in range(cfg.samples_per_prompt)]
        self.sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                                 seed=cfg.seed)
        self.hsp = dataclasses.replace(self.sp, seed=cfg.seed + 1)


def data_from_responses(cfg, engine, base, data: Data):
    """Responses kept as tokens in --responses, a second forward for the features."""
    from megatron_tlt.drafter_training.alpha import held_out_samples
    from megatron_tlt.drafter_training.warmup import generate_responses, response_samples

    resp = generate_responses(cfg, engine, data.reqs, data.sp, print, "train")
    print("target features (training set)", flush=True)
    train = response_samples(engine, base, data.reqs, resp, print)
    print("held-out responses and features", flush=True)
    held = held_out_samples(engine, data.eval_p, data.hsp,
                            per_prompt=min(cfg.samples_per_prompt, 4))
    return train, held


def data_from_generation(args, cfg, engine, data: Data, t0: float):
    """Features from the generation itself (sampled_data.py), kept in --samples-cache and
    extended there until --gen-seconds."""
    import torch

    from megatron_tlt.drafter_training.sampled_data import sampled_samples

    cache = Path(args.samples_cache) if args.samples_cache else None
    train, held, done = [], None, 0
    if cache is not None and cache.is_file():
        train, held, done = torch.load(cache, weights_only=False)
        print(f"{len(train)} training and {len(held)} held-out samples from {cache}",
              flush=True)
    if held is None:
        held = sampled_samples(engine, data.eval_p, data.hsp,
                               per_prompt=min(cfg.samples_per_prompt, 4))
        if cache is not None:
            torch.save((train, held, done), cache)
    reqs = data.reqs
    chunk = 8 * cfg.samples_per_prompt  # requests per generate call (whole groups)
    while done < len(reqs) and time.perf_counter() - t0 < args.gen_seconds:
        part = reqs[done: done + chunk]
        psp = dataclasses.replace(data.sp, seed=cfg.seed + 1000 + done)
        train += sampled_samples(engine, part[:: cfg.samples_per_prompt], psp,
                                 per_prompt=cfg.samples_per_prompt, chunk=chunk)
        done += len(part)
        if cache is not None:
            torch.save((train, held, done), cache)
        print(f"  {done}/{len(reqs)} responses, "
              f"{sum(len(x.tokens) - x.prompt_len for x in train)} tokens "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return train, held


def first_tokens(train: list, limit: int) -> list:
    """The first responses up to ``limit`` response tokens (0: all)."""
    if not limit:
        return train
    keep, acc = [], 0
    for s in train:
        if acc >= limit:
            break
        keep.append(s)
        acc += len(s.tokens) - s.prompt_len
    return keep


def checkpoint_rows(args, cfg, engine, held) -> list[dict]:
    """Alpha of each --checkpoints drafter on the held-out set (no training)."""
    from megatron_tlt.drafter_training.alpha import measure_alpha
    from megatron_tlt.models.drafter import load_drafter

    rows = []
    for path in filter(None, args.checkpoints.split(",")):
        d = load_drafter(path, engine.arch)
        rep = measure_alpha(d, engine.runner, held, temperature=cfg.temperature,
                            top_k=cfg.top_k, top_p=cfg.top_p, depth=args.depth)
        print(f"  {Path(path).name}: {rep.line()}", flush=True)
        rows.append(dict(checkpoint=str(path), extra=d.config.extra,
                         draft_vocab=d.config.draft_vocab_size, final=rep.to_dict()))
    return rows


def variant_drafter(v: dict, args, engine, base, train, mass):
    """A fresh copy of ``base`` for variant ``v``: its draft vocabulary, its loss (target
    probabilities cached on ``train``) and its layer initialisation."""
    from megatron_tlt.drafter_training.layer_init import copy_target_layer
    from megatron_tlt.drafter_training.losses import cache_target_probs
    from megatron_tlt.drafter_training.vocab import draft_vocabulary_by_mass
    from megatron_tlt.drafter_training.warmup import WarmupConfig
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter

    d = EagleDrafter(DrafterConfig.for_target(engine.arch), engine.arch)
    d.load_state_dict(base.state_dict())
    if v["vocab"]:
        d.set_draft_vocabulary(draft_vocabulary_by_mass(mass, v["vocab"],
                                                        always=list(engine.eos_token_ids)))
    lc = WarmupConfig.from_recipe(args.config, loss=v["loss"], unroll=v["unroll"],
                                  hidden_weight=v["hidden"]).loss_config()
    cache_target_probs(train, engine.runner, d, lc)
    if v["init_layer"] is not None:
        copy_target_layer(d, engine.runner.model, v["init_layer"])
    return d, lc


def train_variant(v: dict, args, cfg, engine, d, lc, train, held, eval_at, n_tok) -> dict:
    """Train ``d`` for --epochs epochs; alpha after every epoch and at each --eval-at
    count of training tokens seen: the variant's row (its curve and final alpha)."""
    import torch

    from megatron_tlt.drafter_training.alpha import measure_alpha
    from megatron_tlt.drafter_training.trainer import DrafterTrainer, length_batches

    batches = length_batches(train, args.batch_tokens)
    trainer = DrafterTrainer(d, engine.runner, lr=v["lr"],
                             total_steps=args.epochs * len(batches),
                             warmup_steps=max(1, len(batches) // 2), loss=lc,
                             min_lr_ratio=args.min_lr_ratio)
    curve = []
    t1 = time.perf_counter()
    seen, todo = 0, [x for x in eval_at if x < n_tok * args.epochs]

    def measure(ep):
        rep = measure_alpha(d, engine.runner, held, temperature=cfg.temperature,
                            top_k=cfg.top_k, top_p=cfg.top_p, depth=args.depth)
        curve.append(dict(epoch=ep, train_tokens=seen, distinct_tokens=min(seen, n_tok),
                          seconds=time.perf_counter() - t1, **rep.to_dict()))
        print(f"  {v['name']:>18} {seen:>7} tokens (epoch {ep:.2f}): {rep.line()} "
              f"({time.perf_counter() - t1:.0f}s)", flush=True)

    for ep in range(args.epochs):
        g = torch.Generator().manual_seed(ep)
        for k, j in enumerate(torch.randperm(len(batches), generator=g).tolist()):
            batch = [train[i] for i in batches[j]]
            trainer.step(batch)
            seen += sum(len(s.tokens) - s.prompt_len for s in batch)
            if todo and seen >= todo[0]:
                while todo and seen >= todo[0]:
                    todo.pop(0)
                measure(ep + (k + 1) / len(batches))
        if not curve or curve[-1]["train_tokens"] != seen:
            measure(ep + 1)
    return dict(variant=v, loss=lc.__dict__, curve=curve, final=curve[-1],
                train_seconds=time.perf_counter() - t1)


def save_variant(d, v: dict, args, row: dict) -> None:
    """The trained drafter, for bench_spec / the engine: --save-dir/VARIANT.safetensors."""
    from megatron_tlt.models.drafter import save_drafter

    out = Path(args.save_dir) / f"{v['name']}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_drafter(d, out, extra=dict(variant=v["name"], recipe=args.config,
                                    train_tokens=row["curve"][-1]["train_tokens"],
                                    final_alpha=row["curve"][-1]["alpha"]))
    print(f"  saved {out}", flush=True)


def print_table(rows: list[dict], depth: int) -> None:
    print("\n| variant | α depth 1..%d | E[max p̃] | vocab mass | predicted accept len |"
          % depth)
    print("|---|---|---|---|---|")
    for r in rows:
        f = r["final"]
        name = r["variant"]["name"] if "variant" in r else Path(r["checkpoint"]).name
        print(f"| {name} | {' / '.join(f'{a:.3f}' for a in f['alpha'])} | "
              f"{f['e_max_p']:.3f} | {f['vocab_mass']:.3f} | "
              f"{f['predicted_accept_len']:.2f} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.drafter_training.vocab import coverage, token_mass
    from megatron_tlt.drafter_training.warmup import COVERAGE_SIZES, WarmupConfig
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
    from megatron_tlt.rollout import RolloutEngine

    variants = [parse_variant(v, args.vocab, args.lr) for v in args.variants.split(",") if v]
    eval_at = sorted(int(x) for x in args.eval_at.split(",") if x.strip())
    cfg = WarmupConfig.from_recipe(args.config, train_prompts=args.train_prompts,
                                   eval_prompts=args.eval_prompts,
                                   samples_per_prompt=args.samples_per_prompt,
                                   max_new_tokens=args.max_new_tokens,
                                   responses=args.responses, chunk=32)
    t0 = time.perf_counter()
    engine = RolloutEngine.from_pretrained(require_smollm2(), RolloutConfig(max_batch_size=32))
    data = Data(cfg, engine)
    base = EagleDrafter(DrafterConfig.for_target(engine.arch), engine.arch)
    base.reset_parameters(cfg.seed)
    train, held = (data_from_responses(cfg, engine, base, data) if args.responses
                   else data_from_generation(args, cfg, engine, data, t0))
    if args.data_only:
        return 0
    if variants and not train:
        raise SystemExit("no training responses yet (--samples-cache holds held-out data "
                         "only): generate some first (--gen-seconds > 0), or pass "
                         "--variants '' to only measure --checkpoints")
    mass = token_mass(engine.runner, train, temperature=cfg.temperature, top_k=cfg.top_k,
                      top_p=cfg.top_p)
    cov = coverage(mass, COVERAGE_SIZES)
    train = first_tokens(train, args.train_tokens)
    n_tok = sum(len(s.tokens) - s.prompt_len for s in train)
    print(f"data ready in {time.perf_counter() - t0:.0f}s: {len(train)} responses "
          f"({n_tok} tokens), {len(held)} held out; mass coverage "
          + ", ".join(f"{k or 'full'} {v:.3f}" for k, v in cov.items()), flush=True)
    rows = checkpoint_rows(args, cfg, engine, held)
    if rows and args.json:
        write_json(args, cfg, train, held, cov, rows, n_tok)
    for v in variants:
        d, lc = variant_drafter(v, args, engine, base, train, mass)
        rows.append(train_variant(v, args, cfg, engine, d, lc, train, held, eval_at, n_tok))
        if args.save_dir:
            save_variant(d, v, args, rows[-1])
        if args.json:  # after every variant: a long comparison keeps what it finished
            write_json(args, cfg, train, held, cov, rows, n_tok)
        if args.plot:
            plot_curves(rows, args.plot)
    print_table(rows, args.depth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
