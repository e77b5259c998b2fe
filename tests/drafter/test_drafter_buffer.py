"""The drafter group's DataBuffer: one-step offset, token budget, packed batches with
no attention across samples, and the online (x_{t+1}, h_t) pairing equal to decoding's."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.drafter_training.buffer import BufferedResponse, DataBuffer
from megatron_tlt.drafter_training.losses import drafter_pairs
from megatron_tlt.drafter_training.trainer import target_features
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.config import RolloutConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from tiny_models import VOCAB


def _rec(step: int, prompt: int, resp: int, h: int = 4, seed: int = 0) -> BufferedResponse:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50, (prompt + resp,), generator=g).tolist()
    return BufferedResponse(toks, prompt, torch.randn(resp, h, generator=g), step)


def test_one_step_offset_keeps_the_previous_steps_responses():
    buf = DataBuffer(budget_tokens=10_000)
    buf.add(0, [_rec(0, 3, 40), _rec(0, 3, 5)])
    buf.add(1, [_rec(1, 3, 6)])
    assert buf.steps == [0, 1] and len(buf) == 3  # step 0's long response still here
    buf.add(2, [_rec(2, 3, 7)])
    assert buf.steps == [1, 2] and buf.tokens == 13


def test_token_budget_drops_oldest_first_and_is_never_exceeded():
    buf = DataBuffer(budget_tokens=50)
    buf.add(0, [_rec(0, 2, 20, seed=1), _rec(0, 2, 20, seed=2)])
    buf.add(1, [_rec(1, 2, 25, seed=3)])
    assert buf.tokens <= 50
    assert [r.step for r in buf] == [0, 1] and buf.dropped == 1
    buf.add(1, [_rec(1, 2, 60)])  # longer than the whole budget: refused
    assert buf.tokens <= 50 and buf.dropped == 2
    buf.add(1, [_rec(1, 2, 1)])  # one feature row gives no pair: skipped
    assert len(buf) == 2


def test_packed_batches_cover_every_response_within_the_token_budget():
    buf = DataBuffer(budget_tokens=10_000)
    lengths = [3, 50, 7, 7, 12, 30, 2, 9]
    buf.add(0, [_rec(0, 4, n, seed=i) for i, n in enumerate(lengths)])
    plan = buf.plan(batch_tokens=40)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        width = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * width <= 40
    it = buf.batches(batch_tokens=40, seed=3)
    epoch = [next(it) for _ in range(len(plan))]
    seen = sorted(len(s.tokens) for batch in epoch for s in batch)
    assert seen == sorted(lengths)  # each response once per epoch (segment = R tokens)
    again = buf.batches(batch_tokens=40, seed=3)
    assert [[s.tokens for s in next(again)] for _ in range(3)] == \
        [[s.tokens for s in b] for b in epoch[:3]]  # seeded: the same order on every rank
    assert list(DataBuffer(10).batches(40)) == []


def test_bad_records_name_the_problem():
    with pytest.raises(ValueError, match="feature row"):
        BufferedResponse([1, 2, 3, 4], 2, torch.zeros(3, 4), 0)


def test_batched_rows_do_not_attend_across_samples(tiny_llama):
    model, arch = tiny_llama
    drafter = EagleDrafter(DrafterConfig.for_target(arch), arch)
    buf = DataBuffer(budget_tokens=10_000)
    recs = [_rec(0, 2, n, h=arch.hidden_size, seed=n) for n in (5, 9, 3)]
    buf.add(0, recs)
    (batch,) = buf.plan(batch_tokens=1000)
    samples = [buf.sample(3)[i].draft_sample() for i in batch]
    n = max(len(s.tokens) for s in samples) - 1
    emb = torch.zeros(len(samples), n, arch.hidden_size)
    feat = torch.zeros(len(samples), n, arch.hidden_size)
    embed_w = model.embedding.word_embeddings.weight.detach()
    for i, s in enumerate(samples):
        nxt, f = drafter_pairs(s.tokens, s.features)
        emb[i, : len(nxt)] = torch.nn.functional.embedding(nxt, embed_w)
        feat[i, : len(nxt)] = f
    with torch.no_grad():
        together = drafter(emb, feat, model.rotary_pos_emb(n))
        for i, s in enumerate(samples):
            m = len(s.tokens) - 1
            alone = drafter(emb[i:i + 1, :m], feat[i:i + 1, :m], model.rotary_pos_emb(m))
            assert torch.allclose(together[i, :m], alone[0], atol=1e-5)


def test_online_pairs_equal_the_pairs_decoding_uses(tiny_llama):
    """The engine's returned hidden states, buffered, give exactly the (s_{p+1}, h_p)
    -> h_{p+1} pairs that drafter_pairs makes from the full sequence's features (the
    pairing decoding feeds the drafter), restricted to the response segment."""
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 7)]
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=9, seed=1,
                                                return_hidden_states=True))
    for o in outs:
        rec = BufferedResponse.from_output(o, step=0)
        s = rec.draft_sample()
        seq = o.prompt_token_ids + o.token_ids
        full, _ = target_features(eng.runner, [seq])[0]
        nxt_full, f_full = drafter_pairs(seq, full)
        P, N = len(o.prompt_token_ids), len(seq)
        nxt, f = drafter_pairs(s.tokens, s.features)
        assert nxt.tolist() == nxt_full[P - 1: N - 2].tolist()
        assert torch.allclose(f, f_full[P - 1: N - 2], atol=1e-4)
        # targets: h_{p+1}
        assert torch.allclose(s.final_hidden[1:], full[P: N - 1], atol=1e-4)
        # a shifted pairing would not match
        assert not torch.allclose(f[1:], f_full[P - 1: N - 3], atol=1e-3)
