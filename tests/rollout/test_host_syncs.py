"""The host-sync budget of a decode step (docs/architecture.md, "Invariants and the
tests that guard them"): counted on CPU by ``bench.sync_budget`` where a GPU would
wait for the device.

Budgets, at TP = 1: a plain step makes at most 1 host read (the finished-rows check:
the step's tokens and log-probs, one copy); a speculative step (catch-up, draft,
verify, accept, commit) at most 2 (the drafts; the acceptance together with the
emitted tokens' log-probs), greedy, standard and coupled, chains and trees."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.bench.sync_budget import HostSyncCounter, measure
from test_paged_engine import drafter_pool_gib
from tiny_models import VOCAB, sampling_modes, tiny_model_and_own_layer_drafter

PLAIN_BUDGET = 1  # the step's tokens and log-probs, read together
SPEC_BUDGET = 2  # the drafts; the acceptance with the emitted tokens' log-probs
MODES = sampling_modes(14)


@pytest.fixture(scope="module")
def model(tmp_path_factory, single_process_parallel):
    """A tiny model and a drafter that is its own first layer (drafts get accepted, so
    the accept and commit paths run over several tokens)."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return tiny_model_and_own_layer_drafter(tmp_path_factory.mktemp("syncs"), "cpu")


def _prompts(lengths=(3, 9, 5)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model, mode, strategy=None, kernels="true", **kw):
    m, arch, d = model
    sc = (SpeculativeConfig(policy="fixed", strategy=strategy, threshold=64)
          if strategy else SpeculativeConfig())
    cfg = RolloutConfig(speculative=sc, cpu_kernels=kernels,
                        sampling_mode="coupled" if mode == "coupled" else "standard", **kw)
    return RolloutEngine(m, None, cfg, arch=arch, eos_token_ids=[],
                         drafter=d if strategy else None)


def test_the_counter_sees_what_a_gpu_would_wait_for():
    t = torch.arange(6.0)
    mask = t > 2
    with HostSyncCounter() as c:
        t[0].item()
        t.tolist()
        bool(t[1] > 0)
        int(t[2])
        t[mask]
        t[mask] = 0.0
        t.nonzero()
        t.cpu()
        t.to("cpu")
        torch.where(mask)
    assert c.count == 10
    assert any("test_host_syncs.py" in k for k in c.where)
    with HostSyncCounter() as c:  # device work and host-to-device copies do not wait
        x = torch.tensor([1, 2, 3]).to(t.device)
        t.masked_fill(mask, 1.0).argmax()
        t[torch.tensor([0, 2])] = 1.0
        torch.where(mask, t, 0.0)
        x[1:]
    assert c.count == 0


@pytest.mark.parametrize("kernels", ["true", "false"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_plain_step_reads_the_host_once(model, mode, kernels):
    steps = measure(_engine(model, mode, kernels=kernels), _prompts(), MODES[mode])
    assert len(steps) >= 10 and not any(s.speculative for s in steps)
    worst = max(steps, key=lambda s: s.count)
    assert worst.count <= PLAIN_BUDGET, dict(worst.where)


@pytest.mark.parametrize("kernels", ["true", "false"])
@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_5"])
@pytest.mark.parametrize("mode", list(MODES) + ["mixed"])
def test_a_speculative_step_keeps_its_budget(model, mode, strategy, kernels):
    """``mixed``: greedy and standard rows at two temperatures in one batch."""
    params = MODES.get(mode) or [MODES["greedy"], MODES["standard"],
                                 SamplingParams(temperature=0.6, max_new_tokens=14, seed=4,
                                                ignore_eos=True)]
    steps = measure(_engine(model, mode, strategy, kernels), _prompts(), params)
    spec = [s for s in steps if s.speculative]
    assert spec, "no speculative step ran"
    worst = max(spec, key=lambda s: s.count)
    assert worst.count <= SPEC_BUDGET, dict(worst.where)


@pytest.mark.parametrize("strategy", [None, "4_1_4", "3_2_5"])
@pytest.mark.parametrize("mode", list(MODES))
def test_paged_steps_keep_the_budget(model, mode, strategy):
    """rollout.kv_cache=paged, a pool small enough to preempt: the block reservation
    (and preemption) before a step and the rollback after it read nothing from the
    device (host-side tables, one host-to-device copy)."""
    eng = _engine(model, mode, strategy, kv_cache="paged", kv_block_size=4,
                  kv_cache_gib=24 * eng_block_bytes(model) / 2**30)
    prompts = _prompts((3, 9, 5, 7, 2, 11))
    if strategy:  # the drafter's paged cache beside the target's blocks
        eng.config.kv_cache_gib += drafter_pool_gib(eng, prompts, MODES[mode])
    steps = measure(eng, prompts, MODES[mode])
    budget = SPEC_BUDGET if strategy else PLAIN_BUDGET
    assert steps and max(s.count for s in steps) <= budget, \
        dict(max(steps, key=lambda s: s.count).where)
    if strategy:
        assert any(s.speculative for s in steps)
    assert eng.last_stats.preemptions > 0


def eng_block_bytes(model) -> int:
    """Bytes of a 4-position block of the tiny model (K and V, every layer, fp32)."""
    _, arch, _ = model
    return 2 * arch.num_layers * arch.num_query_groups * 4 * arch.kv_channels * 4


@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_5"])
@pytest.mark.parametrize("mode", ["greedy", "standard"])
def test_the_self_drafters_step_keeps_the_budget(model, mode, strategy):
    """The policy's int8 copy as the drafter: its catch-up and drafting read nothing
    more than the one-layer drafter's."""
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    m, arch, _ = model
    cfg = RolloutConfig(speculative=SpeculativeConfig(policy="fixed", strategy=strategy,
                                                      threshold=64), cpu_kernels="true")
    eng = RolloutEngine(m, None, cfg, arch=arch, eos_token_ids=[], drafter=SelfDrafter())
    steps = measure(eng, _prompts(), MODES[mode])
    spec = [s for s in steps if s.speculative]
    assert spec, "no speculative step ran"
    worst = max(spec, key=lambda s: s.count)
    assert worst.count <= SPEC_BUDGET, dict(worst.where)


@pytest.mark.parametrize("kind", ["prompt_lookup", "group_history"])
@pytest.mark.parametrize("mode", ["greedy", "standard"])
def test_the_model_free_kinds_keep_the_budget(model, mode, kind):
    """The prompt's and the group's n-gram drafts: lookups and index updates on the
    host from tokens the engine already holds, so a speculative step reads the device
    no more than the one-layer drafter's. Repetitive prompts in groups of 4 (a row's
    siblings and its own prompt propose), two calls (the second from the first's
    responses too)."""
    from megatron_tlt.rollout.speculative import drafters

    m, arch, _ = model
    cfg = RolloutConfig(speculative=SpeculativeConfig(policy="fixed", strategy="4_1_4",
                                                      threshold=64), cpu_kernels="true")
    eng = RolloutEngine(m, None, cfg, arch=arch, eos_token_ids=[])
    eng.attach_drafter(drafters.make_drafter(kind, arch=arch, dtype=torch.float32,
                                             device="cpu"))
    prompts = [p for p in ([5, 9, 9, 9, 5, 9], [1, 2, 3, 1, 2, 3, 1], [42] * 6)
               for _ in range(4)]
    measure(eng, prompts, MODES[mode])
    steps = measure(eng, prompts, MODES[mode])
    spec = [s for s in steps if s.speculative]
    assert spec, "no speculative step ran"
    worst = max(spec, key=lambda s: s.count)
    assert worst.count <= SPEC_BUDGET, dict(worst.where)
