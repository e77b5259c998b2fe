"""Worker for tests/drafter/test_drafter_group_tp.py: the drafter group at TP = 2 x DP = 2
(4 gloo ranks, a tiny model).

    torchrun --standalone --nproc_per_node 4 tests/support/mp_drafter_group_tp_worker.py \
        --model TINY_HF_DIR --out DIR

Each rank writes DIR/rank{R}.json:

- uneven: replica 1 (both its TP ranks) finishes only after replica 0 took 3 micro-steps
  -> replica 0's TP ranks train together, replica 1's do not, and every rank leaves with
  the same unsharded drafter and AdamW moments (and the same TP-summed checksum);
- tp_failure: replica 0's TP rank 1 alone gets a NaN loss -> both TP ranks of replica
  0 restore their shards, and every rank reports the failure;
- loss (full and pruned draft vocabulary): the group's loss on one batch and its
  clipped gradient (unsharded) at TP = 2; then the same at TP = 1 (model parallelism
  re-initialised, the same weights) for comparison.
"""

from __future__ import annotations

import argparse
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_tlt.config import DrafterGroupConfig
    from megatron_tlt.drafter_training.group import default_store
    from megatron_tlt.drafter_training.target_view import WholeVocabTarget
    from megatron_tlt.drafter_training.trainer import DrafterTrainer
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter

    from drafter_group_setup import (everywhere, identical_everywhere, loss_and_grad,
                                     make_group, runner_at_mp1, tiny_engine, write_result)

    env = tiny_engine(args.model, tp=2)
    lay, model, arch, drafter, engine = env.layout, env.model, env.arch, env.drafter, env.engine
    full0, responses = env.init_state, env.responses

    cfg = DrafterGroupConfig(lr=1e-3, lr_warmup_steps=0, max_steps_per_window=64,
                             batch_tokens=24)
    store = default_store()
    group = make_group(env, cfg, store)
    policy_before = [p.detach().clone() for p in model.parameters()]

    def unsharded() -> torch.Tensor:
        """The whole drafter and its AdamW moments, unsharded (a TP collective)."""
        opt = group.trainer.opt
        moments = {k: [opt.state[p].get(k, torch.zeros_like(p)) for p in group.trainer.params]
                   for k in ("exp_avg", "exp_avg_sq")}
        keep = [(p, p.data.clone()) for p in group.trainer.params]
        parts = [torch.cat([v.reshape(-1) for v in drafter.own_state().values()])]
        for k in ("exp_avg", "exp_avg_sq"):  # the moments through the same unsharding
            for (p, _), m in zip(keep, moments[k]):
                p.data.copy_(m)
            parts.append(torch.cat([v.reshape(-1) for v in drafter.own_state().values()]))
        for p, w in keep:
            p.data.copy_(w)
        return torch.cat(parts)

    res: dict = {"tp_rank": lay.tp_rank, "dp_rank": lay.dp_rank}

    # ---- uneven: replica 1 finishes after replica 0's 3rd micro-step
    def record(steps):
        if steps == 3 and lay.tp_rank == 0:
            store.set("tp_uneven/r0_three", "1")

    before = unsharded()
    if lay.dp_rank == 0:
        group.after_micro_step = record
    else:
        store.wait(["tp_uneven/r0_three"])
    rec = group.run_window(1, responses(1))
    group.after_micro_step = None
    after = unsharded()
    sums = everywhere(rec["checksum"])
    res["uneven"] = {
        "steps": rec["steps"], "last_finisher": rec["last_finisher"],
        "failure": rec["failure"], "version": group.version, "healed": rec["healed"],
        "changed": not torch.equal(before, after),
        "identical": identical_everywhere(after),
        "checksums_equal": len(set(sums)) == 1 and sums[0] is not None,
        "policy_untouched": all(torch.equal(a, b) for a, b in
                                zip(policy_before, model.parameters())),
        "alpha": group.canary_alpha()}

    # ---- a NaN loss on one TP rank of replica 0: the whole replica restores
    real_loss = group.trainer.loss

    def nan_loss(batch):
        store.set("tp_fail/r0_training", "1")  # replica 1 finishes once this ran
        loss, parts = real_loss(batch)
        return loss * float("nan"), dict(parts, loss=float("nan"))

    if lay.dp_rank == 0 and lay.tp_rank == 1:
        group.trainer.loss = nan_loss
    before = unsharded()
    if lay.dp_rank == 1:
        store.wait(["tp_fail/r0_training"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = group.run_window(2, responses(2))
    group.trainer.loss = real_loss
    after = unsharded()
    res["tp_failure"] = {"failure": rec["failure"], "steps": rec["steps"],
                         "speculation_off": group.speculation_off,
                         "restored": bool(torch.equal(before, after)),
                         "identical": identical_everywhere(after)}
    group.speculation_off = False

    # ---- the loss and its clipped gradient at TP = 2 vs TP = 1, same weights and batch
    batch = next(group.buffer.batches(cfg.batch_tokens, seed=5))
    vocab = torch.arange(0, arch.vocab_size, 3)  # a pruned draft vocabulary

    engine.spec.drafter.model.load_own_state(full0)
    res["tp2"] = loss_and_grad(EagleDrafter(DrafterConfig.for_target(arch), arch),
                               WholeVocabTarget(engine.runner), batch, full0, cfg.loss, vocab)
    # the bare sharded runner is refused with a message, not read as a slice
    try:
        DrafterTrainer(engine.spec.drafter.model, engine.runner).loss(batch)
        res["bare_runner_error"] = None
    except ValueError as e:
        res["bare_runner_error"] = str(e)

    _, runner1 = runner_at_mp1(args.model, arch)
    d1 = EagleDrafter(DrafterConfig.for_target(arch), arch)
    # a fresh drafter is the same one at TP = 1 and (sharded) at TP = 2
    res["init_same"] = all(torch.equal(v, full0[k]) for k, v in d1.own_state().items())
    res["tp1"] = loss_and_grad(d1, WholeVocabTarget(runner1), batch, full0, cfg.loss, vocab)

    write_result(args.out, res)


if __name__ == "__main__":
    main()
