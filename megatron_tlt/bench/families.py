"""Rollout engine vs transformers ``generate`` on small random Qwen3 and Qwen3-MoE
models (``tools/bench_moe.py --part speed``).

Each model: float32 on CPU, greedy, exactly ``new_tokens`` tokens per sequence (EOS
ignored), batches of 1, 8 and 32 random prompts of 16-64 tokens. transformers runs the
batch left-padded with its attention mask; the engine its own continuous batch. The two
run interleaved (warm-up, then A, B, A, B, ...) so machine drift hits both; each pair
gives a throughput ratio (engine tokens/s over transformers tokens/s) and the median
is reported. Greedy tokens are compared too (``same_tokens``: the share of sequences
identical to transformers'; left padding changes transformers' float32 rounding, so a
near-tie may differ).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .replay_mismatch import save_random

# the engine at the sizes the issue names: a tiny-to-small Qwen3 (head_dim 96 != 512 / 8)
# and a Qwen3-MoE of the same attention (16 experts, top-4, every layer sparse)
QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=32000,
             hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=96, rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=2048, tie_word_embeddings=True)
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                 moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
BATCHES = (1, 8, 32)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(16, 65, (n,), generator=g)]


def _hf_generate(hf, prompts, new_tokens: int) -> tuple[list, float]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist(), time.perf_counter() - t0


def _engine_generate(engine, prompts, new_tokens: int) -> tuple[list, float]:
    from ..rollout import SamplingParams

    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                   ignore_eos=True))
    return [o.token_ids for o in outs], time.perf_counter() - t0


def one_model(folder: Path, new_tokens: int, reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ..config import RolloutConfig
    from ..models import load_model
    from ..rollout import RolloutEngine

    model, arch = load_model(folder, device=torch.device("cpu"), dtype="float32")
    engine = RolloutEngine(model, None, RolloutConfig(max_batch_size=max(BATCHES)),
                           arch=arch, eos_token_ids=[])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = {}
    for batch in BATCHES:
        prompts = _prompts(batch, arch.vocab_size, seed=batch)
        _engine_generate(engine, prompts, 4)  # warm-up (kernels, calibration, caches)
        _hf_generate(hf, prompts, 4)
        ratios, eng_s, hf_s = [], [], []
        for _ in range(reps):
            ours, te = _engine_generate(engine, prompts, new_tokens)
            ref, th = _hf_generate(hf, prompts, new_tokens)
            ratios.append(th / te)  # same tokens: tok/s ratio = time ratio
            eng_s.append(te)
            hf_s.append(th)
        tokens = batch * new_tokens
        rows[str(batch)] = {
            "ratio": statistics.median(ratios), "ratios": ratios,
            "engine_tok_s": tokens / statistics.median(eng_s),
            "transformers_tok_s": tokens / statistics.median(hf_s),
            "same_tokens": sum(a == b for a, b in zip(ours, ref)) / batch}
        print(f"{arch.model_type:>9} batch {batch:>2}: engine {rows[str(batch)]['engine_tok_s']:.1f}"
              f" tok/s, transformers {rows[str(batch)]['transformers_tok_s']:.1f} tok/s, "
              f"ratio {rows[str(batch)]['ratio']:.2f}x", flush=True)
    return {"model": arch.model_type, "parameters": arch.num_parameters, "batches": rows,
            "min_ratio": min(r["ratio"] for r in rows.values())}


def run(root: Path, *, new_tokens: int, reps: int, threads: int) -> dict:
    from ..rollout.cpu_kernels import cpu_model

    out = {"part": "speed", "threads": threads, "cpu": cpu_model(), "new_tokens": new_tokens,
           "models": {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}, "results": []}
    for name, cfg in (("qwen3", QWEN3), ("qwen3_moe", QWEN3_MOE)):
        out["results"].append(one_model(save_random(root / name, cfg), new_tokens, reps))
    return out
