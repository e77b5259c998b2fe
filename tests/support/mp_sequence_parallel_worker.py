"""Worker for tests/rl/test_memory_controls.py (gloo) and tests_gpu (NCCL, 2 GPUs):
one forward/backward of a tiny model at TP=2 with sequence parallelism off and on, and
with full recomputation on top, on the same batch.

    torchrun --nproc_per_node 2 mp_sequence_parallel_worker.py --model DIR --out OUT \
        [--dtype float32|bfloat16]

Writes OUT/rank{R}.json: per variant the loss (sum of the tempered log-probs of the
targets at the masked positions, through the chunked loss path), the gradient norm
over the TP group, and whether megatron-core's config had sequence parallelism on. The
sequence length (31) is odd: the forward pads it to a multiple of TP under SP.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VARIANTS = {"plain": ("none", False), "sp": ("none", True), "sp_full": ("full", True),
            "sp_selective": ("selective", True)}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_tlt import collectives
    from megatron_tlt.models import MemoryControls, load_model
    from megatron_tlt.models.inference import forward_local_logits
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rl.token_stats import token_stats
    from megatron_tlt.runtime_env import init_distributed

    plat = init_distributed()
    layout = initialize_model_parallel(2, 1, seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 251, (3, 31), generator=gen).to(plat.device)
    targets = torch.roll(ids, -1, dims=1)
    mask = torch.zeros(3, 31, device=plat.device)
    mask[:, 5:30] = 1
    results = {}
    for name, (granularity, sp) in VARIANTS.items():
        model, arch = load_model(args.model, device=plat.device, dtype=args.dtype,
                                 impl="local", memory=MemoryControls(
                                     granularity, "uniform", 2, sequence_parallel=sp))
        model.train()
        logits = forward_local_logits(model, ids)
        logp, _ = token_stats(logits, targets, mask, vocab_size=arch.vocab_size,
                              temperature=0.8, chunk_tokens=16)
        loss = (logp * mask).sum()
        loss.backward()
        group = ps.get_tensor_model_parallel_group()
        sq = torch.zeros(1, dtype=torch.float64, device=collectives.device_of(group))
        for p in model.parameters():
            if p.grad is None:
                continue
            g = p.grad.detach().double().pow(2).sum()
            # sharded parameters: each rank's slice; replicated ones (norms): once.
            # Under SP the norms' gradients are partial sums over the sequence shards
            # until megatron-core's finalize_model_grads all-reduces them: do that here.
            if getattr(p, "tensor_model_parallel", False):
                sq += g.to(sq.device)
            else:
                full = p.grad.detach().clone()
                if model.config.sequence_parallel:
                    collectives.all_reduce(full, group=group)
                if layout.tp_rank == 0:
                    sq += full.double().pow(2).sum().to(sq.device)
        collectives.all_reduce(sq, group=group)
        results[name] = dict(loss=float(loss), grad_norm=float(sq.sqrt()),
                             sequence_parallel=bool(model.config.sequence_parallel),
                             recompute=model.config.recompute_granularity)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{layout.tp_rank}.json").write_text(json.dumps(results))
