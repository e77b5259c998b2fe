"""Several drafter kinds in one engine (rollout/speculative/kinds.py): the one-layer
drafter and the self-drafter side by side, the kind chosen per bucket by their gates'
estimates, outputs exact whichever kind drafts and however often the kind switches."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.forward import ModelRunner
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_speculative import _prompts, _random_drafter, _simulated_clock, build_one_layer
from tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def one_layer_pair(tmp_path_factory, single_process_parallel):
    """A one-layer tiny Llama with a near-oracle EAGLE drafter, and another model of
    its shape (the source of a degraded copy)."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    folder = save_tiny_hf("llama_tied", tmp_path_factory.mktemp("kinds"), seed=5,
                          num_hidden_layers=1)
    model, arch, good, _ = build_one_layer(folder)
    other_dir = save_tiny_hf("llama_tied", tmp_path_factory.mktemp("kinds_other"), seed=8,
                             num_hidden_layers=1)
    other, _ = load_model(other_dir, device=torch.device("cpu"), dtype="float32",
                          impl="local")
    return model, arch, good, other


def _run(model, arch, drafters, sp, prompts, monkeypatch=None, epsilon=0.1, **cfg):
    sc = SpeculativeConfig(threshold=64, buckets="1,2,4", arms="*:3_1_3,5_1_5")
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafters(drafters, epsilon=epsilon)
    if monkeypatch is not None:
        _simulated_clock(eng, monkeypatch, lambda s: 1.2 + 0.1 * s.depth)
    return eng, eng.generate(prompts, sp)


@pytest.mark.parametrize("winner", ["self", "eagle"])
def test_each_bucket_chooses_the_kind_that_pays(one_layer_pair, winner, monkeypatch):
    """With simulated step times: the int8 copy beside a random one-layer drafter is
    chosen in most steps; a near-oracle one-layer drafter beside a degraded copy
    (another model's weights) is. Greedy outputs equal plain decoding either way."""
    model, arch, good, other = one_layer_pair
    sp = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 160, 90, 20)]
    prompts = _prompts(lengths=(3, 9, 5, 12), seed=6)
    ref = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                              eos_token_ids=[]).generate(prompts, sp)]
    if winner == "self":
        drafters = {"eagle": _random_drafter(arch), "self": SelfDrafter()}
    else:
        drafters = {"eagle": good, "self": SelfDrafter(source=ModelRunner(other, arch))}
    eng, outs = _run(model, arch, drafters, sp, prompts, monkeypatch)
    assert [o.token_ids for o in outs] == ref
    total = {}
    for per in eng.tuner.chosen.values():
        for k, n in per.items():
            total[k] = total.get(k, 0) + n
    loser = "eagle" if winner == "self" else "self"
    # each kind is tried first (its gate measures plain decoding, then probes), then the
    # winner takes the steps
    assert total[winner] > 2 * total.get(loser, 0), eng.tuner.chosen
    s = eng.last_stats.summary()["spec"]
    assert s["steps"] > 0 and s["buckets"]["1"]["tuner"]["chosen"] == eng.tuner.chosen["1"]


