"""Worker for tests/models/test_export.py: one GRPO update, then the run's exports.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_export_worker.py --out DIR \
        model.hf_path=POLICY parallel.tensor_model_parallel_size=2 ...

After an update on the fixed batch of tests/support/mp_rl_worker.py (and, with a drafter, a
perturbation of the drafter so it differs from the file it was loaded from) the worker
writes DIR/ckpt (a run checkpoint, as checkpoint.save does), DIR/live_hf (the
end-of-run export, as checkpoint.export_hf does) and DIR/trained.pt: the trained
model's full-vocabulary logits on probe token ids and the drafter's tensors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt.config import load_config
from mp_rl_worker import fixed_samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    cfg = load_config([], args.overrides)
    from megatron_tlt import checkpoint
    from megatron_tlt.launch import setup
    from megatron_tlt.checkpoint.export import export_trained
    from megatron_tlt.models.inference import forward_local_logits, gather_logits
    from megatron_tlt.runtime_env import silence_expected_warnings
    from megatron_tlt.rl.trainer import Trainer

    silence_expected_warnings()
    session = setup(cfg)
    trainer = Trainer(cfg, session)
    g = cfg.grpo
    mine = set(trainer.replica_prompts(g.prompts_per_step))
    samples = [s for s in fixed_samples(trainer, g.prompts_per_step, g.group_size)
               if s.prompt_index in mine]
    trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    trainer._update(samples, [True] * len(samples), fused_old=False)
    drafter = trainer.state.drafter
    if drafter is not None:  # the same noise on every rank: replicated tensors stay equal
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p))
    trainer.state.step = 1
    checkpoint.save(trainer.state, out / "ckpt", trainer.layout)
    export_trained(trainer.policy.module, drafter, trainer.layout, session.arch,
                   session.source, out / "live_hf", step=1)
    ids = torch.randint(0, session.arch.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        local = forward_local_logits(trainer.policy.module, ids.to(trainer.policy.device))
        logits = gather_logits(local, session.arch) if local is not None else None
    drafter_state = drafter.own_state() if drafter is not None else None
    lay = trainer.layout
    if logits is not None and lay.tp_rank == 0 and lay.dp_rank == 0:
        torch.save({"ids": ids, "logits": logits.float().cpu(), "drafter": drafter_state},
                   out / "trained.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
