"""Worker for tests/rl/test_rl_parallel.py: one GRPO update on a fixed global batch.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_rl_worker.py --out r.json \
        model.hf_path=DIR parallel.tensor_model_parallel_size=2 ...

With ``--variant OVERRIDES`` (repeatable; comma-separated overrides added to the common
ones) it runs one update per variant, one after the other in the same process group
(set-up, groups and seeds made afresh for each), so one launch checks several layouts;
each result names its variant. A variant's item ``flat_prompts=I/J/...`` (not a config
field) gives those prompts' groups equal rewards in that variant's batch, as
``--flat-prompts I,J,...`` does for every variant.

Every layout sees the same global batch: fixed responses for the step's prompts (random
tokens from a fixed seed, varied lengths) with fixed rewards; each replica keeps its own
prompts' groups. The worker fills old log-probs, runs the update (ppo_epochs x
mini-batches) and writes the loss metrics, the gradient norms and the updated model's
log-probs of a probe batch (layout-independent: full-vocabulary softmax).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt.config import load_config


def fixed_samples(trainer, n_prompts: int, group: int, seed: int = 0,
                  flat_prompts: frozenset = frozenset()):
    from megatron_tlt.rl import grpo
    from megatron_tlt.rl.samples import Sample

    gen = torch.Generator().manual_seed(seed)
    prompts = trainer.train_prompts[:n_prompts]
    out = []
    for p_idx, p in enumerate(prompts):
        for k in range(group):
            n = int(torch.randint(3, 12, (1,), generator=gen))
            resp = torch.randint(10, 40000, (n,), generator=gen).tolist()
            reward = 0.5 if p_idx in flat_prompts else float((p_idx + k) % 3 == 0) + 0.25 * k
            out.append(Sample(prompt_index=p_idx, prompt_ids=list(p.token_ids),
                              response_ids=resp,
                              rollout_logprobs=(-torch.rand(n, generator=gen)).tolist(),
                              finish_reason="length" if n > 9 else "stop", reward=reward,
                              uid=p.uid))
    rewards = torch.tensor([s.reward for s in out])
    adv = grpo.group_advantages(rewards, group, trainer.cfg.grpo.norm_adv_by_std)
    for s, a in zip(out, adv.tolist()):
        s.advantage = a
    return out


FLAT = "flat_prompts="  # a variant item naming its zero-advantage prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--flat-prompts", default="",
                        help="comma-separated prompt indices whose group rewards are equal "
                             "(zero advantages)")
    parser.add_argument("--variant", action="append", default=None, metavar="OVERRIDES",
                        help="comma-separated overrides of one update (repeatable)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    everyone = []
    for variant in args.variant or [""]:
        items = [x for x in variant.split(",") if x]
        flat = [x[len(FLAT):].replace("/", ",") for x in items if x.startswith(FLAT)]
        flat = frozenset(int(x) for x in (flat[-1] if flat else args.flat_prompts).split(",")
                         if x)
        cfg = load_config([], [*args.overrides, *(x for x in items if not x.startswith(FLAT))])
        result = update_once(cfg, flat)
        if result is not None:
            result["variant"] = variant
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        everyone += [r for r in results if r is not None]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.barrier()


def update_once(cfg, flat: frozenset):
    """Set up a trainer for ``cfg``, run one update on the fixed batch; this rank's result
    (None on a pipeline stage without logits)."""
    from megatron_tlt.launch import setup
    from megatron_tlt.runtime_env import silence_expected_warnings
    from megatron_tlt.rl.samples import collate
    from megatron_tlt.rl.trainer import Trainer

    silence_expected_warnings()
    session = setup(cfg)
    trainer = Trainer(cfg, session)
    g = cfg.grpo
    everything = fixed_samples(trainer, g.prompts_per_step, g.group_size, flat_prompts=flat)
    mine = set(trainer.replica_prompts(g.prompts_per_step))
    samples = [s for s in everything if s.prompt_index in mine]
    loss_mask = [not (g.overlong == "mask" and s.truncated) for s in samples]
    if not g.use_rollout_logprobs:
        trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    else:
        for s in samples:
            s.old_logprobs = torch.tensor(s.rollout_logprobs)
    if trainer.ref_model is not None:
        trainer._fill_logprobs(samples, trainer.ref_model, "ref_logprobs")
    update = trainer._update(samples, loss_mask, fused_old=False)
    moe = trainer.policy.moe_metrics()  # (every rank: collective)
    # probe: the updated model's log-probs of the first 4 fixed samples (every rank)
    probe = [everything[i] for i in range(4)]
    mb = collate(probe, list(range(4)), pad_id=0, device=trainer.policy.device)
    lp = trainer.policy.logprobs([mb])
    lay = trainer.layout
    if lp is None:
        return None
    lp = (lp[0] * mb.mask).tolist()
    return {"probe_logprobs": lp, "grad_norm": update["grad_norm"],
            "sums": update["sums"], "maxes": update["maxes"], "work": update["work"],
            "lengths": {"advantage": sum(s.length for s in samples if s.advantage != 0),
                        "zero": sum(s.length for s in samples if s.advantage == 0),
                        "advantage_sq": sum(s.length ** 2 for s in samples if s.advantage != 0),
                        "zero_sq": sum(s.length ** 2 for s in samples if s.advantage == 0)},
            "layout": [lay.tp_rank, lay.pp_rank, lay.dp_rank], "moe": moe}


if __name__ == "__main__":
    main()
