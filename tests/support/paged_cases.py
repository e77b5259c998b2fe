"""The paged KV cache (rollout.kv_cache=paged) against fixed slots at TP = 2, PP = 2 and
a Qwen3-MoE at EP = 2: the cases the multi-process workers run (mp_rollout_worker.py,
mp_parity_worker.py) with both caches in one process group, and the check the tests
apply to their results.

Every case runs GRPO-style groups (rollout_cases.group_prompts: 4 prompts x 4 requests,
shared prefill on: the paged rows share their prompt's blocks) once with slots and once
paged; the "_preempt" cases give the paged cache a pool of PAGED_BLOCKS blocks of
PAGED_BLOCK positions (a few rows' worth), so rows are preempted when blocks run out and
recomputed later. Plain decoding, EAGLE trees and the self-drafter's chains; the
single-process cases (every drafter kind, chains and trees, without preemption too) are
tests/rollout/test_paged_engine.py's. Greedy and coupled
outputs must not change: tokens and finish reasons exactly, log-probs and hidden
states to float32 noise, the experts of every position (MoE) exactly.
"""

from __future__ import annotations

from typing import Optional

from megatron_tlt.rollout import SamplingParams
from rollout_cases import case_engine, group_prompts, group_request_seeds

PAGED_BLOCK = 4
PAGED_BLOCKS = 12  # the small budget's blocks: 48 positions for 16 requests of 6 + 10

_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, return_hidden_states=True)
_COUPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=9)

# case -> (drafter kind or None, strategy, sampling mode, params, small budget)
PAGED_CASES = {
    "plain_greedy_preempt": (None, None, "standard", _GREEDY, True),
    "plain_coupled_preempt": (None, None, "coupled", _COUPLED, True),
    "eagle_tree_coupled_preempt": ("eagle", "3_2_5", "coupled", _COUPLED, True),
    "self_chain_coupled_preempt": ("self", "3_1_3", "coupled", _COUPLED, True),
}
# the Qwen3-MoE the EP = 2 launch runs them on (mp_parity_worker.py)
PAGED_MOE_MODEL = "qwen3_moe"


def paged_case_names(*, drafter: bool, self_drafter: bool) -> list[str]:
    """The cases a layout runs: speculation only with an EAGLE drafter given, the
    self-drafter where it runs (not at PP > 1)."""
    return [c for c, (kind, *_) in PAGED_CASES.items()
            if kind is None or (kind == "eagle" and drafter) or
            (kind == "self" and self_drafter)]


def _small_budget_gib(engine, prompts, params) -> float:
    """GiB of PAGED_BLOCKS blocks of this rank's cache (its layers, its KV heads), plus
    the drafters' paged pools, which rollout.kv_cache_gib holds beside them, for a call
    of ``prompts`` (the whole call: with expert parallelism the EP group's union)."""
    import torch

    from megatron_tlt.rollout.kv_paged import block_bytes
    from megatron_tlt.rollout.speculative.drafter_kind import draft_slack

    r = engine.runner
    per = block_bytes(num_layers=len(r.layers), kv_heads=r.groups, block_size=PAGED_BLOCK,
                      head_dim=engine.arch.kv_channels,
                      itemsize=torch.empty((), dtype=r.dtype).element_size(),
                      routes=r.route_shape)
    pools = 0
    if engine.spec is not None:
        plist = [params] * len(prompts) if not isinstance(params, list) else params
        capacity = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, plist))
        rows = min(engine.config.max_batch_size, len(prompts))
        pools = engine.spec.paged_kv_bytes(
            rows, capacity, draft_slack(engine.tuner.all_arms()),
            min(rows, engine.config.speculative.threshold), PAGED_BLOCK)
    return ((PAGED_BLOCKS + 0.5) * per + pools) / 2**30


def run_paged_cases(model, arch, names: list[str], *, mode: str = "gathered",
                    drafter=None, share: Optional[tuple[int, int]] = None) -> dict:
    """Every case of ``names`` with slots and paged: {case: {"slots": outputs,
    "paged": outputs, "preemptions": n, "spec_steps": n}} (outputs as JSON lists).
    ``share`` (rank, ranks): this rank asks for every ranks-th request from its rank
    (expert parallelism: the EP group decodes the union)."""
    from megatron_tlt.config import RolloutConfig

    prompts, seeds = group_prompts(), group_request_seeds()
    if share is not None:
        rank, ranks = share
        prompts, seeds = prompts[rank::ranks], seeds[rank::ranks]
    results = {}
    for case in names:
        kind, strategy, sampling, params, small = PAGED_CASES[case]
        got = {}
        for kv in ("slots", "paged"):
            cfg = RolloutConfig(kv_cache=kv, kv_block_size=PAGED_BLOCK, pipeline_mode=mode,
                                sampling_mode=sampling)
            eng = case_engine(model, arch, cfg, kind, strategy, drafter)
            if kv == "paged" and small:
                eng.config.kv_cache_gib = _small_budget_gib(eng, group_prompts(), params)
            outs = eng.generate(prompts, params, request_seeds=seeds)
            st = eng.last_stats
            got[kv] = [dict(tokens=o.token_ids, logprobs=o.logprobs, reason=o.finish_reason,
                            hidden=None if o.hidden_states is None else o.hidden_states.tolist(),
                            routes=None if o.routes is None else o.routes.tolist())
                       for o in outs]
            if kv == "paged":
                got.update(preemptions=st.preemptions, rows_peak=st.rows_peak,
                           kv_blocks=st.kv_blocks,
                           spec_steps=st.spec.steps if st.spec is not None else 0)
        results[case] = got
    return results


def check_paged(results: dict, where: str = "") -> None:
    """The paged outputs equal the slots' in every case; the small budgets preempted
    and the speculative cases speculated."""
    import torch

    assert results, where
    for case, got in results.items():
        kind, _, _, _, small = PAGED_CASES[case]
        tag = f"{where}/{case}"
        slots, paged = got["slots"], got["paged"]
        assert len(slots) == len(paged) > 0, tag
        assert [o["tokens"] for o in paged] == [o["tokens"] for o in slots], tag
        assert [o["reason"] for o in paged] == [o["reason"] for o in slots], tag
        for a, b in zip(slots, paged):
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= 1e-4, tag
            assert (a["hidden"] is None) == (b["hidden"] is None), tag
            if a["hidden"] is not None:
                diff = (torch.tensor(a["hidden"]) - torch.tensor(b["hidden"])).abs().max()
                assert diff.item() <= 1e-4, tag
            assert a["routes"] == b["routes"], tag
        assert got["kv_blocks"] > 0, tag
        if small:  # (a budget of PAGED_BLOCKS blocks beside the drafters' pools, which
            # come out of the same bytes; its sizing: test_paged_engine's budget tests)
            assert got["preemptions"] > 0, (
                tag, {k: v for k, v in got.items() if k not in ("slots", "paged")})
        if kind is not None:
            assert got["spec_steps"] > 0, tag
