"""torchrun worker for tests/rollout/test_rollout_tp.py and test_rollout_pp.py: the rollout
engine at TP>1 or PP>1.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_rollout_worker.py \
        --models DIR --tp 2 --out result.json     # or --tp 1 --pp 2

For every tiny model under --models it runs the engine greedily and with sampling on
the prompts of tests/rollout/test_rollout_tp.py and writes every rank's tokens, log-probs and
hidden states (rank 0 writes the file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megatron_tlt.models import load_model
from megatron_tlt.parallel import initialize_model_parallel, layout
from megatron_tlt.rollout import RolloutEngine
from megatron_tlt.runtime_env import apply_cpu_redirection, init_distributed
from rollout_cases import (CASES, COUPLED_CASES, COUPLED_PARAMS, SPEC_CASES,
                           SPEC_MODEL, case_prompts, spec_config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--drafter", default=None,
                        help="also run speculative decoding (SPEC_CASES) on the model "
                             "this drafter was made for (SPEC_MODEL)")
    args = parser.parse_args()

    plat = init_distributed()
    initialize_model_parallel(args.tp, args.pp)
    apply_cpu_redirection()
    results = {}
    for folder in sorted(Path(args.models).iterdir()):
        model, arch = load_model(folder, device=plat.device, dtype="float32")
        engine = RolloutEngine(model, None, arch=arch, eos_token_ids=[])
        for case, params in CASES.items():
            outs = engine.generate(case_prompts(), params)
            results[f"{folder.name}/{case}"] = [
                dict(tokens=o.token_ids, logprobs=o.logprobs,
                     hidden=o.hidden_states.tolist() if o.hidden_states is not None else None)
                for o in outs]
        if args.drafter and folder.name == SPEC_MODEL:
            from megatron_tlt.models.drafter import load_drafter

            drafter = load_drafter(args.drafter, arch)
            for case, (strategy, params) in SPEC_CASES.items():
                spec = RolloutEngine(model, None, spec_config(strategy), arch=arch,
                                     eos_token_ids=[], drafter=drafter)
                outs = spec.generate(case_prompts(), params)
                results[f"{folder.name}/{case}"] = [
                    dict(tokens=o.token_ids, logprobs=o.logprobs) for o in outs]
            for case, strategy in COUPLED_CASES.items():
                eng = RolloutEngine(model, None, spec_config(strategy, "coupled"), arch=arch,
                                    eos_token_ids=[], drafter=drafter if strategy else None)
                outs = eng.generate(case_prompts(), COUPLED_PARAMS)
                results[f"{folder.name}/{case}"] = [
                    dict(tokens=o.token_ids, logprobs=o.logprobs) for o in outs]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(tp_rank=layout().tp_rank, pp_rank=layout().pp_rank, results=results))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
