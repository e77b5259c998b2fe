"""Worker for tests/rl/test_token_stats.py: the chunked log-probs / entropies at TP=2.

    torchrun --nproc_per_node 2 mp_token_stats_worker.py --out DIR

Every rank builds the same logits, scores its vocabulary slice with ``token_stats``
(temperature, entropy bonus, 3-token chunks, padding columns on the last rank) and
compares values and its slice of the gradient with plain torch on the full vocabulary;
writes DIR/rank{R}.json with the largest difference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rl.token_stats import token_stats
    from megatron_tlt.runtime_env import apply_cpu_redirection, init_distributed
    from token_stats_cases import VOCAB, case

    init_distributed()
    apply_cpu_redirection()
    layout = initialize_model_parallel(2, 1, seed=1)
    rank = layout.tp_rank
    T = 0.7
    logits, targets, mask, w_logp, w_ent = case()

    full = logits.clone().requires_grad_(True)
    z = full[..., :VOCAB] / T
    logp_all = torch.log_softmax(z, dim=-1)
    logp_ref = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    ent_ref = -(logp_all.exp() * logp_all).sum(-1) * mask
    ((w_logp * logp_ref).sum() + (w_ent * ent_ref).sum()).backward()

    width = logits.shape[-1] // 2
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    logp, ent = token_stats(local, targets, mask, vocab_size=VOCAB, temperature=T,
                            chunk_tokens=3, entropy_grad=True)
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    diffs = [(logp - logp_ref.detach()).abs().max(), (ent - ent_ref.detach()).abs().max(),
             (local.grad - full.grad[..., rank * width:(rank + 1) * width]).abs().max()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "max_abs_diff": float(max(diffs)),
         "grad_norm": float(local.grad.norm())}))
