"""Rollout at TP=2 and at PP=2 under `torchrun --nproc_per_node 2` (gloo) equals the
single-process engine's: tokens, log-probs, hidden states, speculation and coupled
sampling; with one prefill per prompt (rollout.share_prefill) the same outputs as
without it; and with the paged KV cache (rollout.kv_cache=paged, a budget small enough
that rows are preempted) the same outputs as with fixed slots (paged_cases.py; EP = 2
is tests/models/test_multiproc.py's launch)."""

from __future__ import annotations

import json

import pytest
import torch

from cli import run_script
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine
from paged_cases import check_paged
from rollout_cases import (CASES, COUPLED_CASES, COUPLED_PARAMS, GROUP_CASES, GROUP_SIZE,
                           SPEC_CASES, SPEC_MODEL, case_prompts, group_prompts, spec_config)
from tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_rollout_equals_single_process(layout, tiny_hf_dirs, single_process_parallel,
                                                tmp_path):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    # PP: tied (the last stage's own copy of the embedding) and untied output layers;
    # the layer kinds (Qwen2's biases, GQA) are TP's and PP=1's concern
    names = list(TINY_CONFIGS) if layout == "tp2" else [SPEC_MODEL, "llama_untied"]
    models = tmp_path / "models"
    models.mkdir()
    for name in names:
        (models / name).symlink_to(tiny_hf_dirs[name])
    out = tmp_path / "result.json"
    drafter_path = _spec_drafter(tiny_hf_dirs[SPEC_MODEL], tmp_path / "drafter.safetensors")
    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    r = run_script("tests/support/mp_rollout_worker.py", "--models", models, "--tp", tp, "--pp", pp,
                   "--out", out, "--drafter", drafter_path, nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert sorted(x["tp_rank" if tp == 2 else "pp_rank"] for x in ranks) == [0, 1]
    # both ranks (TP ranks, or pipeline stages) return exactly the same outputs
    assert ranks[0]["results"] == ranks[1]["results"]
    results = ranks[0]["results"]
    # at PP=2 both rollout.pipeline_mode values: the gathered copy (each stage decodes
    # a share of the prompts) and the stage-to-stage forward
    modes = ["gathered"] if pp == 1 else ["gathered", "pipelined"]
    assert {k.split("/")[0] for k in results} == set(modes)
    for mode in modes:
        _check_equals_single_process(
            {k.split("/", 1)[1]: v for k, v in results.items() if k.startswith(mode + "/")},
            names, tiny_hf_dirs, drafter_path)
        _check_shared_prefill({k.split("/", 2)[2]: v for k, v in results.items()
                               if k.startswith(f"{mode}/{SPEC_MODEL}/group_")}, pp)
        paged = results[f"{mode}/{SPEC_MODEL}/paged"]
        assert ("self_chain_coupled_preempt" in paged) == (pp == 1)
        check_paged(paged, f"{layout}/{mode}")
    _check_static_steps(results, [r["static_keys"] for r in ranks])
    if pp == 2:  # the gathered copies follow the trained weights
        for r in ranks:
            sync = r["sync"]
            assert sync["layers"] == sync["owners"] > 0
            assert sync["copies_equal"] and sync["tokens_equal_pipelined"], sync
            assert sync["tokens_changed"] and sync["copy_bytes"] > 0, sync
            # released before the update: only the vocabulary copies stay; the next
            # generate makes the layer copies again (and they equal their owners')
            assert sync["held_after_release"] == sync["vocab_copy_bytes"] < \
                sync["copy_bytes"] == sync["held_after_generate"], sync


def _check_static_steps(results: dict, keys: list[dict]) -> None:
    """The fixed-shape steps CUDA graphs capture (run eagerly) decode like the eager
    path in the gathered mode, at TP = 2 and at PP = 2 (each stage its own steps, its
    own keys)."""
    cases = [k.rsplit("/", 1)[0] for k in results if k.endswith("/static")]
    assert len(cases) == 3, cases
    for case in cases:
        eager, static = results[case + "/eager"], results[case + "/static"]
        # verification went through them (on every rank, or some stage's share)
        assert any(k[1] > 1 for rank in keys for k in rank[case]), case
        for e, s in zip(eager, static):
            assert s["tokens"] == e["tokens"], case
            assert max(abs(a - b) for a, b in zip(s["logprobs"], e["logprobs"])) <= 1e-5


def _check_equals_single_process(tp2, names, tiny_hf_dirs, drafter_path):
    for name in names:
        model, arch = load_model(tiny_hf_dirs[name], device=torch.device("cpu"),
                                 dtype="float32")
        engine = RolloutEngine(model, None, arch=arch, eos_token_ids=[])
        for case, params in CASES.items():
            ref = engine.generate(case_prompts(), params)
            got = tp2[f"{name}/{case}"]
            for o, g in zip(ref, got):
                assert g["tokens"] == o.token_ids, (name, case)
                assert max(abs(a - b) for a, b in zip(g["logprobs"], o.logprobs)) <= 1e-4
                if o.hidden_states is not None:
                    diff = (torch.tensor(g["hidden"]) - o.hidden_states).abs().max().item()
                    assert diff <= 1e-4, (name, case, diff)

    # speculative decoding (chain and tree, greedy and sampled, pruned draft vocabulary)
    from megatron_tlt.models.drafter import load_drafter

    model, arch = load_model(tiny_hf_dirs[SPEC_MODEL], device=torch.device("cpu"),
                             dtype="float32")
    drafter = load_drafter(drafter_path, arch)
    for case, (strategy, params) in SPEC_CASES.items():
        engine = RolloutEngine(model, None, spec_config(strategy), arch=arch, eos_token_ids=[],
                               drafter=drafter)
        ref = engine.generate(case_prompts(), params)
        if strategy != "tuned":  # (the tuner may decline)
            assert engine.last_stats.spec.steps > 0 and tp2[f"{SPEC_MODEL}/{case}/spec_steps"] > 0
        got = tp2[f"{SPEC_MODEL}/{case}"]
        for o, g in zip(ref, got):
            assert g["tokens"] == o.token_ids, case
            assert max(abs(a - b) for a, b in zip(g["logprobs"], o.logprobs)) <= 1e-4, case

    # coupled sampling: the same tokens with speculation off, chain and tree, at TP=2 as
    # at TP=1
    plain = tp2[f"{SPEC_MODEL}/coupled_plain"]
    for case, strategy in COUPLED_CASES.items():
        engine = RolloutEngine(model, None, spec_config(strategy, "coupled"), arch=arch,
                               eos_token_ids=[], drafter=drafter if strategy else None)
        ref = engine.generate(case_prompts(), COUPLED_PARAMS)
        got = tp2[f"{SPEC_MODEL}/{case}"]
        assert [g["tokens"] for g in got] == [o.token_ids for o in ref], case
        assert [g["tokens"] for g in got] == [g["tokens"] for g in plain], case


def _check_shared_prefill(results: dict, pp: int) -> None:
    """rollout.share_prefill on GROUP_CASES: the same outputs as without it, each
    distinct prompt prefilled once (at PP = 2 gathered: the stages' sum, a group on one
    stage), the other requests copies."""
    cases = [c for c, (_, kind, _, _) in GROUP_CASES.items() if not (kind == "self" and pp > 1)]
    assert sorted({k.rsplit("/", 1)[0] for k in results}) == sorted(cases)
    prompts = group_prompts()
    unique_tokens = sum(len(p) for p in {tuple(p) for p in prompts})
    for case in cases:
        off, on = results[f"{case}/False"], results[f"{case}/True"]
        for a, b in zip(off["outputs"], on["outputs"]):
            assert a["tokens"] == b["tokens"], case
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= 1e-4, case
            if a["hidden"] is not None:
                diff = (torch.tensor(a["hidden"]) - torch.tensor(b["hidden"])).abs().max()
                assert diff.item() <= 1e-4, case
        assert off["prefill_tokens"] == sum(len(p) for p in prompts), case
        assert on["prefill_tokens"] == unique_tokens, case
        assert on["prefill_tokens"] / off["prefill_tokens"] <= 1 / GROUP_SIZE + 0.05
        assert on["shared_rows"] == len(prompts) - len(prompts) // GROUP_SIZE, case
        if GROUP_CASES[case][0] is not None:
            assert on["spec_steps"] > 0 and off["spec_steps"] > 0, case


def _spec_drafter(model_dir, path):
    """A random drafter with a pruned vocabulary for the TP test, saved at TP=1."""
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    _, arch = load_model(model_dir, device=torch.device("cpu"), dtype="float32")
    drafter = EagleDrafter(DrafterConfig.for_target(arch, draft_vocab_size=200), arch)
    drafter.reset_parameters(seed=3)
    drafter.d2t.copy_(torch.randperm(arch.vocab_size, generator=torch.Generator().manual_seed(0))
                      [:200].sort().values)
    return save_drafter(drafter, path)
