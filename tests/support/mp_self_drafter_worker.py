"""torchrun worker for tests/rollout/test_self_drafter_mp.py: the self-drafter on two
processes.

    torchrun --standalone --nproc_per_node 2 tests/support/mp_self_drafter_worker.py \
        --model DIR --tp 2 --out DIR     # or --tp 1: two data-parallel replicas

``--tp 2``: each rank quantizes its own shards; greedy chain and tree and coupled
speculation with the copy (and with a draft-vocabulary head) give the tokens of plain
decoding, on both ranks. ``--tp 1``: the two ranks are replicas of one policy running
with different thread counts; after the same in-place update both re-quantize, and
their copies are bit-identical (hashes of every int8 matrix and scale). ``--pp 2``
(rollout.pipeline_mode=gathered): each stage quantizes its gathered copy of the whole
model and decodes its share of the prompts; greedy (int8 and FP8 copies) and coupled
outputs with the copy are plain decoding's, the stages' copies are bit-identical before and after an update of
the stages' own weights, and the pipelined mode refuses the self-drafter. Every rank
writes ``out/rank{R}.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.parallel import initialize_model_parallel
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative.quantize import quantize_int8
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from megatron_tlt.runtime_env import apply_cpu_redirection, init_distributed
from rollout_cases import case_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
COUPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=9)


def _engine(model, arch, strategy, mode="standard", drafter=None, pipeline="gathered"):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=64)
    eng = RolloutEngine(model, None, RolloutConfig(sampling_mode=mode, speculative=sc,
                                                   pipeline_mode=pipeline),
                        arch=arch, eos_token_ids=[])
    if drafter is not None:
        eng.attach_drafter(drafter)
    return eng


def _copy_hash(draft) -> str:
    h = hashlib.sha256()
    for w in draft.quant_weights():
        h.update(w.int8_values().numpy().tobytes())
        h.update(w.scale.numpy().tobytes())
    for lw in draft.layers:
        h.update(lw.ln1.numpy().tobytes())
        h.update(lw.ln2.numpy().tobytes())
    h.update(draft.final_norm.numpy().tobytes())
    return h.hexdigest()


def _pp2(model, arch, prompts) -> dict:
    """PP = 2, gathered: the copy of the whole model on each stage."""
    res: dict = {}
    plain = _engine(model, arch, "4_1_4")
    res["plain"] = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for case, strategy, drafter in (("chain", "4_1_4", SelfDrafter()),
                                    ("tree", "3_3_6", SelfDrafter()),
                                    ("chain_fp8", "4_1_4", SelfDrafter(format="fp8"))):
        eng = _engine(model, arch, strategy, drafter=drafter)
        res[case] = [o.token_ids for o in eng.generate(prompts, GREEDY)]
        res[case + "/steps"] = eng.last_stats.spec.steps
    res["coupled_plain"] = [o.token_ids for o in _engine(model, arch, "3_1_3", "coupled")
                            .generate(prompts, COUPLED)]
    eng = _engine(model, arch, "3_2_5", "coupled", SelfDrafter())
    res["coupled_tree"] = [o.token_ids for o in eng.generate(prompts, COUPLED)]
    res["coupled_steps"] = eng.last_stats.spec.steps
    # the copy is the whole gathered model quantized, the same on both stages
    draft, runner = eng.spec.draft, eng.runner
    res["layers"] = [len(draft.layers), len(runner.layers), arch.num_layers]
    res["before"] = _copy_hash(draft)
    # an update of each stage's own weights (a tied output layer, the last stage's copy
    # of the embedding, gets the embedding's update), then the next rollout: the copy
    # follows on both stages, bit-identically
    eng.release_memory()  # as the trainer does: the gathered layer copies go
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
                p.numel())))
    res["coupled_after"] = [o.token_ids for o in eng.generate(prompts, COUPLED)]
    res["coupled_plain_after"] = [o.token_ids for o in _engine(model, arch, "3_1_3",
                                                               "coupled").generate(
        prompts, COUPLED)]
    res["after"] = _copy_hash(draft)
    res["requantized"] = all(
        torch.equal(getattr(m, n).int8_values(), quantize_int8(getattr(lw, n)).q)
        for m, lw in zip(draft.layers, runner.layers)
        for n in ("qkv_w", "proj_w", "fc1_w", "fc2_w")) and torch.equal(
        draft.output_w.int8_values(), quantize_int8(runner.output_w).q)
    # attached while the gathered copies are released: quantized at the next generate
    eng.release_memory()
    eng.attach_drafter(SelfDrafter())
    res["deferred_layers"] = len(eng.spec.draft.layers)
    res["deferred"] = [o.token_ids for o in eng.generate(prompts, COUPLED)]
    res["deferred_hash"] = _copy_hash(eng.spec.draft)
    try:  # stage to stage: refused
        _engine(model, arch, "3_1_3", drafter=SelfDrafter(), pipeline="pipelined")
        res["pipelined_error"] = None
    except ValueError as e:
        res["pipelined_error"] = str(e)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed()
    initialize_model_parallel(args.tp, args.pp)
    apply_cpu_redirection()
    rank = torch.distributed.get_rank()
    model, arch = load_model(args.model, device=torch.device("cpu"), dtype="float32")
    res: dict = {}
    prompts = case_prompts()
    if args.pp == 2:
        res = _pp2(model, arch, prompts)
    elif args.tp == 2:
        plain = _engine(model, arch, "4_1_4").generate(prompts, GREEDY)
        res["plain"] = [o.token_ids for o in plain]
        ids = torch.arange(0, arch.vocab_size, 3)
        for case, strategy, drafter in (("chain", "4_1_4", SelfDrafter()),
                                        ("tree", "3_3_6", SelfDrafter()),
                                        ("chain_vocab", "3_1_3", SelfDrafter(draft_vocab=ids))):
            eng = _engine(model, arch, strategy, drafter=drafter)
            res[case] = [o.token_ids for o in eng.generate(prompts, GREEDY)]
            res[case + "/steps"] = eng.last_stats.spec.steps
            # this rank's copy is its own shards quantized
            d, t = eng.spec.draft, eng.runner
            res[case + "/shards"] = all(
                torch.equal(getattr(m, n).int8_values(), quantize_int8(getattr(lw, n)).q)
                for m, lw in zip(d.layers, t.layers)
                for n in ("qkv_w", "proj_w", "fc1_w", "fc2_w"))
        res["coupled_plain"] = [o.token_ids for o in _engine(model, arch, "3_1_3", "coupled")
                                .generate(prompts, COUPLED)]
        eng = _engine(model, arch, "3_2_5", "coupled", SelfDrafter())
        res["coupled_tree"] = [o.token_ids for o in eng.generate(prompts, COUPLED)]
    else:  # two replicas, different thread counts, the same update
        torch.set_num_threads(1 if rank else 2)
        eng = _engine(model, arch, "3_1_3", drafter=SelfDrafter(group=16, act_block=16))
        before = _copy_hash(eng.spec.draft)
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        out = eng.generate(prompts, GREEDY)
        res.update(before=before, after=_copy_hash(eng.spec.draft),
                   refreshes=eng.spec.draft.refreshes,
                   refresh_seconds=eng.spec.draft.refresh_seconds,
                   tokens=[o.token_ids for o in out])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
