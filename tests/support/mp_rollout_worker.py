"""torchrun worker for tests/rollout/test_rollout_tp.py and test_rollout_pp.py: the rollout
engine at TP>1 or PP>1.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_rollout_worker.py \
        --models DIR --tp 2 --out result.json     # or --tp 1 --pp 2

For every tiny model under --models it runs the engine greedily and with sampling on
the prompts of tests/rollout/test_rollout_tp.py and writes every rank's tokens, log-probs and
hidden states (rank 0 writes the file); at PP>1 in both rollout.pipeline_mode values,
and a check that the gathered mode's weight copies follow an optimizer step. With
--drafter also speculation, coupled sampling, the shared-prefill group cases, the paged
KV cache against fixed slots (paged_cases.py) and (the gathered mode) speculation
through the fixed-shape steps that CUDA graphs capture.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megatron_tlt.config import RolloutConfig
from megatron_tlt.models import load_model
from megatron_tlt.parallel import initialize_model_parallel, layout
from megatron_tlt.rollout import RolloutEngine
from megatron_tlt.runtime_env import apply_cpu_redirection, init_distributed
from paged_cases import paged_case_names, run_paged_cases
from rollout_cases import (CASES, COUPLED_CASES, COUPLED_PARAMS, GROUP_CASES, SPEC_CASES,
                           SPEC_MODEL, case_engine, case_prompts, group_prompts,
                           group_request_seeds, spec_config)


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
    # at PP > 1 both rollout.pipeline_mode values; results are keyed "mode/model/case"
    modes = ["gathered", "pipelined"] if args.pp > 1 else ["gathered"]
    results, sync, static_keys = {}, None, {}
    for folder in sorted(Path(args.models).iterdir()):
        model, arch = load_model(folder, device=plat.device, dtype="float32")
        for mode in modes:
            key = f"{mode}/{folder.name}"
            engine = RolloutEngine(model, None, RolloutConfig(pipeline_mode=mode), arch=arch,
                                   eos_token_ids=[])
            for case, params in CASES.items():
                outs = engine.generate(case_prompts(), params)
                results[f"{key}/{case}"] = [
                    dict(tokens=o.token_ids, logprobs=o.logprobs,
                         hidden=o.hidden_states.tolist() if o.hidden_states is not None
                         else None)
                    for o in outs]
            if not (args.drafter and folder.name == SPEC_MODEL):
                continue
            from megatron_tlt.models.drafter import load_drafter

            drafter = load_drafter(args.drafter, arch)
            for case, (strategy, params) in SPEC_CASES.items():
                spec = RolloutEngine(model, None, spec_config(strategy, mode=mode), arch=arch,
                                     eos_token_ids=[], drafter=drafter)
                outs = spec.generate(case_prompts(), params)
                results[f"{key}/{case}"] = [
                    dict(tokens=o.token_ids, logprobs=o.logprobs) for o in outs]
                results[f"{key}/{case}/spec_steps"] = spec.last_stats.spec.steps
            for case, strategy in COUPLED_CASES.items():
                eng = RolloutEngine(model, None, spec_config(strategy, "coupled", mode),
                                    arch=arch, eos_token_ids=[],
                                    drafter=drafter if strategy else None)
                outs = eng.generate(case_prompts(), COUPLED_PARAMS)
                results[f"{key}/{case}"] = [
                    dict(tokens=o.token_ids, logprobs=o.logprobs) for o in outs]
            _group_cases(results, key, model, arch, drafter, mode, args.pp)
            # rollout.kv_cache=paged against slots, "mode/model/paged" (self-drafter: PP 1)
            results[f"{key}/paged"] = run_paged_cases(
                model, arch, paged_case_names(drafter=True, self_drafter=args.pp == 1),
                mode=mode, drafter=drafter)
            if mode == "gathered":
                _static_cases(results, static_keys, key, model, arch, drafter)
        if args.pp > 1 and folder.name == SPEC_MODEL:
            sync = _copies_follow_updates(model, arch)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(tp_rank=layout().tp_rank, pp_rank=layout().pp_rank,
                                          results=results, sync=sync,
                                          static_keys=static_keys))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


# speculative cases run again through the fixed-shape steps CUDA graphs capture
# (rollout/cuda_graphs.py, run eagerly here), on the torch path both times
STATIC_CASES = ("spec_greedy_tree", "spec_sampled_chain")


def _static_cases(results: dict, static_keys: dict, key: str, model, arch, drafter
                  ) -> None:
    """STATIC_CASES and coupled tree speculation eagerly and through the static steps
    (``RolloutEngine.enable_graphs(capture=False)``), keyed "gathered/model/case/eager"
    and ".../static": at TP = 2 the steps' all-reduces run inside them, at PP = 2 each
    stage decodes its share through its own steps. ``static_keys``: this rank's step
    keys per case (a stage's share has its own batch sizes)."""
    runs = {c: (SPEC_CASES[c][0], "standard", SPEC_CASES[c][1]) for c in STATIC_CASES}
    runs["coupled_tree"] = (COUPLED_CASES["coupled_tree"], "coupled", COUPLED_PARAMS)
    for case, (strategy, sampling, params) in runs.items():
        for how in ("eager", "static"):
            cfg = spec_config(strategy, sampling)
            cfg.cpu_kernels = "false"
            eng = RolloutEngine(model, None, cfg, arch=arch, eos_token_ids=[],
                                drafter=drafter)
            if how == "static":
                eng.enable_graphs(capture=False)
            outs = eng.generate(case_prompts(), params)
            results[f"{key}/{case}/{how}"] = [dict(tokens=o.token_ids, logprobs=o.logprobs)
                                              for o in outs]
            if how == "static":
                static_keys[f"{key}/{case}"] = sorted(map(list, eng.graphs.graphs))


def _group_cases(results: dict, key: str, model, arch, drafter, mode: str, pp: int) -> None:
    """GROUP_CASES with rollout.share_prefill off and on: outputs and prefill counts,
    keyed "mode/model/case/share" (the self-drafter at PP = 1 only)."""

    for case, (strategy, kind, sampling, params) in GROUP_CASES.items():
        if kind == "self" and pp > 1:
            continue
        for share in (False, True):
            cfg = RolloutConfig(share_prefill=share, pipeline_mode=mode,
                                sampling_mode=sampling)
            eng = case_engine(model, arch, cfg, kind, strategy, drafter)
            outs = eng.generate(group_prompts(), params, request_seeds=group_request_seeds())
            st = eng.last_stats
            results[f"{key}/{case}/{share}"] = dict(
                outputs=[dict(tokens=o.token_ids, logprobs=o.logprobs,
                              hidden=o.hidden_states.tolist()
                              if o.hidden_states is not None else None) for o in outs],
                prefill_tokens=st.prefill_tokens, shared_rows=st.prefill_shared_rows,
                spec_steps=st.spec.steps if st.spec is not None else 0)


def _copies_follow_updates(model, arch) -> dict:
    """rollout.pipeline_mode=gathered after an optimizer step on the trained model: the
    runner's copies of every stage's layers equal their owners' updated parameters, and
    its tokens equal the pipelined engine's (which reads the parameters in place)."""
    import torch

    gathered = RolloutEngine(model, None, RolloutConfig(pipeline_mode="gathered"),
                             arch=arch, eos_token_ids=[])
    pipelined = RolloutEngine(model, None, RolloutConfig(pipeline_mode="pipelined"),
                              arch=arch, eos_token_ids=[])
    params = CASES["greedy"]
    before = gathered.generate(case_prompts(), params)
    gathered.release_memory()  # as the trainer does before the update: the layer copies go
    held_after_release = gathered.runner.held_copy_bytes
    vocab = {id(gathered.runner.embed_w), id(gathered.runner.output_w)}
    vocab_copy_bytes = sum(t.numel() * t.element_size() for t, _, mine, _ in
                           gathered.runner._copies if not mine and id(t) in vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():  # (a tied output layer gets its embedding's update)
        g = torch.Generator().manual_seed(p.numel())
        p.grad = torch.randn(p.shape, generator=g) * p.detach().abs().mean()
    opt.step()
    after = gathered.generate(case_prompts(), params)
    ref = pipelined.generate(case_prompts(), params)
    # every stage's own layers as its owner holds them, against this rank's copies
    own = [[t.clone() for t in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w, lw.ln1, lw.ln2)]
           for lw in pipelined.runner.layers]
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, own)
    owners = [layer for stage in stages for layer in stage]
    copies = [[lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w, lw.ln1, lw.ln2]
              for lw in gathered.runner.layers]
    return dict(layers=len(copies), owners=len(owners),
                copies_equal=len(copies) == len(owners) and all(
                    torch.equal(a, b) for ca, cb in zip(copies, owners)
                    for a, b in zip(ca, cb)),
                tokens_changed=[o.token_ids for o in before] != [o.token_ids for o in after],
                tokens_equal_pipelined=[o.token_ids for o in after] == [o.token_ids
                                                                        for o in ref],
                copy_bytes=gathered.runner.copy_bytes,
                held_after_release=held_after_release, vocab_copy_bytes=vocab_copy_bytes,
                held_after_generate=gathered.runner.held_copy_bytes)


if __name__ == "__main__":
    main()
