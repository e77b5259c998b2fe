"""One prefill per prompt (rollout.share_prefill): a GRPO-shaped call (G requests per
prompt) runs each distinct prompt through the model once, and every output equals the
engine's without sharing (every request prefilled): greedy, standard sampling with a
seed and with request seeds, coupled sampling, returned hidden states, refill with a
running batch smaller than the call, chain and tree speculation with the one-layer
EAGLE drafter and with the self-drafter. Tiny random models, single process (TP=2 and
PP=2 are in test_rollout_tp.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from tiny_models import TINY_CONFIGS, VOCAB, random_eagle

G = 4  # responses per prompt


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in TINY_CONFIGS}


def _unique(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _groups(prompts, g=G) -> list[list[int]]:
    """Each prompt ``g`` times in a row, as the RL rollout asks for them."""
    return [p for p in prompts for _ in range(g)]


def _engine(model, arch, share, drafter=None, strategy=None, **cfg) -> RolloutEngine:
    if strategy is not None:
        cfg["speculative"] = SpeculativeConfig(policy="fixed", strategy=strategy,
                                               threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(share_prefill=share, **cfg), arch=arch,
                        eos_token_ids=[])
    if drafter is not None:
        eng.attach_drafter(drafter)
    return eng


def _both(make, prompts, params, **kw):
    """(outputs, stats) without and with sharing, on engines made by ``make(share)``."""
    out = []
    for share in (False, True):
        eng = make(share)
        out.append((eng.generate(prompts, params, **kw), eng.last_stats))
    return out


def _assert_same(a, b, tol=1e-5):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) <= tol
        if x.hidden_states is not None or y.hidden_states is not None:
            assert (x.hidden_states - y.hidden_states).abs().max().item() <= tol


# ------------------------------------------------------------------------ prefill work
def test_a_group_batch_prefills_each_prompt_once_with_the_same_outputs(tiny):
    """4 prompts x G responses (greedy, different lengths so rows finish and move):
    the prefill runs exactly the unique prompts' tokens (equal lengths: no padding),
    1/G of the unshared engine's, and every output is the same."""
    model, arch = tiny["llama_tied"]
    unique = _unique((7, 7, 7, 7))
    prompts = _groups(unique)
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + i % 5,
                             return_hidden_states=True) for i in range(len(prompts))]
    (old, s_old), (new, s_new) = _both(lambda s: _engine(model, arch, s), prompts, params)
    _assert_same(old, new)
    assert s_old.prefill_tokens == sum(len(p) for p in prompts)
    assert s_new.prefill_tokens == sum(len(p) for p in unique)
    assert s_new.prefill_tokens / s_old.prefill_tokens <= 1 / G + 0.05
    assert s_new.prefill_shared_rows == len(prompts) - len(unique)
    assert s_old.prefill_shared_rows == 0
    assert s_new.summary()["prefill_shared_rows"] == len(prompts) - len(unique)


@pytest.mark.parametrize("max_batch", [3, 5])
def test_refill_shares_with_running_rows_and_outputs_do_not_change(tiny, max_batch):
    """A running batch smaller than the call (3 or 5 rows for 3 x G requests whose
    responses end at different steps): groups enter over several admissions; later
    requests copy a running row's prefill, so the prefill work stays at the unique
    prompts' (of one length: no padding to count)."""
    model, arch = tiny["qwen2"]
    unique = _unique((6, 6, 6), seed=1)
    prompts = _groups(unique)
    # long-lived first responses keep every group's prompt held while it enters
    params = [SamplingParams(temperature=0.0, max_new_tokens=12 if i % G == 0 else 2 + i % 3)
              for i in range(len(prompts))]
    (old, s_old), (new, s_new) = _both(
        lambda s: _engine(model, arch, s, max_batch_size=max_batch), prompts, params)
    _assert_same(old, new)
    assert max(s_new.batch_sizes) <= max_batch
    assert s_old.prefill_tokens >= sum(len(p) for p in prompts)
    assert s_new.prefill_tokens == sum(len(p) for p in unique)
    assert s_new.prefill_shared_rows == len(prompts) - len(unique)


