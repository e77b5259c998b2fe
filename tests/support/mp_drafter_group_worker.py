"""Worker for tests/drafter/test_drafter_group.py: the drafter group on 2 gloo ranks (DP = 2).

    torchrun --standalone --nproc_per_node 2 tests/support/mp_drafter_group_worker.py \
        --model TINY_HF_DIR --out DIR [--schedules 50]

One launch runs every scenario in turn on a tiny model (each rank writes
DIR/rank{R}.json), the group's loss and canary at a recipe's sampling settings
(T = 0.7, top-k 20, top-p 0.9):

- together: both replicas finished before either looks -> nothing trains, no averaging;
- uneven: replica 1 finishes only after replica 0 took 3 micro-steps -> replica 0
  trains, replica 1 does not, and both leave with replica 0's state bit for bit (its
  weight is 1); the policy's parameters and gradients are untouched; the canary's
  alpha against ``measure_alpha`` on the same responses;
- schedules: N windows with random finish delays and random micro-step times; after
  each, the full drafter + AdamW state is compared across ranks, and every micro-step
  records whether the last replica had already finished when it ended (at most one per
  window may: preemption within one micro-step);
  odd windows overlap the averaging with a stand-in for the policy update's
  collectives (``overlap_sync``) and complete it with ``finish_sync``;
- averaged: both replicas took local steps (2 and 1; DP >= 3 does this): the 2:1
  weighted average of weights and moments, the same bytes everywhere;
- failure: replica 0's loss is NaN -> its drafter is restored, speculation is off for
  the next rollout on both replicas (the engine then takes no speculative step);
- resume: the group's state saved and loaded into a fresh drafter + group;
- diverged: replica 1's state changed in one value -> the agreement step restores
  replica 0's bytes on both (and a second pass finds them equal).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--schedules", type=int, default=50)
    args = ap.parse_args()

    from megatron_tlt.config import DrafterGroupConfig
    from megatron_tlt.drafter_training.alpha import measure_alpha
    from megatron_tlt.drafter_training.group import default_store
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
    from megatron_tlt.rollout import SamplingParams

    from megatron_tlt.drafter_training.group import _agree, _word_sum

    from drafter_group_setup import identical_everywhere, make_group, tiny_engine, write_result

    env = tiny_engine(args.model)
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    model, arch, engine, prompts, responses = (env.model, env.arch, env.engine, env.prompts,
                                               env.responses)

    cfg = DrafterGroupConfig(lr=1e-3, lr_warmup_steps=0, max_steps_per_window=64,
                             batch_tokens=24, canary_sequences=2)
    store = default_store()
    res: dict = {}

    # at the recipe's rollout sampling (drafter_group_setup.RECIPE_SAMPLING): the
    # group's loss and canary run at these settings
    group = make_group(env, cfg, store)
    lc = group.trainer.loss_config
    res["loss"] = {"preset": cfg.loss, "temperature": lc.temperature, "top_k": lc.top_k,
                   "top_p": lc.top_p, "kl": lc.kl, "tv": lc.tv}
    policy_before = [p.detach().clone() for p in model.parameters()]

    def all_flats():
        flat = group._flat(create=True)
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, flat)
        return parts

    # ---- together: both finished before either looks
    group.announce()
    dist.barrier()
    before = group._flat(create=True).clone()
    rec = group.run_window(0, responses(0))
    res["together"] = {"steps": rec["steps"], "version": group.version,
                       "checksum": rec["checksum"], "pending": group._pending is not None,
                       "unchanged": bool(torch.equal(before, group._flat()))}

    # ---- uneven: replica 1 finishes after replica 0's 3rd micro-step
    local_after = {}

    def record(steps):
        if steps == 3:
            store.set("uneven/r0_three", "1")
        local_after["flat"] = group._flat().clone()

    before = group._flat(create=True).clone()
    if rank == 0:
        group.after_micro_step = record
    else:
        store.wait(["uneven/r0_three"])
    rec = group.run_window(1, responses(1))
    group.after_micro_step = None
    flats = all_flats()
    res["uneven"] = {
        "steps": rec["steps"], "identical": all(torch.equal(f, flats[0]) for f in flats),
        "changed": not torch.equal(before, group._flat()), "version": group.version,
        "equals_trainer": bool(torch.equal(flats[0], local_after["flat"]))
        if rank == 0 else None,
        "policy_untouched": all(torch.equal(a, b) for a, b in
                                zip(policy_before, model.parameters())),
        "policy_grads_none": all(p.grad is None for p in model.parameters()),
        "alpha": group.canary_alpha(), "train": rec["train"],
        "last_finisher": rec["last_finisher"]}
    # the canary is measure_alpha (depth 1, the recipe's settings) on the newest
    # buffered responses; at T=1 without truncation the value differs
    canary = [r.draft_sample() for r in group.buffer.sample(cfg.canary_sequences)]
    res["uneven"]["measured_alpha"] = measure_alpha(
        group.drafter, engine.runner, canary, temperature=0.7, top_k=20, top_p=0.9,
        depth=1).alpha[0]
    res["uneven"]["alpha_t1"] = measure_alpha(group.drafter, engine.runner, canary,
                                              temperature=1.0, depth=1).alpha[0]

    # ---- randomised schedules
    rng = random.Random(1000 + rank)
    sched = []
    for k in range(args.schedules):
        ends = []
        window = group.window

        def timed(steps, window=window, ends=ends):
            time.sleep(rng.uniform(0.0, 0.01))
            ends.append(group.signal.finished(window) >= group.dp_size)

        group.after_micro_step = timed
        group.overlap_sync = k % 2 == 1  # odd windows: the averaging behind an "update"
        time.sleep(rng.uniform(0.0, 0.05))
        rec = group.run_window(2 + k, responses(2 + k))
        pending = group._pending is not None
        if group.overlap_sync:  # the policy update's collectives run meanwhile
            dist.all_reduce(torch.ones(4096), group=ps.get_data_parallel_group())
            group.finish_sync()
        flats = all_flats()
        sched.append({"steps": rec["steps"], "overrun": sum(ends),
                      "identical": all(torch.equal(f, flats[0]) for f in flats),
                      "sync_wait": rec["sync_wait"], "last": rec["last_finisher"],
                      "overlap": group.overlap_sync, "pending": pending,
                      "checksum": group.last["checksum"],
                      "own_checksum": int(group.checksum()[0])})
    group.after_micro_step = None
    group.overlap_sync = False
    res["schedules"] = sched

    # ---- frozen (drafter_group.train=false): the same uneven finish, nothing trains,
    # the window still synchronises and the canary still measures
    import dataclasses

    group.cfg = dataclasses.replace(cfg, train=False)
    before = group._flat(create=True).clone()
    version = group.version
    if rank == 1:
        time.sleep(0.3)  # replica 0 has time to train, and must not
    rec = group.run_window(60, responses(60))
    flats = all_flats()
    res["frozen"] = {"steps": rec["steps"],
                     "unchanged": bool(torch.equal(before, group._flat())),
                     "identical": all(torch.equal(f, flats[0]) for f in flats),
                     "alpha": group.canary_alpha(), "version": group.version - version}
    group.cfg = cfg

    # ---- both trained (DP = 2 never does: the last finisher never trains; DP >= 3
    # does): 2 and 1 local steps on different data -> the 2:1 weighted average
    group.overlap_sync = True
    base = group.trainer.step_count
    batches = group.buffer.batches(cfg.batch_tokens, seed=rank)
    for _ in range(2 - rank):
        group.trainer.step(next(batches))
    mine = group._flat(create=True)
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    version = group.version
    group._synchronise(base, None, mine.clone())
    pending = group._pending is not None
    group.finish_sync(record=False)
    flats = all_flats()
    res["averaged"] = {
        "pending": pending, "version": group.version - version,
        "step_count": group.trainer.step_count - base,
        "identical": all(torch.equal(f, flats[0]) for f in flats),
        "weighted": bool(torch.allclose(flats[0], both[0] * (2 / 3) + both[1] * (1 / 3),
                                        rtol=1e-6, atol=1e-7)),
        "adam_step": all(float(group.trainer.opt.state[p]["step"]) ==
                         group.trainer.step_count for p in group.trainer.params)}
    group.overlap_sync = False

    # ---- failure: replica 0's loss is NaN
    real_loss = group.trainer.loss

    def nan_loss(batch):
        loss, parts = real_loss(batch)
        return loss * float("nan"), dict(parts, loss=float("nan"))

    if rank == 0:
        group.trainer.loss = nan_loss
    else:
        time.sleep(0.5)
    before = group._flat(create=True).clone()
    version = group.version
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = group.run_window(1000, responses(1000))
    group.trainer.loss = real_loss
    off = group.speculation_off
    with group.speculation_guard(engine):
        engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    guarded_spec_steps = engine.last_stats.spec.steps
    engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    res["failure"] = {"failure": rec["failure"], "speculation_off": off,
                      "restored": bool(torch.equal(before, group._flat())),
                      "version_unchanged": group.version == version,
                      "warned": any("failed to train" in str(w.message) for w in caught),
                      "guarded_spec_steps": guarded_spec_steps,
                      "after_spec_steps": engine.last_stats.spec.steps,
                      "off_after_guard": group.speculation_off}

    # ---- resume: state round trip into a fresh drafter and group
    state = {"drafter": group.drafter.own_state(), "group": group.state_dict()}
    path = Path(args.out) / f"state{rank}.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=False)
    fresh = EagleDrafter(DrafterConfig.for_target(arch), arch)
    fresh.reset_parameters(seed=99)
    fresh.load_own_state(loaded["drafter"])
    g2 = make_group(env, cfg, store, fresh, sampling=None)
    g2.load_state_dict(loaded["group"])
    res["resume"] = {"same": bool(torch.equal(g2._flat(), group._flat())),
                     "step_count": g2.trainer.step_count == group.trainer.step_count,
                     "version": g2.version == group.version,
                     "checksum": int(g2.checksum()[0]) == int(group.checksum()[0])}

    # ---- diverged: replica 1's state differs in one value -> the agreement step (the
    # check after every averaging, and over a replica's model-parallel ranks) gives every
    # replica replica 0's bytes and the same checksum; a second pass finds nothing to do
    tensors = group._tensors()
    if rank == 1:
        with torch.no_grad():
            tensors[0].view(-1)[0] += 1.0
    before = group._flat()
    healed, cs = _agree(tensors, ps.get_data_parallel_group(), 2, flat=before)
    after = group._flat()
    again, cs_again = _agree(tensors, ps.get_data_parallel_group(), 2)
    res["diverged"] = {"differed": not identical_everywhere(before), "healed": healed,
                       "identical": identical_everywhere(after),
                       "own_kept": bool(torch.equal(before, after)),
                       "checksum": int(cs[0]), "checksum_of_state": int(_word_sum(after)[0]),
                       "healed_again": again, "checksum_again": int(cs_again[0])}

    write_result(args.out, res)


if __name__ == "__main__":
    main()
