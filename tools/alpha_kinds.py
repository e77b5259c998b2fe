#!/usr/bin/env python
"""The exact α by draft depth of the one-layer drafter and the self-drafter side by side.

    python tools/alpha_kinds.py --config examples/rl/smollm2_cpu.yaml --json alpha.json
    python tools/alpha_kinds.py --model smollm2 --drafter d.safetensors --temperature 0.7
    python tools/alpha_kinds.py --self-source ckpt/hf-step10   # + a stale copy's column

Held-out responses of the target (``--prompts`` x ``--samples-per-prompt``, sampled at
the recipe's or the given temperature / top-p / top-k) are measured once and every
drafter is scored on those same samples with the same settings
(``megatron_tlt.drafter_training.alpha_kinds``): the one-layer drafter (``--drafter``:
a checkpoint, ``random``, or by default the demo's cached one) and the policy's
int8 copy (``self``, ``--self-group``, ``--self-act-block``), plus, per ``--self-source``, the
int8 copy of another checkpoint of the same architecture (``self@NAME``: the α a copy
that is not refreshed after updates would have). Reported per drafter: α at depths
1..``--depth`` (over the same positions for every kind), E[max p̃], the draft
vocabulary's mass, the depth-k chain's acceptance length predicted from α and, unless
``--no-measure``, measured by the engine on the same prompts. α is an expectation
over every held-out token, not a timing: it holds on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_tlt.runtime_env import silence_expected_warnings


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    a = ap.add_argument
    a("--model", default="smollm2", help="HF folder, converted checkpoint or 'smollm2'")
    a("--drafter", default=None,
      help="one-layer drafter: a checkpoint, 'random' (untrained, seeded) or 'none' "
           "(default: the demo's cached drafter, else random)")
    a("--draft-vocab", type=int, default=1024,
      help="draft vocabulary of a random drafter (0: the full vocabulary)")
    a("--self-group", type=int, default=0,
      help="inputs per int8 scale of the copy (0: one scale per output channel)")
    a("--self-act-block", type=int, default=32,
      help="inputs per scale of the copy's int8 activations (0: float activations, "
           "weight-only int8; rollout.speculative.kinds.self.act_block)")
    a("--self-source", action="append", default=[],
      help="another checkpoint of the same architecture whose int8 copy is scored too "
           "(repeatable; column self@<folder name>)")
    a("--config", default=None,
      help="RL recipe (YAML): its task, prompt format and sampling settings, prompts "
           "drawn with a seed its warm-up does not use")
    a("--task", default=None, help="reasoning-gym task without --config")
    a("--prompts", type=int, default=8)
    a("--samples-per-prompt", type=int, default=1)
    a("--max-new-tokens", type=int, default=None, help="default: the recipe's, else 128")
    a("--temperature", type=float, default=None, help="default: the recipe's, else 1.0")
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--depth", type=int, default=4)
    a("--seed", type=int, default=1)
    a("--no-measure", action="store_true",
      help="skip the engine's measured acceptance length (one chain run per drafter)")
    a("--json", default=None, help="write the report here")
    return ap.parse_args(argv)


RECIPE_SEED_OFFSET = 7919  # as bench_spec: prompts unrelated to the recipe's warm-up


def sampling_and_prompts(args, tokenizer):
    """(temperature, top_p, top_k, max_new_tokens, prompt token ids)."""
    from megatron_tlt.drafter_training.warmup import WarmupConfig, recipe_prompts
    from megatron_tlt.tasks import reasoning_gym_prompts

    if args.config:
        rc = WarmupConfig.from_recipe(args.config)
        prompts = recipe_prompts(rc, tokenizer, args.prompts,
                                 seed=rc.seed + RECIPE_SEED_OFFSET + args.seed)
        t, p, k, n = rc.temperature, rc.top_p, rc.top_k, rc.max_new_tokens
    else:
        kw = {"task": args.task} if args.task else {}
        prompts = [x.token_ids for x in reasoning_gym_prompts(tokenizer, n=args.prompts,
                                                              seed=args.seed, **kw)]
        t, p, k, n = 1.0, 1.0, 0, 128

    def pick(given, default):
        return default if given is None else given

    return (pick(args.temperature, t), pick(args.top_p, p), pick(args.top_k, k),
            pick(args.max_new_tokens, n), prompts)


def one_layer_drafter(arg, engine, draft_vocab: int, seed: int):
    """(drafter or None, description)."""
    from megatron_tlt.rollout.speculative.drafters import (is_untrained, make_drafter,
                                                           resolve_value, untrained_value)

    if arg == "none":
        return None, None
    if arg is None:
        from megatron_tlt.assets import default_cache_dir

        demo = default_cache_dir() / "drafters" / "smollm2-chain_sum-demo-sampled.safetensors"
        arg = str(demo) if demo.is_file() else untrained_value(draft_vocab)
    arg = resolve_value(arg, draft_vocab=draft_vocab)  # random: --draft-vocab tokens
    d = make_drafter(arg, arch=engine.arch, dtype=engine.runner.dtype, device=engine.device,
                     seed=seed)
    return d, (f"{arg} (untrained, seed {seed})" if is_untrained(arg) else arg)


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    import torch

    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.config.kinds import KindSettings, SelfSettings
    from megatron_tlt.drafter_training import alpha_kinds
    from megatron_tlt.drafter_training.alpha import held_out_samples
    from megatron_tlt.models import arch_from_source, load_model, resolve_source
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.rollout.forward import ModelRunner
    from megatron_tlt.rollout.speculative.drafters import make_drafter
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    engine = RolloutEngine.from_pretrained(args.model, RolloutConfig(max_batch_size=64))
    temp, top_p, top_k, max_new, prompts = sampling_and_prompts(args, engine.tokenizer)
    drafters, described = {}, {}
    eagle, name = one_layer_drafter(args.drafter, engine, args.draft_vocab, args.seed)
    if eagle is not None:
        drafters[eagle.name], described[eagle.name] = eagle, name
    copy = make_drafter("self", arch=engine.arch, dtype=engine.runner.dtype,
                        device=engine.device,
                        sc=SpeculativeConfig(kinds=KindSettings(self=SelfSettings(
                            group=args.self_group, act_block=args.self_act_block))))
    drafters[copy.name] = copy
    described[copy.name] = (f"the policy's int8 copy (weight group {args.self_group}, "
                            f"activation block {args.self_act_block})")
    for src in args.self_source:
        path = resolve_source(src)
        if arch_from_source(path) != engine.arch:
            print(f"alpha_kinds: --self-source {src} is not the model's architecture",
                  file=sys.stderr)
            return 2
        other, arch = load_model(path, device=engine.device, dtype=str(
            engine.runner.dtype).replace("torch.", ""), impl="auto")
        label = f"self@{Path(src).name}"
        drafters[label] = SelfDrafter(group=args.self_group, act_block=args.self_act_block,
                                      source=ModelRunner(other, arch))
        described[label] = f"the int8 copy of {src}"
    for k, v in described.items():
        print(f"{k}: {v}", flush=True)

    sp = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, max_new_tokens=max_new,
                        seed=args.seed + 7)
    layers = eagle.feature_layers if eagle is not None else ()
    held = held_out_samples(engine, prompts, sp, per_prompt=args.samples_per_prompt,
                            feature_layers=layers)
    result = alpha_kinds.compare(engine, drafters, held, temperature=temp, top_k=top_k,
                                 top_p=top_p, depth=args.depth,
                                 measure_prompts=None if args.no_measure else prompts,
                                 measure_sampling=sp)
    for line in alpha_kinds.table_lines(result):
        print(line, flush=True)
    if args.json:
        result.update(benchmark="alpha_kinds", model=str(args.model), drafters=described,
                      prompts=len(prompts), samples_per_prompt=args.samples_per_prompt,
                      max_new_tokens=max_new, recipe=args.config, seed=args.seed,
                      threads=torch.get_num_threads())
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
