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
from megatron_tlt.rollout.speculative.kinds import attach_kinds
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
    attach_kinds(eng, drafters, epsilon=epsilon)
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
    attach_kinds(eng, {"eagle": good, "self": SelfDrafter()}, epsilon=0.5)
    # without the gate there are no estimates: make the choice random every step
    eng.tuner.estimate = lambda kind, b: 1.0
    outs = eng.generate(prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    total = {}
    for per in eng.tuner.chosen.values():
        for k, n in per.items():
            total[k] = total.get(k, 0) + n
    assert total.get("eagle", 0) > 5 and total.get("self", 0) > 5, total
