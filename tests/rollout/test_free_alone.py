"""Model-free kinds speculating alone (``multi.KindDecoder.alone``): where the bucket's
kind is declined, rows whose lookup match pays speculate with it and the others decode
plainly in the same verification. Exact (greedy and coupled outputs equal to plain
decoding; chi-square of 3-token continuations at T=1 with top-p and T=0.7 with top-k)
in a configuration where only the free kinds speculate, taken in steps a real break-
even gate declined, and within the host-sync budget."""

from __future__ import annotations

import pytest

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative.kind_group import GroupHistory
from megatron_tlt.rollout.speculative.kind_prompt import PromptLookup
from test_model_free_kinds import assert_decodes_as_plain, uneven_config
from test_speculative import (DIST_DRAWS, P_MIN, _chi2_pvalue, _exact_joint,
                              _sample_continuations, one_layer)  # noqa: F401

BASE = [7, 100, 33, 250, 3]
SPS = [SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3),
       SamplingParams(temperature=0.7, top_k=8, max_new_tokens=3)]
DECLINED = "*:0_0_0"  # the model kind's only arm: every tuned step declined


def _engine(model, arch, drafter, *, arms=DECLINED, threshold=1 << 20, alone=True,
            costs="modelled", **cfg):
    """EAGLE (``drafter``) beside both free kinds, its tuner declining as ``arms`` and
    the gate say."""
    sc = SpeculativeConfig(arms=arms, threshold=threshold, free_alone=alone, costs=costs)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    pl = PromptLookup()
    pl.min_n = 1
    eng.attach_drafters({"eagle": drafter, "group_history": GroupHistory(),
                         "prompt_lookup": pl})
    return eng


def _paying(eng) -> None:
    """Every match counts as paying: a free kind's draft of n tokens is expected to
    emit 1 + n, and a verification costs a plain step (as on a GPU at small batch)."""
    eng.tuner.expected = lambda kind, n: 1.0 + n if kind != "eagle" else 1.0
    for k in ("group_history", "prompt_lookup"):
        eng.tuner.tuners[k].relative_cost = lambda b, arm: 1.0


def _free_tokens(summ) -> int:
    return sum(summ["kinds"][k]["proposed_emitted"] for k in ("group_history",
                                                              "prompt_lookup")
               if k in summ["kinds"])


