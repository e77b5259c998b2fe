"""megatron-core's memory controls on CUDA: ``python -m pytest tests_gpu``.

What the CPU suite cannot show: the memory. Recomputation (selective, full) in bf16
with the local and (when installed) Transformer Engine specs leaves the loss and the
gradient norm unchanged and lowers ``torch.cuda.max_memory_allocated``; the chunked
log-prob / entropy path keeps its peak a fraction of the unchunked one at a realistic
vocabulary width; sequence parallelism over NCCL at TP=2 equals TP=2 without it (needs
two GPUs: skipped with the reason on a one-GPU machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tlt.models import MemoryControls, load_model
from megatron_tlt.models.gpt import te_available
from tiny_models import save_tiny_hf

CUDA = torch.device("cuda", 0)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    return save_tiny_hf("llama_tied", tmp_path_factory.mktemp("memctl") / "m",
                        max_position_embeddings=4096, hidden_size=256,
                        intermediate_size=512, num_attention_heads=8,
                        num_key_value_heads=4)


def _step(model_dir, granularity, impl):
    """(loss, grad norm, peak bytes above the weights) of one bf16 forward/backward."""
    from megatron_tlt.rl.token_stats import token_stats

    model, arch = load_model(model_dir, device=CUDA, dtype="bfloat16", impl=impl,
                             memory=MemoryControls(granularity, "uniform", 1))
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (4, 2048), generator=gen).to(CUDA)
    pos = torch.arange(2048, device=CUDA).unsqueeze(0).expand(4, -1)
    mask = torch.ones(4, 2048, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = model(ids, pos, attention_mask=None)
    logp, _ = token_stats(logits, torch.roll(ids, -1, 1), mask, vocab_size=arch.vocab_size,
                          chunk_tokens=1024)
    loss = logp.sum() / mask.sum()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters()
                          if p.grad is not None))
    return float(loss), float(norm), peak


@pytest.mark.parametrize("impl", ["local", pytest.param("transformer_engine", marks=(
    pytest.mark.skipif(not te_available(), reason="Transformer Engine not installed")))])
def test_recomputation_on_cuda_lowers_peak_memory(parallel, long_context_model, impl):
    runs = {g: _step(long_context_model, g, impl) for g in ("none", "selective", "full")}
    loss0, norm0, peak0 = runs["none"]
    for g in ("selective", "full"):
        loss, norm, _ = runs[g]
        assert loss == pytest.approx(loss0, rel=1e-3), g
        assert norm == pytest.approx(norm0, rel=1e-2), g
    print({g: round(r[2] / 2**20, 1) for g, r in runs.items()}, "MiB peak")
    assert runs["full"][2] < runs["selective"][2]
    if impl == "local":  # unfused attention keeps the scores: selective must drop them
        assert runs["selective"][2] < peak0
    else:  # fused attention keeps no scores: selective can only save little
        assert runs["selective"][2] <= 1.05 * peak0


def test_chunked_loss_peak_is_a_fraction_of_unchunked(parallel):
    from megatron_tlt.models.gpt import ModelArch
    from megatron_tlt.models.inference import token_logprobs
    from megatron_tlt.rl.grpo import vocab_parallel_entropy
    from megatron_tlt.rl.token_stats import token_stats

    n, v = 4096, 65536
    arch = ModelArch("llama", v, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, 64, True, False)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    logits = torch.randn(1, n, v, device=CUDA, generator=gen, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (1, n), device=CUDA, generator=gen)
    mask = torch.ones(1, n, device=CUDA)
    peaks, grads, values = {}, {}, {}
    for name in ("unchunked", "chunked"):
        x = logits.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if name == "unchunked":
            logp = token_logprobs(x, targets, arch, 0.9)
            ent = vocab_parallel_entropy(x.detach().float() / 0.9, vocab_size=v)
        else:
            logp, ent = token_stats(x, targets, mask, vocab_size=v, temperature=0.9,
                                    chunk_tokens=512)
        logp.sum().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        grads[name], values[name] = x.grad.float(), (logp.detach(), ent.detach())
    print({k: round(p / 2**20) for k, p in peaks.items()}, "MiB peak")
    torch.testing.assert_close(values["chunked"][0], values["unchunked"][0],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values["chunked"][1], values["unchunked"][1],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads["chunked"], grads["unchunked"], rtol=2e-2, atol=1e-6)
    # the logits' gradient (bf16, n x v) is inevitable; fp32 copies of n x v are not
    assert peaks["chunked"] < 0.5 * peaks["unchunked"], peaks


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="sequence parallelism over NCCL needs TP=2: two GPUs")
def test_sequence_parallel_over_nccl_equals_plain_tp2(tmp_path):
    model = save_tiny_hf("llama_tied", tmp_path / "m")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2",
                        str(REPO / "tests" / "support" / "mp_sequence_parallel_worker.py"),
                        "--model", str(model), "--out", str(out), "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for k in range(2):
        res = json.loads((out / f"rank{k}.json").read_text())
        for name in ("sp", "sp_full", "sp_selective"):
            assert res[name]["sequence_parallel"]
            assert res[name]["loss"] == pytest.approx(res["plain"]["loss"], rel=2e-2)
            assert res[name]["grad_norm"] == pytest.approx(res["plain"]["grad_norm"],
                                                           rel=5e-2)
