"""Engine vs trainer log-prob mismatch of a mixture-of-experts policy, with and without
routing replay (``tools/bench_moe.py --part replay``).

The rollout engine samples responses (bf16 on CPU here: its eager path, batch of the
rollout) and records each position's experts; the trainer's forward (megatron-core's
GPTModel, the same bf16 weights, micro-batches of padded samples as the update runs
them) computes the same tokens' log-probs. Per response token:

- |Δ log p| = |log p_trainer - log p_engine| (raw log-softmax at T = 1);
- a flipped route: a (token, MoE layer) whose set of k experts differs between the two
  forwards (the trainer's read from its routers' routing maps), and the share of tokens
  with at least one flipped layer.

Rows: the MoE model without replay (the trainer's routers choose), with replay (the
rollout's experts forced, ``models.moe_replay``), and a dense model of the same
attention and width (Qwen3 with one dense MLP of the MoE's active width) as the level a
model without routing reaches.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from ..models import MoeOptions, load_model, moe_replay
from ..models.inference import forward_local_logits, token_logprobs

# A small Qwen3-MoE and its dense counterpart (random weights, like a pretrained
# router's spread: logits with std ~1 over the experts)
MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=4096,
           hidden_size=256, intermediate_size=768, moe_intermediate_size=192,
           num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
           rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=1024,
           tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
DENSE = dict(MOE, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
             intermediate_size=768)


def save_random(folder: Path, config: dict, seed: int = 0) -> Path:
    """An HF folder of ``config`` with random weights (transformers' classes)."""
    import transformers as tf

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    cfg_cls, model_cls = {"qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[config["model_type"]]
    torch.manual_seed(seed)
    spec = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    model = model_cls(cfg_cls(**spec))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):  # router: logits of std ~1
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.8 / math.sqrt(p.shape[-1]))
    model.save_pretrained(folder)
    return folder


def _routing_maps(model):
    """Forward hooks keeping each router's routing map per forward, by MoE layer."""
    maps: dict[int, list] = {}
    hooks = []
    for layer, router in moe_replay.routers(model):
        hooks.append(router.register_forward_hook(
            lambda m, i, out, layer=layer: maps.setdefault(layer, []).append(out[1])))
    return maps, hooks


def measure(folder: Path, *, prompts: int, new_tokens: int, micro_batch: int,
            replay: Optional[bool], seed: int = 0) -> dict:
    """One row of the table: |Δ log p| and route flips between the bf16 engine and the
    bf16 trainer forward (``replay``: True / False for an MoE model, None for dense)."""
    from ..config import RolloutConfig
    from ..rollout import RolloutEngine, SamplingParams

    model, arch = load_model(folder, device=torch.device("cpu"), dtype="bfloat16",
                             moe=MoeOptions(routing_replay=bool(replay)))
    gen = torch.Generator().manual_seed(seed)
    ps_ = [torch.randint(0, arch.vocab_size, (int(n),), generator=gen).tolist()
           for n in torch.randint(8, 48, (prompts,), generator=gen)]
    engine = RolloutEngine(model, None, RolloutConfig(cpu_kernels="false"), arch=arch,
                           eos_token_ids=[])
    outs = engine.generate(ps_, SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                               seed=seed, ignore_eos=True))
    diffs, flips, token_flips, layers = [], 0, 0, len(arch.moe_layers)
    for lo in range(0, len(outs), micro_batch):
        chunk = outs[lo: lo + micro_batch]  # a micro-batch: right-padded sequences
        s = max(len(o.prompt_token_ids) + len(o.token_ids) for o in chunk)
        b = len(chunk)
        ids = torch.zeros(b, s, dtype=torch.long)
        for r, o in enumerate(chunk):
            seq = list(o.prompt_token_ids) + list(o.token_ids)
            ids[r, :len(seq)] = torch.tensor(seq)
        targets = torch.roll(ids, -1, 1)
        maps, hooks = _routing_maps(model) if arch.is_moe else ({}, [])
        with torch.no_grad():
            if replay:
                moe_replay.set_routes(model, moe_replay.aligned(chunk, s), arch.moe_layers)
            lp = token_logprobs(forward_local_logits(model, ids), targets, arch)
            moe_replay.clear(model)
        for h in hooks:
            h.remove()
        for r, o in enumerate(chunk):
            p, n = len(o.prompt_token_ids), len(o.token_ids)
            diffs.append((lp[r, p - 1:p - 1 + n].float() - torch.tensor(o.logprobs)).abs())
            if not arch.is_moe:
                continue
            # the trainer's experts at the positions whose logits score the response
            mine = torch.stack([maps[layer][0].view(s, b, -1)[p - 1:p - 1 + n, r]
                                for layer in arch.moe_layers], dim=1)  # [n, L, E]
            rec = torch.zeros_like(mine).scatter_(2, o.routes[p - 1:p - 1 + n].long(), True)
            differs = (mine != rec).any(-1)  # [n, L]
            flips += int(differs.sum())
            token_flips += int(differs.any(-1).sum())
    d = torch.cat(diffs)
    tokens = d.numel()
    return {"model": arch.model_type, "replay": replay, "tokens": tokens,
            "mean_abs_dlogp": float(d.mean()), "p99_abs_dlogp": float(d.quantile(0.99)),
            "max_abs_dlogp": float(d.max()),
            "flipped_route_share": flips / (tokens * layers) if arch.is_moe else None,
            "tokens_with_a_flip_share": token_flips / tokens if arch.is_moe else None}