@pytest.mark.parametrize("sp", SPS, ids=["t1-topp", "t0.7-topk"])
def test_free_kinds_alone_sample_exactly(one_layer, sp):  # noqa: F811
    model, arch, _, bad = one_layer
    eng = _engine(model, arch, bad, max_batch_size=2500)
    _paying(eng)
    eng.generate([BASE] * 200, SamplingParams(**{**sp.__dict__, "seed": 5,
                                                 "max_new_tokens": 6}))
    counts = _sample_continuations(eng, BASE, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    assert sum(eng.tuner.alone_steps.values()) > 0
    assert summ["kinds"].get("eagle", {}).get("steps", 0) == 0  # the model kind never speculated
    assert _free_tokens(summ) > summ["kinds"]["group_history"]["proposed_rows"]
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, BASE, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, pval


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_free_kinds_alone_decode_as_plain(one_layer, mode):  # noqa: F811
    """Groups of 4 responses, uneven lengths through 3 running rows, two calls: the
    tokens plain decoding gives, with alone steps in between plain ones."""
    model, arch, good, _ = one_layer
    cfg = uneven_config(mode)
    eng = _engine(model, arch, good, threshold=3, **cfg)
    _paying(eng)

    def only_free_kinds_speculated(eng):
        summ = eng.last_stats.spec.summary()
        assert _free_tokens(summ) > 0 and summ["kinds"].get("eagle", {}).get("steps", 0) == 0

    assert_decodes_as_plain(eng, model, arch, cfg, only_free_kinds_speculated)
    assert sum(eng.tuner.alone_steps.values()) > 0


def test_a_free_kind_speculates_where_the_gate_declines(one_layer):  # noqa: F811
    """EAGLE under its real break-even gate (an untrained drafter: it loses and is
    declined): in steps its gate declined, the group's matches speculate alone, and
    the gate's accounts go on (every declined step counted). Off (``free_alone=false``)
    the same steps decode plainly."""
    model, arch, _, bad = one_layer
    sp = SamplingParams(temperature=0.7, top_k=8, max_new_tokens=24, seed=3)
    prompts = [p for p in ([5, 9, 9, 9, 5, 9], [1, 2, 3, 1, 2]) for _ in range(8)]
    got = {}
    for alone in (True, False):
        eng = _engine(model, arch, bad, arms="*:0_0_0,2_1_2,4_1_4", threshold=16,
                      alone=alone, max_batch_size=16, costs="measured")
        _paying(eng)
        seen = []
        inner = eng.spec.alone

        def alone_step(rows, decision, tuner, inner=inner, seen=seen, eng=eng):
            eagle = eng.tuner.tuners["eagle"]
            gated = eagle._gated(decision.bucket) and eagle.has_reference(len(rows))
            d = inner(rows, decision, tuner)
            seen.append((gated, d is not None))
            return d
        eng.spec.alone = alone_step
        for seed in (1, 2):
            eng.generate(prompts, SamplingParams(**{**sp.__dict__, "seed": seed}))
        summ = eng.last_stats.spec.summary()
        got[alone] = (seen, summ, eng.tuner.tuners["eagle"].gate.gates)
    seen, summ, _ = got[True]
    assert any(gated and took for gated, took in seen), seen
    assert _free_tokens(summ) > 0
    seen_off, summ_off, _ = got[False]
    assert not any(took for _, took in seen_off) and _free_tokens(summ_off) == 0
    # a declined step replaced by an alone step still counts as declined for EAGLE's gate
    gates = got[True][2]
    assert sum(g.declined for g in gates) >= sum(1 for gated, took in seen if took)


@pytest.mark.parametrize("mode", ["greedy", "standard"])
def test_alone_steps_keep_the_host_sync_budget(one_layer, mode):  # noqa: F811
    from megatron_tlt.bench.sync_budget import measure
    from test_host_syncs import MODES, SPEC_BUDGET

    model, arch, _, bad = one_layer
    eng = _engine(model, arch, bad, threshold=64, cpu_kernels="true")
    _paying(eng)
    prompts = [p for p in ([5, 9, 9, 9, 5, 9], [1, 2, 3, 1, 2, 3, 1], [42] * 6)
               for _ in range(4)]
    measure(eng, prompts, MODES[mode])
    steps = measure(eng, prompts, MODES[mode])
    spec = [s for s in steps if s.speculative]
    assert spec and sum(eng.tuner.alone_steps.values()) > 0
    worst = max(spec, key=lambda s: s.count)
    assert worst.count <= SPEC_BUDGET, dict(worst.where)


def test_calibration_steps_are_never_taken_alone(one_layer):  # noqa: F811
    """The step-cost calibration drives the engine with its own schedule of plain and
    speculative steps: none of its plain steps becomes an alone step (each kind's
    table gets its plain times, the kinds' tuner takes no alone step)."""
    from megatron_tlt.rollout.speculative import calibrate

    model, arch, _, bad = one_layer
    eng = _engine(model, arch, bad, threshold=8, max_batch_size=8)
    _paying(eng)
    table = calibrate.ensure_costs(eng)
    assert set(table.kinds) == {"eagle", "group_history", "prompt_lookup"}
    assert all(c.plain for c in table.kinds.values())
    assert not eng.tuner.alone_steps and eng.tuner.declined is None


def test_the_bench_measures_free_kinds_beside_a_model_kind(one_layer):  # noqa: F811
    """``bench.free_kinds.measure_beside`` (tools/bench_free_kinds.py --beside): per
    call the tail's steps and its tokens by proposing kind (they add up to the tail's
    tokens: every row of a tail step emits at least one), the step-cost table it used
    (which a second arm reuses), and the engine left without a drafter."""
    from megatron_tlt.bench.free_kinds import measure_beside
    from megatron_tlt.rollout.speculative.step_costs import StepCosts

    model, arch, _, _ = one_layer
    eng = RolloutEngine(model, None, RolloutConfig(max_batch_size=8), arch=arch,
                        eos_token_ids=[])
    before = eng.config.speculative
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    prompts = [[3, 8, 3, 8], [1, 2, 1, 2]]
    r = measure_beside(eng, "random", ["group_history", "prompt_lookup"], prompts, 4, sp,
                       threshold=8, alone=True, calls=1)
    assert eng.spec is None and eng.config.speculative is before
    (c,) = r["calls"]
    assert c["tail_steps"] > 0 and c["spec_steps"] >= c["alone_steps"] >= 0
    assert sum(c["tail_tokens_by_kind"].values()) >= c["tail_steps"]
    assert c["tokens_per_tail_step"] >= 1.0
    table = StepCosts.from_dict(r["step_costs"])
    again = measure_beside(eng, "random", ["group_history", "prompt_lookup"], prompts, 4,
                           sp, threshold=8, alone=False, calls=1, costs=table)
    assert again["step_costs"] == r["step_costs"] and again["calls"][0]["alone_steps"] == 0
