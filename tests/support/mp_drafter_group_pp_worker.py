"""Worker for tests/drafter/test_drafter_group_pp.py: the drafter group at PP = 2 x DP = 2
(4 gloo ranks, rollout.pipeline_mode=gathered, a tiny untied model: each stage reads a
copy of the vocabulary matrix it does not own).

    torchrun --standalone --nproc_per_node 4 tests/support/mp_drafter_group_pp_worker.py \
        --model TINY_HF_DIR --out DIR

Each rank writes DIR/rank{R}.json:

- uneven: replica 1 (both its pipeline ranks) finishes only after replica 0 took 3
  micro-steps -> replica 0's pipeline ranks train together, replica 1's do not, and
  every rank leaves with the same drafter and AdamW moments (and the same checksum);
- pp_failure: replica 0's last stage alone gets a NaN loss -> both its pipeline ranks
  restore, every rank turns speculation off for one rollout (the guarded generate takes
  no speculative step, the next one does);
- resume: the checkpoint store's save and load into a fresh drafter and group;
- pp2 / pp1: the group's loss, alpha and clipped gradient on one batch (full and pruned
  draft vocabulary) at PP = 2 and at PP = 1 (model parallelism re-initialised);
- canary: after a stand-in policy update of the embedding (first stage) and the output
  layer (last stage), the canary's alpha on every rank and at PP = 1 on the updated
  weights.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_tlt.checkpoint import store as checkpoint_store
    from megatron_tlt.checkpoint.state import RunState
    from megatron_tlt.config import DrafterGroupConfig
    from megatron_tlt.drafter_training.alpha import measure_alpha
    from megatron_tlt.drafter_training.group import default_store
    from megatron_tlt.drafter_training.target_view import WholeVocabTarget
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
    from megatron_tlt.rollout import SamplingParams

    from drafter_group_setup import (everywhere, identical_everywhere, loss_and_grad,
                                     make_group, runner_at_mp1, tiny_engine, write_result)

    env = tiny_engine(args.model, pp=2)
    lay, model, arch, engine = env.layout, env.model, env.arch, env.engine
    # (replica 0 trains 3 to 8 micro-steps: replica 1 finishes after its 3rd)
    cfg = DrafterGroupConfig(lr=1e-3, lr_warmup_steps=0, max_steps_per_window=8,
                             batch_tokens=24, canary_sequences=2)
    store = default_store()
    group = make_group(env, cfg, store)
    policy_before = [p.detach().clone() for p in model.parameters()]

    res: dict = {"pp_rank": lay.pp_rank, "dp_rank": lay.dp_rank}

    # ---- uneven: replica 1 finishes after replica 0's 3rd micro-step
    def record(steps):
        if steps == 3 and lay.pp_rank == 0:
            store.set("pp_uneven/r0_three", "1")

    before = group._flat(create=True).clone()
    if lay.dp_rank == 0:
        group.after_micro_step = record
    else:
        store.wait(["pp_uneven/r0_three"])
    rec = group.run_window(1, env.responses(1))
    group.after_micro_step = None
    after = group._flat()
    sums = everywhere(rec["checksum"])
    alpha = group.canary_alpha()
    res["uneven"] = {
        "steps": rec["steps"], "last_finisher": rec["last_finisher"],
        "failure": rec["failure"], "version": group.version, "healed": rec["healed"],
        "changed": not torch.equal(before, after), "identical": identical_everywhere(after),
        "checksums_equal": len(set(sums)) == 1 and sums[0] is not None,
        "policy_untouched": all(torch.equal(a, b) for a, b in
                                zip(policy_before, model.parameters())),
        "alpha": alpha, "alphas_equal": len(set(everywhere(alpha))) == 1}

    # ---- a NaN loss on replica 0's last stage: the whole replica restores, and the
    # next rollout runs without speculation on every rank
    real_loss = group.trainer.loss

    def nan_loss(batch):
        store.set("pp_fail/r0_training", "1")  # replica 1 finishes once this ran
        loss, parts = real_loss(batch)
        return loss * float("nan"), dict(parts, loss=float("nan"))

    if lay.dp_rank == 0 and lay.pp_rank == 1:
        group.trainer.loss = nan_loss
    before = group._flat().clone()
    if lay.dp_rank == 1:
        store.wait(["pp_fail/r0_training"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = group.run_window(2, env.responses(2))
    group.trainer.loss = real_loss
    off = group.speculation_off
    short = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    with group.speculation_guard(engine):
        engine.generate(env.prompts[:2], short)
    guarded = getattr(engine.last_stats.spec, "steps", 0)
    engine.generate(env.prompts[:2], short)
    res["pp_failure"] = {"failure": rec["failure"], "steps": rec["steps"],
                         "speculation_off": off, "guarded_spec_steps": guarded,
                         "after_spec_steps": getattr(engine.last_stats.spec, "steps", 0),
                         "restored": bool(torch.equal(before, group._flat())),
                         "identical": identical_everywhere(group._flat())}

    # ---- resume through the checkpoint store: a fresh drafter and group
    folder = Path(args.out) / "ckpt"
    checkpoint_store.save(RunState(step=1, drafter=group.drafter, drafter_group=group),
                          folder, lay)
    fresh = EagleDrafter(DrafterConfig.for_target(arch), arch)
    fresh.reset_parameters(seed=99)
    g2 = make_group(env, cfg, store, fresh)
    differed = not torch.equal(g2._flat(create=True), group._flat())
    step = checkpoint_store.latest(folder)  # (no policy in it: verification would refuse)
    checkpoint_store.load(RunState(drafter=fresh, drafter_group=g2), folder, lay,
                          chosen=(step, json.loads((step / "run.json").read_text())))
    res["resume"] = {"differed_before": differed,
                     "same": bool(torch.equal(g2._flat(), group._flat())),
                     "identical": identical_everywhere(g2._flat()),
                     "step_count": g2.trainer.step_count == group.trainer.step_count,
                     "version": g2.version == group.version,
                     "buffer": g2.buffer.tokens == group.buffer.tokens}

    # ---- the loss and its clipped gradient at PP = 2 (each stage's target view)
    batch = next(group.buffer.batches(cfg.batch_tokens, seed=5))
    vocab = torch.arange(0, arch.vocab_size, 3)  # a pruned draft vocabulary
    res["pp2"] = loss_and_grad(EagleDrafter(DrafterConfig.for_target(arch), arch),
                               WholeVocabTarget(engine.runner), batch, env.init_state,
                               cfg.loss, vocab)

    # ---- the canary after a policy update (between two generates: the copies of the
    # vocabulary matrices are stale until it re-sends them)
    def update(m):
        """A stand-in policy update of the embedding and the output layer (where this
        stage holds them)."""
        with torch.no_grad():
            for w, seed in ((getattr(getattr(m, "embedding", None), "word_embeddings", None),
                             11), (getattr(m, "output_layer", None), 12)):
                if w is not None:
                    g = torch.Generator().manual_seed(seed)
                    w.weight.add_(0.1 * torch.randn(w.weight.shape, generator=g))

    update(model)
    canary = group.canary_alpha()
    res["canary"] = {"alpha": canary, "before_update": alpha,
                     "alphas_equal": len(set(everywhere(canary))) == 1}
    trained = {k: v.clone() for k, v in group.drafter.own_state().items()}
    samples = [r.draft_sample() for r in group.buffer.sample(cfg.canary_sequences)]

    # ---- the same at PP = 1
    model1, runner1 = runner_at_mp1(args.model, arch)
    d1 = EagleDrafter(DrafterConfig.for_target(arch), arch)
    res["pp1"] = loss_and_grad(d1, WholeVocabTarget(runner1), batch, env.init_state,
                               cfg.loss, vocab)
    update(model1)
    d1.load_own_state(trained)
    res["canary"]["pp1_alpha"] = measure_alpha(
        d1, WholeVocabTarget(runner1), samples, temperature=0.7, top_k=20, top_p=0.9,
        depth=1).alpha[0]

    write_result(args.out, res)


if __name__ == "__main__":
    main()
