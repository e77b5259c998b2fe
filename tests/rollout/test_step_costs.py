"""Modelled step costs (rollout.speculative.costs=modelled): the table's model and its
round trip, a calibration on a tiny engine, and decisions that follow the table, not
the clock: with one table, a slowed-down clock changes no output of a sampled
(standard mode) speculative call; under measured costs the tuner's choices follow the
clock."""

from __future__ import annotations

import pytest

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.config.kinds import KindSettings, SelfSettings
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative import calibrate
from megatron_tlt.rollout.speculative.decision import Decision, Outcome
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from megatron_tlt.rollout.speculative.step_costs import KindCosts, StepCosts
from megatron_tlt.rollout.speculative.tuner import StrategyTuner
from megatron_tlt.spec_strategy import Strategy, parse_arms
from test_speculative import _prompts, _simulated_clock

ARMS = "1:3_1_3,5_1_5;*:2_1_2,4_1_4"


def test_the_model_interpolates_and_round_trips(tmp_path):
    c = KindCosts({1: 1.0, 4: 2.5}, {"3_1_3": {1: 1.5, 4: 2.0}}, 0.01)
    assert c.plain_seconds(1) == 1.0 and c.plain_seconds(2) == 1.5
    assert c.plain_seconds(8) == pytest.approx(4.5)  # the last slope beyond the table
    assert c.spec_seconds(2, Strategy.parse("3_1_3")) == pytest.approx(1.5 * (1.5 + 0.5 / 3))
    assert c.spec_seconds(8, Strategy.parse("3_1_3")) == pytest.approx(4.5 * 2.0)  # clamped
    assert c.spec_seconds(1, Strategy.parse("0_0_0")) == 1.0
    assert c.catchup_seconds(30) == pytest.approx(0.3)
    t = StepCosts({"self": c}, source="test", key="k")
    t.save(tmp_path / "c.json")
    back = StepCosts.load(tmp_path / "c.json")
    assert back.kinds["self"] == c and back.key == "k"
    assert c.from_flat(c.flat()) == c
    with pytest.raises(ValueError, match="rollout.speculative.step_costs="):
        (tmp_path / "bad.json").write_text("{}")
        StepCosts.load(tmp_path / "bad.json")


def test_a_modelled_tuner_charges_the_table_and_keeps_it_in_its_state():
    def tuner(costs):
        return StrategyTuner("1,4", parse_arms(ARMS, "1,4"), break_even=True, seed=3,
                             costs=costs)
    table = KindCosts({1: 1.0, 4: 2.0}, {"3_1_3": {1: 1.2}}, 0.0)
    a, b = tuner("modelled"), tuner("modelled")
    a.costs = b.costs = table
    for step in range(40):
        da, db = a.decide(1), b.decide(1)
        assert da == db, step
        # the two tuners see different clocks: the table alone is charged
        a.record(da, Outcome(1, 3 if not da.strategy.is_off else 1, 0.5 + step, [2]))
        b.record(db, Outcome(1, 3 if not db.strategy.is_off else 1, 7.0, [2]))
    assert a.state_dict() == b.state_dict()
    assert a.state_dict()["step_costs"] == table.to_dict()
    c = tuner("modelled")
    c.load_state_dict(a.state_dict())
    assert c.costs == table and c.decide(1) == a.decide(1)
    # measured costs: the clock decides (a slow speculative step loses the bucket)
    m = tuner("measured")
    m.costs = table
    seen = set()
    for _ in range(30):
        d = m.decide(1)
        m.record(d, Outcome(1, 3 if not d.strategy.is_off else 1,
                            50.0 if not d.strategy.is_off else 1.0, [2]))
        seen.add(d.strategy.is_off)
    assert m.gate_stats()["1"]["speculating"] is False


@pytest.fixture(scope="module")
def self_engine(tiny_llama):
    model, arch = tiny_llama

    def make(costs="modelled", step_costs="auto"):
        sc = SpeculativeConfig(drafter="", threshold=4, buckets="1,4", arms=ARMS,
                               kinds=KindSettings(self=SelfSettings(arms=ARMS)), costs=costs,
                               step_costs=step_costs)
        eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                            eos_token_ids=[])
        eng.attach_drafter(SelfDrafter())
        return eng
    return make


def test_calibration_then_the_table_not_the_clock_decides(self_engine, tmp_path,
                                                         monkeypatch):
    eng = self_engine(step_costs=str(tmp_path / "costs.json"))
    table = calibrate.ensure_costs(eng)
    c = table.kinds["self"]
    assert {1, 4} <= set(c.plain) and all(v > 0 for v in c.plain.values())
    assert set(c.relative) == {"3_1_3", "5_1_5", "2_1_2", "4_1_4"}
    assert c.catchup > 0
    assert StepCosts.load(tmp_path / "costs.json").kinds["self"] == c  # written
    assert calibrate.ensure_costs(eng) is None  # once
    prompts = _prompts(lengths=(3, 9, 5, 12), seed=4)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11)
    ref = [o.token_ids for o in eng.generate(prompts, sp)]
    spec_ref = eng.last_stats.spec.summary()
    # a second engine reads the same table; its clock is ten times slower for
    # speculative steps: same decisions, same tokens
    other = self_engine(step_costs=str(tmp_path / "costs.json"))
    assert calibrate.ensure_costs(other).kinds["self"] == c
    _simulated_clock(other, monkeypatch, lambda s: 10.0)
    got = [o.token_ids for o in other.generate(prompts, sp)]
    assert got == ref
    spec = other.last_stats.spec.summary()
    assert spec["arms"] == spec_ref["arms"] and spec["steps"] == spec_ref["steps"]
    assert spec["steps"] > 0
    assert other.tuner.state_dict()["gate"]["reach"] == eng.tuner.state_dict()["gate"]["reach"]


def test_several_kinds_are_calibrated_each(tiny_llama):
    """With two drafter kinds each kind's tuner gets its own costs, measured on its own
    decoder (the kind decoder steps with the kind being calibrated)."""
    from test_speculative import _random_drafter

    model, arch = tiny_llama
    sc = SpeculativeConfig(threshold=2, buckets="1,2", arms="*:2_1_2",
                           kinds=KindSettings(self=SelfSettings(arms="")))
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafters({"eagle": _random_drafter(arch), "self": SelfDrafter()})
    table = calibrate.ensure_costs(eng)
    assert sorted(table.kinds) == ["eagle", "self"]
    for kind, tuner in eng.tuner.tuners.items():
        assert tuner.costs is table.kinds[kind] and "2_1_2" in tuner.costs.relative
    assert eng.tuner.active is None