def test_a_prompt_whose_rows_all_finished_is_prefilled_again(tiny):
    """One row at a time: each request of a group starts after the previous one
    finished, so nothing holds the prompt and each is prefilled (nothing is kept
    beyond the running rows)."""
    model, arch = tiny["llama_tied"]
    prompts = _groups(_unique((6,)), 3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    (old, s_old), (new, s_new) = _both(
        lambda s: _engine(model, arch, s, max_batch_size=1), prompts, sp)
    _assert_same(old, new)
    assert s_new.prefill_tokens == s_old.prefill_tokens == 18
    assert s_new.prefill_shared_rows == 0


def test_interleaved_duplicates_and_distinct_prompts(tiny):
    """Duplicates need not be adjacent, and distinct prompts run as before."""
    model, arch = tiny["llama_untied"]
    a, b, c = _unique((4, 8, 5), seed=2)
    prompts = [a, b, a, c, b, a]
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    (old, _), (new, s_new) = _both(lambda s: _engine(model, arch, s), prompts, sp)
    _assert_same(old, new)
    assert s_new.prefill_shared_rows == 3
    # 3 distinct prompts padded to the longest in one chunk
    assert s_new.prefill_tokens == 3 * 8
    (old, s_old), (new, s_new) = _both(lambda s: _engine(model, arch, s), [a, b, c], sp)
    _assert_same(old, new)
    assert s_new.prefill_tokens == s_old.prefill_tokens and s_new.prefill_shared_rows == 0


# ------------------------------------------------------------------------ sampling modes
@pytest.mark.parametrize("mode", ["seed", "request_seeds", "coupled"])
def test_sampled_groups_keep_each_request_its_own_stream(tiny, mode):
    """Sampled responses of one prompt differ from each other (each copy samples with
    its own random stream or noise key) and equal the unshared engine's, token for token."""
    model, arch = tiny["llama_tied"]
    prompts = _groups(_unique((6, 6, 6), seed=3))
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=7)
    kw = {"request_seeds": [1000 + 7 * i for i in range(len(prompts))]} \
        if mode == "request_seeds" else {}
    cfg = {"sampling_mode": "coupled"} if mode == "coupled" else {}
    (old, _), (new, s_new) = _both(lambda s: _engine(model, arch, s, **cfg), prompts, sp,
                                   **kw)
    _assert_same(old, new)
    assert s_new.prefill_shared_rows == len(prompts) - 3
    group = [tuple(o.token_ids) for o in new[:G]]
    assert len(set(group)) > 1  # the copies did not share a random stream


# ------------------------------------------------------------------------ speculation
@pytest.mark.parametrize("drafter", ["eagle", "self"])
@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_speculation_with_shared_prefill_is_unchanged(tiny, drafter, strategy, temperature):
    """Speculative decoding from copied prefills (the EAGLE drafter reads the copied
    prompt features; the self-drafter catches up on the prompt in its own cache):
    the same tokens as without sharing, chains and trees, greedy and sampled, with a
    running batch smaller than the call (copies from running rows)."""
    model, arch = tiny["llama_tied"]
    prompts = _groups(_unique((5, 11, 8), seed=4), 3)
    sp = SamplingParams(temperature=temperature, max_new_tokens=10, seed=5,
                        return_hidden_states=True)

    def make(share):
        d = random_eagle(arch) if drafter == "eagle" else SelfDrafter()
        return _engine(model, arch, share, d, strategy, max_batch_size=5)

    (old, s_old), (new, s_new) = _both(make, prompts, sp)
    _assert_same(old, new, tol=1e-4)
    assert s_new.spec.steps > 0 and s_new.prefill_shared_rows > 0
    assert s_new.prefill_tokens < s_old.prefill_tokens


# ------------------------------------------------------------------------ PP = 2, gathered
def test_gathered_stages_split_the_requests_by_prompt():
    """rollout.pipeline_mode=gathered with sharing: each stage decodes a contiguous block
    of the requests grouped by prompt (a group stays on one stage where the block sizes
    allow), the blocks as even as the strided split's; without sharing the split is the
    strided one."""
    from megatron_tlt.rollout.gathered import share_of

    a, b, c = [1, 2], [3], [4, 5, 6]
    prompts = [a, b, a, c, b, a, c, b]  # 3 a, 3 b, 2 c, interleaved
    for stages in (2, 3):
        for grouped in (False, True):
            parts = [share_of(prompts, stages, r, grouped) for r in range(stages)]
            assert sorted(i for p in parts for i in p) == list(range(len(prompts)))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [share_of(prompts, 2, r, False) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # grouped: a a a b | b b c c (the b group split at the one boundary)
    assert [share_of(prompts, 2, r, True) for r in range(2)] == [[0, 2, 5, 1], [4, 7, 3, 6]]
    groups = [p for p in (a, b, c, [7]) for _ in range(4)]  # 4 groups of 4: none split
    for r in range(2):
        part = share_of(groups, 2, r, True)
        assert len({tuple(groups[i]) for i in part}) == 2


def test_two_drafter_kinds_get_the_copied_prompt(tiny):
    """Both kinds side by side (speculative/kinds.py): every kind's state follows the
    copies; coupled responses, the same whichever kind drafts, equal the unshared
    engine's, and so do the returned hidden states, read from the one-layer drafter's
    feature store (the first one is a copied prompt feature)."""

    model, arch = tiny["llama_tied"]
    prompts = _groups(_unique((7, 4), seed=8), 3)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=6,
                        return_hidden_states=True)
    outs, stats = [], []
    for share in (False, True):
        sc = SpeculativeConfig(threshold=64, buckets="1,4", arms="*:3_1_3,3_2_5")
        eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, share_prefill=share,
                                                       sampling_mode="coupled"),
                            arch=arch, eos_token_ids=[])
        eng.attach_drafters({"eagle": random_eagle(arch), "self": SelfDrafter()}, epsilon=0.5)
        assert eng.memory.features_serve()
        outs.append(eng.generate(prompts, sp))
        stats.append(eng.last_stats)
    _assert_same(outs[0], outs[1])
    assert stats[1].prefill_shared_rows == 4 and stats[1].spec.steps > 0
