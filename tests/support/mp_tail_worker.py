"""Worker for tests/rl/test_tail_wait.py: a rollout tail longer than the collective timeout.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_tail_worker.py --out DIR \
        --tail 10 --timeout 5 model.hf_path=POLICY parallel.collective_timeout_s=60 \
        drafter_group.enable=true drafter_group.max_steps_per_window=1 ...

The set-up runs with the config's ``parallel.collective_timeout_s`` (its groups'
timeouts are recorded: megatron-core's data-parallel group must have it too); then every
process group's timeout is lowered to ``--timeout`` seconds (a set-up under a loaded
machine may start its ranks further apart than that). Replica 1's rollout starts
``--tail`` seconds late in every step, so replica 0 reaches the step barrier that long
before it. Three steps on the same trainer:

1. with the drafter group (replica 0 stops training after its one micro-step and waits
   for replica 1 before the group's synchronisation);
2. without it (the trainer's own step barrier);
3. with the trainer's store wait removed: the barrier's all-gather is entered at once
   and must fail with the process group's timeout (what the store wait prevents).

Each rank writes DIR/rank{R}.json: the first two steps' metrics (the replicas' finish
times, the drafter's steps) and the third step's error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tail", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.trainer import Trainer
    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    cfg = load_config([], args.overrides)
    trainer = Trainer(cfg, setup(cfg))
    c10d = dist.distributed_c10d
    cpu = torch.device("cpu")
    res: dict = {"setup_timeout_s": {
        name: g._get_backend(cpu).options._timeout.total_seconds()
        for name, g in (("world", dist.group.WORLD), ("dp", trainer.dp_group))}}
    dist.barrier()  # every rank set up (and every group connected) before the short timeout
    for g in list(c10d._world.pg_map):
        c10d._set_pg_timeout(datetime.timedelta(seconds=args.timeout), g)
    generate = trainer.generate  # the rollout's generation: the trainer's seam
    if trainer.layout.dp_rank == 1:
        def late(*a, **k):
            time.sleep(args.tail)
            return generate(*a, **k)
        trainer.generate = late

    res["steps"] = []
    for step in range(2):
        if step == 1:  # the drafter group off: the trainer's own barrier
            from megatron_tlt.rl.online_drafter import NoDrafterTraining

            trainer.idle_window_hooks.clear()
            trainer.online = NoDrafterTraining()  # the part's no-op form
        m = trainer.train_step(step)
        res["steps"].append({"replica_finish": m["timeline"]["replica_finish"],
                             "barrier_wait": m["timing"]["barrier_wait"],
                             "drafter_steps": m.get("drafter/steps_per_replica"),
                             "drafter_identical": m.get("drafter/identical")})
    # without the store wait the barrier's collective waits for the tail itself
    trainer.points.wait = lambda key: 0.0
    t0 = time.monotonic()
    try:
        trainer.train_step(2)
        res["unguarded"] = None
    except Exception as e:  # noqa: BLE001 - the timeout is the expected outcome
        res["unguarded"] = {"type": type(e).__name__, "message": str(e)[:500],
                            "seconds": time.monotonic() - t0}
    Path(args.out, f"rank{trainer.rank}.json").write_text(json.dumps(res))
    os._exit(0)  # the process group is broken after the timeout: no orderly shutdown


if __name__ == "__main__":
    main()