def test_switching_kinds_keeps_coupled_outputs(one_layer_pair):
    """Kinds chosen at random half of the time (epsilon 0.5): coupled responses are the
    plain coupled ones token for token, and both kinds drafted."""
    model, arch, good, _ = one_layer_pair
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, seed=9)
    prompts = _prompts()
    seeds = list(range(50, 50 + len(prompts)))
    plain = RolloutEngine(model, None, RolloutConfig(sampling_mode="coupled"), arch=arch,
                          eos_token_ids=[]).generate(prompts, sp, request_seeds=seeds)
    sc = SpeculativeConfig(threshold=64, buckets="1,2,4", arms="*:3_1_3,2_1_2",
                           break_even=False)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, sampling_mode="coupled",
                                                   max_batch_size=3),
                        arch=arch, eos_token_ids=[])
    eng.attach_drafters({"eagle": good, "self": SelfDrafter()}, epsilon=0.5)
    # without the gate there are no estimates: make the choice random every step
    eng.tuner.estimate = lambda kind, b: 1.0
    outs = eng.generate(prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    total = {}
    for per in eng.tuner.chosen.values():
        for k, n in per.items():
            total[k] = total.get(k, 0) + n
    assert total.get("eagle", 0) > 5 and total.get("self", 0) > 5, total


def test_per_kind_metrics_add_up_to_the_totals(one_layer_pair, monkeypatch):
    """SpecStats per kind (``summary()["kinds"]``, ``bucket_choice``, ``segments``) with
    both kinds chosen (epsilon 0.5): per-kind counts sum to the call's totals, per
    bucket the kinds' steps and the declined ones to the bucket's tuned steps, and the
    RL step's merge (``rl.spec_metrics``) keeps the sums over replicas and reaches W&B
    as ``spec/<kind>/...`` keys."""
    from megatron_tlt.rl.spec_metrics import merge_spec
    from megatron_tlt.tracking import _flatten

    model, arch, good, _ = one_layer_pair
    sp = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 160, 90, 20)]
    prompts = _prompts(lengths=(3, 9, 5, 12), seed=6)
    eng, _ = _run(model, arch, {"eagle": good, "self": SelfDrafter()}, sp, prompts,
                  monkeypatch, epsilon=0.5)
    s = eng.last_stats.summary()["spec"]
    kinds = s["kinds"]
    assert set(kinds) == {"eagle", "self"}
    assert all(k["steps"] > 0 for k in kinds.values()), kinds
    for f in ("steps", "rows", "emitted", "declined", "probes", "catchup_tokens"):
        assert sum(k[f] for k in kinds.values()) == s[f], f
    assert sum(k["draft_seconds"] for k in kinds.values()) == pytest.approx(s["draft_seconds"])
    assert sum(k["drafted_per_row"] * k["rows"] for k in kinds.values()) == pytest.approx(
        s["drafted_per_row"] * s["rows"])
    tuned = {label: b["steps"] for label, b in s["buckets"].items()}
    assert sum(k["chosen"] for k in kinds.values()) == sum(tuned.values())
    arms: dict = {}
    for k in kinds.values():
        assert k["accept_len"] == pytest.approx(k["emitted"] / k["rows"])
        assert k["chosen"] == k["steps"] + k["declined"] == sum(k["arms"].values())
        for arm, n in k["arms"].items():
            arms[arm] = arms.get(arm, 0) + n
    assert arms == s["arms"]
    for label, b in s["bucket_choice"].items():
        assert sum(b["kinds"].values()) + b["plain"] == tuned[label]
        for name, k in kinds.items():  # this call's choices are the (fresh) tuner's
            kb = k["buckets"].get(label, {"chosen": 0, "steps": 0})
            assert kb["chosen"] == eng.tuner.chosen[label].get(name, 0)
            assert b["kinds"].get(name, 0) == kb["steps"]
        assert b["choice"] == "plain" or b["choice"].split()[0] in kinds
    # the timeline: ordered, non-overlapping segments of the kinds that ran
    segs = s["segments"]
    assert {w for *_, w in segs} >= {"eagle", "self"}
    assert all(a <= b for a, b, _ in segs)
    assert all(x[1] <= y[0] for x, y in zip(segs, segs[1:]))

    # two replicas with this summary each: sums double, means stay
    m = merge_spec([s, s], 2 * eng.last_stats.decode_steps)
    assert m["kinds"] == ["eagle", "self"]
    assert sum(m[k]["steps"] for k in m["kinds"]) == m["steps"] == 2 * s["steps"]
    assert sum(m[k]["declined"] for k in m["kinds"]) == m["declined"] == 2 * s["declined"]
    assert sum(m[k]["on_fraction"] for k in m["kinds"]) == pytest.approx(m["on_fraction"])
    for k in m["kinds"]:
        assert m[k]["accept_len"] == pytest.approx(kinds[k]["accept_len"])
        assert sum(m[k]["steps_by_bucket"].values()) == m[k]["steps"]
    for label, per in m["chosen"].items():
        assert sum(per.values()) == 2 * tuned[label]
        assert m["bucket_choice"][label] == s["bucket_choice"][label]["choice"]
    flat = _flatten({"spec": m})
    assert flat["spec/self/accept_len"] == m["self"]["accept_len"]
    assert flat["spec/eagle/steps"] == m["eagle"]["steps"]
    assert {f"spec/chosen/{label}/plain" for label in tuned} <= set(flat)


@pytest.mark.parametrize("kind", ["eagle", "self"])
def test_one_drafter_reports_its_kind(one_layer_pair, kind):
    """With a single drafter every tuned step is that kind's."""
    model, arch, good, _ = one_layer_pair
    sc = SpeculativeConfig(threshold=64, buckets="1,2,4", arms="*:3_1_3")
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[], drafter=good if kind == "eagle" else SelfDrafter())
    eng.generate(_prompts(lengths=(3, 9), seed=2),
                 SamplingParams(temperature=0.0, max_new_tokens=30))
    s = eng.last_stats.summary()["spec"]
    assert list(s["kinds"]) == [kind]
    k = s["kinds"][kind]
    assert (k["steps"], k["rows"], k["emitted"], k["declined"]) == (
        s["steps"], s["rows"], s["emitted"], s["declined"])
    assert k["chosen"] == sum(b["steps"] for b in s["buckets"].values())
