"""The chunked log-prob / entropy path of the loss: values and gradients equal the
unchunked megatron-core computation (vocab-parallel cross-entropy, entropy on whole
rows) at any chunk size, with a temperature, vocabulary padding and an entropy bonus;
at TP=2 (torchrun, gloo) each rank's gradient is its slice of the TP=1 gradient; and
no fp32 temporary larger than one chunk is kept for the backward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cli import run_workers
from token_stats_cases import VOCAB, case

def reference(logits, targets, mask, T, w_logp, w_ent, entropy_grad):
    """The unchunked path: megatron-core's cross-entropy and entropy of whole rows."""
    from megatron_tlt.models.gpt import ModelArch
    from megatron_tlt.models.inference import token_logprobs
    from megatron_tlt.rl.grpo import vocab_parallel_entropy

    arch = ModelArch("llama", VOCAB, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, 64, True, False)
    logp = token_logprobs(logits, targets, arch, T) * mask
    x = logits if entropy_grad else logits.detach()
    ent = vocab_parallel_entropy(x.float() / T, vocab_size=VOCAB) * mask
    loss = (w_logp * logp).sum() + (w_ent * ent).sum() * float(entropy_grad)
    return loss, logp, ent


def chunked(logits, targets, mask, T, w_logp, w_ent, entropy_grad, chunk):
    from megatron_tlt.rl.token_stats import token_stats

    logp, ent = token_stats(logits, targets, mask, vocab_size=VOCAB, temperature=T,
                            chunk_tokens=chunk, entropy_grad=entropy_grad)
    loss = (w_logp * logp).sum() + (w_ent * ent).sum() * float(entropy_grad)
    return loss, logp, ent


@pytest.mark.parametrize("chunk", [0, 1, 3, 64])
@pytest.mark.parametrize("T,entropy_grad", [(1.0, False), (0.7, True), (1.3, False)])
def test_chunked_equals_unchunked(single_process_parallel, chunk, T, entropy_grad):
    logits, targets, mask, w_logp, w_ent = case()
    results = []
    for fn, extra in ((reference, ()), (chunked, (chunk,))):
        x = logits.clone().requires_grad_(True)
        loss, logp, ent = fn(x, targets, mask, T, w_logp, w_ent, entropy_grad, *extra)
        loss.backward()
        results.append((logp.detach(), ent.detach(), x.grad))
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert (lp1[mask == 0] == 0).all() and (e1[mask == 0] == 0).all()
    assert (g1.reshape(-1, 40)[(mask == 0).reshape(-1)] == 0).all()  # prompt, padding
    assert (g1[..., VOCAB:] == 0).all()  # padding columns


def test_bfloat16_logits_keep_their_dtype_and_match(single_process_parallel):
    logits, targets, mask, w_logp, w_ent = case(1, torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    loss, logp, _ = chunked(x, targets, mask, 1.0, w_logp, w_ent, False, 4)
    loss.backward()
    assert logp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    y = logits.float().requires_grad_(True)
    loss_ref, logp_ref, _ = reference(y, targets, mask, 1.0, w_logp, w_ent, False)
    loss_ref.backward()
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.float(), y.grad, rtol=2e-2, atol=2e-3)


def test_only_one_chunk_of_fp32_is_kept_for_backward(single_process_parallel):
    """Saved for backward: the logits themselves (by reference) and per-token vectors;
    the unchunked path keeps fp32 [tokens, V] softmax rows."""
    logits, targets, mask, w_logp, w_ent = case()
    x = logits.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked(x, targets, mask, 0.7, w_logp, w_ent, True, 2)
    n = int(mask.sum())
    big = [t for t in saved if t.numel() >= n * 40]
    assert all(t.data_ptr() == x.data_ptr() for t in big), [tuple(t.shape) for t in big]
    assert sum(t.numel() for t in saved if t.data_ptr() != x.data_ptr()) < 10 * 2 * 9


@pytest.mark.multiproc
def test_tensor_parallel_chunks_equal_one_process(tmp_path):
    """TP=2: each rank's log-probs, entropies and its vocabulary slice of the gradient
    equal the one-process values."""
    worker = Path(__file__).resolve().parents[1] / "support" / "mp_token_stats_worker.py"
    results = run_workers(str(worker.relative_to(worker.parents[2])), tmp_path, nproc=2)
    for res in results:
        assert res["max_abs_diff"] < 1e-5 and res["grad_norm"] > 0, res


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
