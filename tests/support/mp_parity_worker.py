"""torchrun worker for tests/models/test_multiproc.py: parity of megatron_tlt's model at TP/PP > 1.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_parity_worker.py \
        --models DIR --layout 2x1 --layout 1x2 --ckpt-root DIR --out result.json

For each --layout TPxPP or TPxPPxEP in turn (the model-parallel groups re-created in the
same process group, so one launch checks several layouts) and every tiny model under
--models (at EP > 1: every mixture-of-experts model) it
loads the model (from the HF folder, and from the megatron checkpoint under --ckpt-root)
at that TP/PP, runs a forward pass and compares logits, log-probs and greedy generation
with transformers. At EP > 1 also the paged KV cache against fixed slots on
paged_cases.PAGED_MOE_MODEL (each EP rank its own requests, the group decoding their
union). Rank 0 writes all ranks' results, each tagged with its layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt.models import load_model
from megatron_tlt.models.inference import forward_local_logits, gather_logits, token_logprobs
from megatron_tlt.parallel import initialize_model_parallel, layout
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.runtime_env import init_distributed
from paged_cases import PAGED_MOE_MODEL, paged_case_names, run_paged_cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--ckpt-root", required=True)
    parser.add_argument("--layout", action="append", required=True, metavar="TPxPP[xEP]")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    plat = init_distributed()
    results = []
    for spec in args.layout:
        tp, pp, ep = (list(map(int, spec.split("x"))) + [1])[:3]
        initialize_model_parallel(tp, pp, ep=ep)
        results += [dict(r, layout=spec) for r in _parity(args, plat, AutoModelForCausalLM)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if plat.rank == 0:
        Path(args.out).write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.destroy_process_group()


def _parity(args, plat, AutoModelForCausalLM) -> list[dict]:
    """This rank's results for every model at the current layout."""
    lay = layout()
    results = []
    for folder in sorted(Path(args.models).iterdir()):
        if lay.ep_size > 1 and "experts" not in (folder / "config.json").read_text():
            continue
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
            uneven = paged = None
            if lay.ep_size > 1:  # EP ranks with different token counts (all-to-all)
                mine = ids[: 1 + lay.ep_rank, : 6 + 3 * lay.ep_rank]
                uneven = (gather_logits(forward_local_logits(model, mine), arch)
                          - hf(mine).logits).abs().max().item()
                if folder.name == PAGED_MOE_MODEL:  # rollout.kv_cache=paged vs slots
                    paged = run_paged_cases(
                        model, arch, paged_case_names(drafter=False, self_drafter=True),
                        share=(lay.ep_rank, lay.ep_size))
        if outputs:
            (logits, lp), (ck_logits, ck_lp) = outputs.values()
            results.append(dict(
                model=folder.name, rank=plat.rank, tp_rank=lay.tp_rank, pp_rank=lay.pp_rank,
                logits_max_diff=(logits - ref).abs().max().item(),
                logprobs_max_diff=(lp.double() - ref_lp).abs().max().item(),
                argmax_equal=bool(torch.equal(logits.argmax(-1), ref.argmax(-1))),
                checkpoint_equal=bool(torch.equal(logits, ck_logits) and torch.equal(lp, ck_lp)),
                greedy_equal=all(g == ref_gen for g in generations),
                ep_rank=lay.ep_rank, uneven_max_diff=uneven, paged=paged,
            ))
    return results


if __name__ == "__main__":
    main()
