"""The planner: determinism, the scheduling and gate rules it copies, sanity of its
predictions, and its validation against the shipped measurements."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from megatron_tlt.config import load_config
from megatron_tlt.planner import (Acceptance, DrafterGroup, EngineSettings, Layout,
                                  LengthModel, Scenario, StepCost, TrainCost, predict,
                                  predict_for_config, simulate_arm)
from megatron_tlt.planner.inputs import (ModelShape, accept_length, alpha_curve,
                                         drift_from_json, lengths_from_metrics, load_json,
                                         roofline)
from megatron_tlt.planner.sim import run_engine

QWEN7B = ModelShape(7.62e9, 28, 3584, 512, 152064)


def gpu_scenario(alpha=0.7, dp=16, seed=0, acceptance="default", **kw) -> Scenario:
    cost = roofline("h100", QWEN7B, 2)
    acc = Acceptance.constant([alpha]) if acceptance == "default" else acceptance
    return Scenario(Layout(2, 1, dp), 64, 8, 256.0,
                    LengthModel(cap=4096, median=800, sigma=0.8, cap_fraction=0.03), cost,
                    TrainCost(update_per_token=cost.train_seconds_per_token(2)),
                    EngineSettings(64, 32), acc, DrafterGroup(tokens_per_second=1e5),
                    steps=2, seed=seed, **kw)


def constant_cost(seconds=1.0, slope=0.5) -> StepCost:
    return StepCost(batches=(1, 64), seconds=(seconds, seconds), spec_batches=(1,),
                    spec_slope=(slope,))


def test_same_inputs_same_prediction():
    a = predict(gpu_scenario()).to_dict()
    b = predict(gpu_scenario()).to_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = predict(gpu_scenario(seed=1)).to_dict()  # the seed draws other lengths
    assert c["without_tlt"]["step_s"] != a["without_tlt"]["step_s"]


def test_a_replica_runs_at_the_alone_costs_once_the_others_finished():
    """A segment that straddles ``alone_after`` runs at the shared costs up to it and
    at the alone costs after; never alone: the shared costs throughout."""
    cost, alone = constant_cost(1.0), constant_cost(0.5)
    lens = np.array([9.0])  # 8 decode steps after the prefill's token
    eng = EngineSettings(max_batch_size=1)
    assert run_engine(lens, 0.0, cost, eng, None).finish == pytest.approx(8.0)
    assert run_engine(lens, 0.0, cost, eng, None, alone=alone).finish == pytest.approx(8.0)
    mid = run_engine(lens, 0.0, cost, eng, None, alone=alone, alone_after=4.0)
    assert mid.finish == pytest.approx(4.0 + 4 * 0.5)
    assert run_engine(lens, 0.0, cost, eng, None, alone=alone,
                      alone_after=0.0).finish == pytest.approx(4.0)


def test_continuous_batching_refills_freed_rows():
    # 1 s per step whatever the batch; the prefill emits each row's first token
    cost, lens = constant_cost(), np.array([5.0, 3.0, 2.0])
    one = run_engine(lens, 0.0, cost, EngineSettings(max_batch_size=1), None)
    assert one.finish == pytest.approx(4 + 2 + 1)
    two = run_engine(lens, 0.0, cost, EngineSettings(max_batch_size=2), None)
    # rows 5 and 3 start; the 3 ends after 2 steps and the 2 takes its row (1 more step
    # after the refill's prefill token), the 5 ends after 4: 4 steps in all
    assert two.finish == pytest.approx(4.0)
    assert two.tokens == pytest.approx(10.0)


def test_a_group_shares_its_prompts_prefill_while_a_row_of_it_runs():
    """rollout.share_prefill: a GRPO group's prompt is prefilled once while any of its
    rows runs; once all have finished a late request prefills it again."""
    cost = replace(constant_cost(), prefill_seconds_per_token=0.01)
    lens = np.array([3, 3, 3, 3, 9, 9, 9, 9])  # 2 prompts x 4
    eng = EngineSettings(max_batch_size=8)
    plain = run_engine(lens, 10.0, cost, eng, None).finish  # 8 prefills of 10 tokens
    shared = run_engine(lens, 10.0, cost, eng, None, group=4).finish  # 2 prefills
    assert plain - shared == pytest.approx(6 * 10 * 0.01)
    assert run_engine(lens, 10.0, cost, replace(eng, share_prefill=False), None,
                      group=4).finish == pytest.approx(plain)
    # 2 rows at a time: prompt 0's second pair enters after its first pair finished
    # (prefilled again); prompt 1's second pair while its first pair still runs
    two = EngineSettings(max_batch_size=2)
    lens = np.array([2, 2, 2, 2, 5, 12, 5, 12])
    refills = run_engine(lens, 10.0, cost, two, None, group=4).finish - \
        run_engine(lens, 0.0, cost, two, None, group=4).finish
    assert refills == pytest.approx(3 * 10 * 0.01)


def test_gate_speculates_only_where_it_pays():
    lens = np.array([40.0])
    eng = EngineSettings(max_batch_size=4, threshold=4, arms=((10 ** 9, (2,)),))
    cost = constant_cost(slope=0.5)  # a depth-2 step costs 2 plain steps
    weak = run_engine(lens, 0.0, cost, eng, [0.3])  # 1.39 tokens per 2 steps: declined
    assert weak.spec_steps == 0
    assert weak.finish == pytest.approx(39 * (1 + eng.probe_budget))
    strong = run_engine(lens, 0.0, cost, eng, [0.95])  # 2.85 tokens per 2 steps: pays
    assert strong.spec_tokens == pytest.approx(39.0)
    assert strong.finish == pytest.approx(39 / accept_length([0.95], 2) * 2.0)
    above = run_engine(lens, 0.0, cost, replace(eng, threshold=0), [0.95])
    assert above.spec_steps == 0 and above.finish == pytest.approx(39.0)


def test_acceptance_by_bucket():
    lens = np.array([40.0, 40.0, 40.0, 40.0])
    eng = EngineSettings(max_batch_size=4, threshold=4, arms=((10 ** 9, (2,)),))
    acc = Acceptance.constant([0.95])
    cost = constant_cost(slope=0.5)
    same = run_engine(lens, 0.0, cost, eng, [0.95], acc=acc)
    assert same.spec_tokens == pytest.approx(same.tokens - 4)  # all but prefill tokens
    # the drafter accepts less at 4 rows than at 1: speculation stops paying there
    low = replace(acc, bucket_factors=((2, 1.0), (4, 0.3)))
    assert run_engine(lens, 0.0, cost, eng, [0.95], acc=low).spec_steps == 0


def test_more_acceptance_is_not_slower():
    steps = [simulate_arm(gpu_scenario(alpha=a), "tlt").step for a in (0.2, 0.5, 0.7, 0.9)]
    assert all(x >= y - 1e-9 for x, y in zip(steps, steps[1:]))
    assert steps[-1] < steps[0]


def test_no_speculation_equals_the_baseline():
    sc = gpu_scenario(acceptance=None)
    off, tlt = simulate_arm(sc, "off"), simulate_arm(sc, "tlt")
    assert [s.step for s in off.steps] == [s.step for s in tlt.steps]
    assert tlt.spec_share == 0.0
    p = predict(sc)
    assert p.speedup == 1.0 and p.frozen is None


def test_one_replica_has_no_idle_time_and_trains_no_drafter():
    res = simulate_arm(gpu_scenario(dp=1), "tlt")
    assert all(s.idle_replica_seconds == 0.0 for s in res.steps)
    assert all(s.drafter_tokens == 0.0 for s in res.steps)
    res = simulate_arm(gpu_scenario(dp=16), "tlt")
    assert all(s.idle_replica_seconds > 0.0 for s in res.steps)


def test_drafter_group_moves_acceptance_along_the_curve():
    curve = alpha_curve()
    assert list(curve.tokens) == sorted(curve.tokens)
    assert curve.at(curve.tokens[-1])[0] >= curve.at(curve.tokens[0])[0]
    sc = gpu_scenario(acceptance=curve, dp=16)
    sc.steps = 3
    tlt, frozen = simulate_arm(sc, "tlt"), simulate_arm(sc, "frozen")
    assert tlt.steps[0].alpha == frozen.steps[0].alpha
    assert tlt.steps[-1].alpha[0] > frozen.steps[-1].alpha[0]


def test_drift_data_replaces_the_curve():
    from cli import REPO

    results = REPO / "docs" / "results"
    online, frozen = drift_from_json(load_json(results / "bench_drift_quick_cpu.json"))
    assert online[0] == 1.0 and frozen[0] == 1.0 and len(online) == len(frozen) == 4
    acc = replace(alpha_curve(), drift_online=online, drift_frozen=frozen)
    sc = gpu_scenario(acceptance=acc)
    sc.steps = 4
    a = simulate_arm(sc, "tlt")
    assert [s.alpha[0] for s in a.steps] == pytest.approx(
        [acc.at(0.0)[0] * f for f in online])


def test_gathered_pp_decodes_on_more_engines():
    sc = gpu_scenario(dp=4)
    base = simulate_arm(sc, "off").mean("rollout")
    pp = replace(sc, layout=Layout(2, 2, 4, gathered=True))
    assert simulate_arm(pp, "off").mean("rollout") < base
    staged = replace(sc, layout=Layout(2, 2, 4, gathered=False))
    assert simulate_arm(staged, "off").mean("rollout") == pytest.approx(base)


def test_lengths_from_a_runs_metrics():
    from cli import REPO

    m = lengths_from_metrics(REPO / "docs" / "results" / "rl_smollm2_chain_sum_30steps_cpu.jsonl")
    assert m.cap == 256 and 0 < m.cap_fraction < 0.2
    x = m.draw(4096, np.random.default_rng(0))
    assert x.max() <= 256 and abs(np.median(x) - m.median) < 0.2 * m.median


@pytest.mark.parametrize("recipe,world", [("examples/rl/qwen2.5_7b_grpo.yaml", 8),
                                          ("examples/rl/qwen2.5_32b_grpo.yaml", 64)])
def test_predict_for_a_recipe(recipe, world):
    p = predict_for_config(load_config([recipe]), world)
    lines = p.lines()
    assert lines[0].startswith("predicted") and any("assumptions" in x for x in lines)
    lo, hi = p.band
    assert lo <= p.speedup <= hi
    d = p.to_dict()
    assert d["layout"]["gpus"] == world
    assert 0 < d["without_tlt"]["rollout_fraction"] < 1


def test_tables_measured_before_and_after_are_averaged():
    """The co-run tables bracketing the validated runs enter as their mean; tables
    measured at different rows are refused."""
    from megatron_tlt.planner.cpu_inputs import mean_table

    a = StepCost(batches=(1, 8), seconds=(0.02, 0.03), kv_seconds_per_token=1e-6,
                 prefill_seconds_per_token=2e-3, source="a")
    b = replace(a, seconds=(0.03, 0.05), kv_seconds_per_token=3e-6, source="b")
    m = mean_table([a, b])
    assert m.seconds == pytest.approx((0.025, 0.04))
    assert m.kv_seconds_per_token == pytest.approx(2e-6)
    assert m.prefill_seconds_per_token == pytest.approx(2e-3)
    assert "a" in m.source and "b" in m.source and mean_table([a]) is a
    with pytest.raises(ValueError, match="same rows"):
        mean_table([a, replace(b, batches=(1, 16))])


def _work_record(step, backward, forward, *, b=0.012, f=0.004, opt=0.8, extra=0.5,
                 rest=0.1, lengths=None, bc=0.0, fc=0.0, first_backward=None, fbx=0.0):
    """A bench_e2e-shaped record whose replicas' parts cost exactly b / f seconds per
    padded token (+ bc / fc per attention cell, each replica's micro-batches padded to
    ``lengths``); the slowest replica's own optimizer step takes ``opt`` (the others
    wait for it there) and the first step ``extra`` more."""
    lengths = lengths or [0] * len(backward)
    bcells = [x * t for x, t in zip(backward, lengths)]
    fcells = [y * t for y, t in zip(forward, lengths)]
    fb = first_backward or [False] * len(backward)
    bsec = [b * x + bc * c + fbx * f for x, c, f in zip(backward, bcells, fb)]
    fsec = [f * y + fc * c for y, c in zip(forward, fcells)]
    compute = [x + y for x, y in zip(bsec, fsec)]
    own = opt + (extra if step == 1 else 0.0)
    waits = [max(compute) - c for c in compute]
    work = {"backward_tokens": backward, "forward_tokens": forward,
            "backward_seconds": bsec, "forward_seconds": fsec,
            "step_seconds": [own + w for w in waits]}
    if any(lengths):
        work |= {"backward_cells": bcells, "forward_cells": fcells}
    return {"step": step, "measured": {"update": max(compute) + own + rest}, "work": work}


def test_update_model_recovers_the_recorded_costs():
    """The update model from each replica's recorded work: the costs per padded token,
    the optimizer step (the slowest replica's, not a waiting one's), the first step's
    extra; a step it did not see is then predicted exactly."""
    from megatron_tlt.planner.cpu_inputs import fit_update, predict_update

    recs = [_work_record(1, [900, 0], [0, 500]), _work_record(2, [400, 1200], [300, 0]),
            _work_record(2, [0, 0], [1100, 700]), _work_record(3, [1500, 200], [0, 900])]
    upd = fit_update(recs)
    assert upd["backward_s_per_token"] == pytest.approx(0.012)
    assert upd["forward_s_per_token"] == pytest.approx(0.004)
    assert upd["step_s"] == pytest.approx(0.8)
    assert upd["first_step_extra_s"] == pytest.approx(0.5)
    assert upd["other_s"] == pytest.approx(0.1)
    for new in (_work_record(4, [300, 2000], [800, 0]), _work_record(1, [0, 0], [64, 32])):
        assert predict_update(new, upd) == pytest.approx(new["measured"]["update"])
    # a record without the work (an older JSON) is not used
    assert fit_update(recs + [{"step": 2, "measured": {"update": 99.0}}]) == upd


def test_update_model_separates_attention_from_the_per_token_cost():
    """Records with each micro-batch's attention cells (rows x padded length^2): the
    fit recovers the per-token and per-cell costs of both parts, so a step of shorter
    (or longer) sequences than the fitted ones is predicted exactly; the recipe
    simulator charges the same per-cell cost."""
    from megatron_tlt.planner.cpu_inputs import fit_update, predict_update

    kw = dict(b=0.010, bc=4e-6, f=0.003, fc=1e-6)
    recs = [_work_record(s, bw, fw, lengths=ln, **kw) for s, bw, fw, ln in (
        (1, [900, 0], [0, 500], [400, 300]), (2, [400, 1200], [300, 0], [200, 600]),
        (2, [640, 800], [1100, 700], [640, 350]), (3, [1500, 200], [256, 900], [500, 150]),
        (3, [300, 700], [600, 200], [120, 520]))]
    upd = fit_update(recs)
    assert upd["backward_s_per_token"] == pytest.approx(0.010, rel=1e-6)
    assert upd["backward_s_per_cell"] == pytest.approx(4e-6, rel=1e-6)
    assert upd["forward_s_per_token"] == pytest.approx(0.003, rel=1e-6)
    assert upd["forward_s_per_cell"] == pytest.approx(1e-6, rel=1e-6)
    short = _work_record(4, [2000, 1800], [100, 0], lengths=[96, 80], **kw)
    assert predict_update(short, upd) == pytest.approx(short["measured"]["update"])
    # the per-token fit alone (the cells dropped) misses the short step by the
    # attention it averaged in
    flat = fit_update([r | {"work": {k: v for k, v in r["work"].items() if "cells" not in k}}
                       for r in recs])
    assert flat["backward_s_per_cell"] == 0.0
    assert predict_update(short, flat) > 1.1 * short["measured"]["update"]


def test_a_replicas_first_backward_is_flagged_and_its_extra_fitted():
    """Each replica's first backward in its process (records in the order they ran)
    carries a fixed extra: flagged, kept out of the per-token fit, fitted apart and
    predicted on the records that have it."""
    from megatron_tlt.planner.cpu_inputs import (fit_update, mark_first_backward,
                                                 predict_update)

    plan = [(1, [0, 0], [500, 600], [False, False]), (1, [0, 900], [400, 0], [False, True]),
            (2, [700, 300], [0, 200], [True, False]), (2, [800, 0], [0, 300], [False, False]),
            (3, [500, 1000], [100, 0], [False, False]), (3, [0, 600], [900, 0], [False, False])]
    recs = [_work_record(st, bw, fw, first_backward=fb, fbx=3.0) for st, bw, fw, fb in plan]
    for r in recs:
        r["work"].pop("first_backward", None)
    mark_first_backward(recs)
    assert [r["work"]["first_backward"] for r in recs] == [fb for *_, fb in plan]
    upd = fit_update(recs)
    assert upd["backward_s_per_token"] == pytest.approx(0.012)
    assert upd["first_backward_extra_s"] == pytest.approx(3.0)
    for r in recs:
        assert predict_update(r, upd) == pytest.approx(r["measured"]["update"])


def test_the_simulators_update_charges_attention_cells():
    """The same step with a per-cell cost: its update grows by the slowest replica's
    cells (sum of (prompt + response)^2) times that cost, its rollout does not."""
    from megatron_tlt.planner.sim import draw_lengths, simulate_step

    base = gpu_scenario(dp=2)
    celled = replace(base, train=replace(base.train, update_per_cell=1e-6))
    lens = draw_lengths(base, 0)
    a, b = simulate_step(base, 0, None, lens), simulate_step(celled, 0, None, lens)
    assert a.rollout == b.rollout and b.update > a.update
    every = float(((lens + base.prompt_tokens) ** 2).sum())  # both replicas' cells
    assert every / 2 * 1e-6 * 0.5 < b.update - a.update <= every * 1e-6


def test_cpu_validation_from_the_shipped_measurements():
    from cli import REPO

    from megatron_tlt.planner.validate import validate_cpu

    v = validate_cpu(REPO / "docs" / "results")
    err = v["cpu_validation_error"]
    for phase in ("rollout", "update", "step", "rollout_fraction"):
        assert math.isfinite(err[phase])
    # the rollout (what TLT changes), the step and the rollout's share of it are
    # predicted within 10 % on both bench_e2e commands and the demo recipe's run, from
    # the co-run tables measured just before and after them on the same machine (the
    # update from the other command's recorded work)
    assert err["rollout"] <= 0.10 and err["step"] <= 0.10
    assert err["rollout_fraction"] <= 0.10 and err["update"] <= 0.10
    # the TLT arm (the demo drafter declined by the gate) is predicted as no faster;
    # slower where it ran its process's first backward (the arm that runs first
    # alternates per step)
    for f in v["bench_e2e"]["commands"].values():
        assert 0.85 <= f["step_speedup"]["predicted"] <= 1.02


def test_the_cli_writes_a_prediction(tmp_path):
    from cli import REPO, run_main

    out = tmp_path / "plan.json"
    results = REPO / "docs" / "results"
    r = run_main("tools/plan_tlt.py", "--config", REPO / "examples/rl/qwen2.5_7b_grpo.yaml",
                 "--world-size", "16", "--lengths",
                 results / "rl_smollm2_chain_sum_30steps_cpu.jsonl",
                 "--drift", results / "bench_drift_quick_cpu.json", "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "expected speedup" in r.stdout and "drift run" in r.stdout
    d = json.loads(out.read_text())
    assert d["layout"]["dp"] == 8 and d["with_tlt"]["step_s"] > 0
    assert "rl_smollm2_chain_sum_30steps_cpu.jsonl" in d["workload"]["lengths"]


def test_a_calibration_folder_replaces_the_shipped_tables(tmp_path):
    """--calibration DIR: a table DIR holds is read instead of the shipped one (here the
    demo drafter's alpha raised to 0.9: the CPU recipe's TLT arm speculates), the rest
    stay shipped; a folder with none of the tables, or one given to --validate, is
    refused before anything runs."""
    from cli import REPO, run_main

    from megatron_tlt.planner.inputs import calibration_file

    doc = load_json("bench_spec_T1_demo_drafter_cpu.json")
    doc["alpha"]["alpha"] = [0.9] * len(doc["alpha"]["alpha"])
    mine = tmp_path / "tables"
    mine.mkdir()
    (mine / "bench_spec_T1_demo_drafter_cpu.json").write_text(json.dumps(doc))
    recipe = REPO / "examples/rl/smollm2_cpu.yaml"
    outs = {}
    for name, extra in (("shipped", []), ("mine", ["--calibration", mine])):
        out = tmp_path / f"{name}.json"
        r = run_main("tools/plan_tlt.py", "--config", recipe, "--world-size", "2",
                     *extra, "--json", out)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = (json.loads(out.read_text()), r.stdout)
    assert "calibration: bench_spec_T1_demo_drafter_cpu.json from" in outs["mine"][1]
    shipped, mine_pred = outs["shipped"][0]["with_tlt"], outs["mine"][0]["with_tlt"]
    assert mine_pred["speculation_share"] > shipped["speculation_share"]
    assert mine_pred["accept_len"] > 2.0
    # the folder is no longer read once the command has finished
    assert str(mine) not in str(calibration_file("bench_spec_T1_demo_drafter_cpu.json"))

    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_main("tools/plan_tlt.py", "--config", recipe, "--calibration", empty)
    assert r.returncode == 2 and "none of the planner's tables" in r.stderr
    r = run_main("tools/plan_tlt.py", "--validate", "--calibration", mine)
    assert r.returncode == 2 and "does not apply to --validate" in r.stderr


def test_the_shipped_validation_is_current():
    """docs/results/planner_validation.json is what the planner computes now (rerun
    `python tools/plan_tlt.py --validate --json docs/results/planner_validation.json`)."""
    from cli import REPO

    from megatron_tlt.planner.validate import validate_all

    results = REPO / "docs" / "results"
    shipped = json.loads((results / "planner_validation.json").read_text())
    now = json.loads(json.dumps(validate_all(results), default=float))
    for key in ("cpu_validation_error", "published_error"):
        numbers = {k: v for k, v in now[key].items() if isinstance(v, float)}
        assert numbers == pytest.approx({k: shipped[key][k] for k in numbers}, rel=1e-9), key


def test_the_self_drafter_alone_is_planned_as_a_copy_of_the_policy():
    """drafter=self: the planner assumes the copy's acceptance and trains nothing; a
    checkpoint with the self-drafter beside it (kinds.self.also) is planned as the
    checkpoint's kind."""
    recipe = "examples/rl/qwen2.5_7b_grpo.yaml"
    alone = predict_for_config(load_config([recipe], ["rollout.speculative.drafter=self"]), 8)
    both = predict_for_config(load_config([recipe], [
        "rollout.speculative.drafter=/d.safetensors",
        "rollout.speculative.kinds.self.also=true"]), 8)
    assert any("self-drafter drafts" in x for x in alone.lines())
    assert not any("self-drafter drafts" in x for x in both.lines())
