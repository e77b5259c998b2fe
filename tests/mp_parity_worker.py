"""torchrun worker for tests/test_multiproc.py: parity of megatron_tlt's model at TP/PP > 1.

    torchrun --standalone --nproc_per_node 2 tests/mp_parity_worker.py \
        --models DIR --tp 2 --pp 1 --ckpt-root DIR --out result.json

For every tiny model under --models it loads the model (from the HF folder, and from the
megatron checkpoint under --ckpt-root) at the given TP/PP, runs a forward pass and
compares logits, log-probs and greedy generation with transformers. Rank 0 writes all ranks' results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tlt.models import load_model  # noqa: E402
from megatron_tlt.models.inference import (forward_local_logits, gather_logits,  # noqa: E402
                                           token_logprobs)
from megatron_tlt.parallel import initialize_model_parallel, layout  # noqa: E402
from megatron_tlt.platform import init_distributed  # noqa: E402
from megatron_tlt.rollout import RolloutEngine, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--ckpt-root", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    plat = init_distributed()
    initialize_model_parallel(args.tp, args.pp)
    lay = layout()
    results = []
    for folder in sorted(Path(args.models).iterdir()):
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.randint(0, hf.config.vocab_size, (3, 13),
                            generator=torch.Generator().manual_seed(1))
        targets = torch.roll(ids, -1, dims=1)
        with torch.no_grad():
            ref_gen = hf.generate(ids[:1, :5], max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False)[0, 5:].tolist()
            ref = hf(ids).logits
            ref_lp = torch.log_softmax(ref.double(), -1).gather(-1, targets[..., None])[..., 0]
            outputs, generations = {}, []
            for source in (folder, Path(args.ckpt_root) / folder.name):
                model, arch = load_model(source, device=plat.device, dtype="float32")
                local = forward_local_logits(model, ids)
                engine = RolloutEngine(model, None, arch=arch, eos_token_ids=[])
                generations.append(engine.generate([ids[0, :5].tolist()], SamplingParams(
                    temperature=0.0, max_new_tokens=8))[0].token_ids)
                if local is not None:
                    outputs[source.parent.name] = (gather_logits(local, arch),
                                                   token_logprobs(local, targets, arch))
        if outputs:
            (logits, lp), (ck_logits, ck_lp) = outputs.values()
            results.append(dict(
                model=folder.name, rank=plat.rank, tp_rank=lay.tp_rank, pp_rank=lay.pp_rank,
                logits_max_diff=(logits - ref).abs().max().item(),
                logprobs_max_diff=(lp.double() - ref_lp).abs().max().item(),
                argmax_equal=bool(torch.equal(logits.argmax(-1), ref.argmax(-1))),
                checkpoint_equal=bool(torch.equal(logits, ck_logits) and torch.equal(lp, ck_lp)),
                greedy_equal=all(g == ref_gen for g in generations),
            ))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if plat.rank == 0:
        Path(args.out).write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
