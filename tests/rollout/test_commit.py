"""The engine's commit of a speculative step (``RolloutEngine._commit``): each row's
tokens cut at a stop token or its length limit, the log-probs the acceptance did not
read computed as the per-row formula gives them (greedy, raw and processed requests in
one batch), the kept tokens' hidden states scattered into the response buffer, and its
device work one batch whose size does not grow with the rows (batch 2 against 8)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.scheduler import Row as _Row
from megatron_tlt.rollout.sampling import requested_logprobs
from megatron_tlt.rollout.speculative.acceptance import processed_rows
from megatron_tlt.rollout.speculative.emissions import Emission, Verified
from op_counter import OpCounter
from tiny_models import VOCAB, tiny_model_and_own_layer_drafter

STOP = 7
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=30),
          SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=30, seed=1),
          SamplingParams(temperature=0.7, top_k=5, max_new_tokens=30, seed=2,
                         logprobs="processed", stop_token_ids=[STOP]),
          SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)]  # cut by length


@pytest.fixture(scope="module")
def engine(tmp_path_factory, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    m, arch, _ = tiny_model_and_own_layer_drafter(tmp_path_factory.mktemp("commit"), "cpu")
    return RolloutEngine(m, None, RolloutConfig(cpu_kernels="false"), arch=arch,
                         eos_token_ids=[])


def _step(engine, b: int, seed: int = 0, read=()):
    """``b`` running rows (one response token each) and a step's emissions over a
    verification of 6 nodes per row: chains and tree paths of 1-4 tokens; row 2's
    emission has the stop token second. ``read``: rows whose log-probs the acceptance
    read (given on their emission)."""
    g = torch.Generator().manual_seed(seed)
    rows = [_Row(i, PARAMS[i % len(PARAMS)], None, 5 + i, [1, 2, 3, 4 + i], tokens=[9],
                 logprobs=[-1.0]) for i in range(b)]
    count, h = 6, engine.arch.hidden_size
    emissions = []
    for i in range(b):
        n = 1 + i % 4
        nodes = list(range(n)) if i % 2 else [0, 2, 3, 5][:n]
        toks = torch.randint(10, VOCAB, (n,), generator=g).tolist()
        if i % len(PARAMS) == 2 and n > 1:
            toks[1] = STOP
        lps = [float(-j - 0.5) for j in range(n)] if i in read else None
        emissions.append(Emission(toks, nodes, lps))
    logits = torch.randn(b * count, VOCAB, generator=g)
    plp = processed_rows(logits, [r for r in rows for _ in range(count)])
    verified = Verified(torch.randn(b * count, h, generator=g), logits, plp, [count] * b)
    hidden_buf = torch.zeros(b, 32, h)
    return rows, emissions, verified, hidden_buf


def _per_row_logprobs(rows, emissions, verified) -> list[list[float]]:
    """The per-row formula: each row's nodes' log-softmax, its processed log-probs."""
    out = []
    for i, (r, e) in enumerate(zip(rows, emissions)):
        idx = torch.tensor(e.nodes) + i * verified.counts[0]
        tok = torch.tensor(e.tokens)[:, None]
        x = verified.logits.index_select(0, idx).float()
        raw = torch.log_softmax(x, dim=-1).gather(-1, tok)[:, 0]
        processed = raw if r.params.greedy else \
            verified.plp.index_select(0, idx).gather(-1, tok)[:, 0]
        out.append(requested_logprobs(x, tok[:, 0], [r.params] * len(e.tokens), raw,
                                      processed).tolist())
    return out


def test_commit_cuts_rows_and_emits_like_the_per_row_formula(engine):
    b = 8
    rows, emissions, verified, hidden_buf = _step(engine, b, read={1, 4})
    want = _per_row_logprobs(rows, emissions, verified)
    kept = engine._commit(rows, hidden_buf, emissions, verified)
    for i, (r, e, m) in enumerate(zip(rows, emissions, kept)):
        n = len(e.tokens)
        if i % len(PARAMS) == 2 and n > 1:
            assert m == 2  # up to the stop token
        elif i % len(PARAMS) == 3:
            assert m == min(n, 3)  # max_new_tokens 4, one token before the step
        else:
            assert m == n
        assert r.tokens == [9] + e.tokens[:m] and r.length == 5 + i + m
        lps = e.logprobs if e.logprobs is not None else want[i]
        assert r.logprobs == [-1.0] + lps[:m]  # bit-identical
        for j in range(32):
            got = hidden_buf[i, j]
            if 1 <= j <= m:
                node = i * verified.counts[0] + e.nodes[j - 1]
                assert torch.equal(got, verified.hidden[node])
            else:
                assert not got.any()  # nothing written beyond the kept tokens


def test_commit_device_work_does_not_grow_with_the_rows(engine):
    counts = {}
    for b in (2, 8):
        rows, emissions, verified, hidden_buf = _step(engine, b)
        with OpCounter() as ops:
            engine._commit(rows, hidden_buf, emissions, verified)
        counts[b] = ops.count
        assert ops.count > 0
    assert counts[8] == counts[2], counts
