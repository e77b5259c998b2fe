"""``pretrain_rl_tlt.py --dry-run``: check a recipe against a world size and print the
parallel layout and a per-rank memory estimate, without loading any weights.

The architecture comes from the model folder's config.json when it exists here, else
from ``KNOWN_ARCHITECTURES`` (the public configs of the models the recipes name), so
a cluster recipe can be checked on a laptop.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config, ConfigError, validate_for_run

# Public config.json fields of models our recipes use (Hugging Face model cards).
KNOWN_ARCHITECTURES = {
    "Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen2.5-32B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}

GIB = 1024 ** 3


def _arch(cfg: Config):
    from ..models import arch_from_source
    from ..models.gpt import ModelArch

    name = str(cfg.model.hf_path or "")
    path = Path(name).expanduser()
    if name == "smollm2" or path.exists():
        from ..models import resolve_source

        return arch_from_source(resolve_source(name)), "config.json"
    key = path.name
    if key in KNOWN_ARCHITECTURES:
        return ModelArch.from_hf_config(KNOWN_ARCHITECTURES[key]), "built-in public config"
    raise ConfigError(
        f"model.hf_path={name!r} is not here and is not a known architecture "
        f"({', '.join(KNOWN_ARCHITECTURES)}); the dry run needs its config.json")


def dry_run(cfg: Config, world_size: int) -> str:
    """Validate ``cfg`` for ``world_size`` processes; return the report text."""
    from .trainer import check_layout, mini_batch_count

    arch, arch_from = _arch(cfg)
    validate_for_run(cfg, arch, world_size)
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    check_layout(cfg, dp)
    g, t = cfg.grpo, cfg.train
    m = mini_batch_count(cfg)
    on_gpu = cfg.platform.device != "cpu"
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(
        cfg.model.dtype, 2 if on_gpu else 4)
    params = arch.num_parameters
    shard = params / (tp * pp)
    weights = shard * dtype_bytes
    grads = shard * 4                            # fp32 main_grad buffers
    opt_shard = dp if on_gpu else 1              # distributed optimizer shards over DP
    optimizer = shard * (12 if dtype_bytes == 2 else 8) / opt_shard
    ref = weights if g.kl_beta > 0 else 0
    prompts_per_replica = g.prompts_per_step // dp
    seqs = min(prompts_per_replica * g.group_size, cfg.rollout.max_batch_size)
    capacity = cfg.data.max_prompt_tokens + g.max_new_tokens
    kv = (2 * (arch.num_layers // pp) * seqs * max(arch.num_query_groups // tp, 1)
          * capacity * arch.kv_channels * dtype_bytes)
    mb_tokens = t.micro_batch_tokens or t.micro_batch_size * capacity
    # activations without recomputation, rough: ~34 x hidden bytes per token per layer
    # (Korthikanti et al. 2022) / TP, plus the fp32 logits of the micro-batch
    acts = (mb_tokens * arch.hidden_size * 34 * (arch.num_layers // pp) / tp * dtype_bytes / 2
            + mb_tokens * arch.vocab_size / tp * 4 * 2)
    total = weights + grads + optimizer + ref + kv + acts
    lines = [
        f"recipe OK for world size {world_size}",
        f"model      : {cfg.model.hf_path} ({arch.model_type}, {params / 1e9:.2f}B params, "
        f"{arch.num_layers} layers, hidden {arch.hidden_size}; architecture from {arch_from})",
        f"layout     : TP {tp} x PP {pp} x DP {dp} = {world_size} ranks; a rollout replica "
        f"is {tp * pp} rank(s), {dp} replica(s)",
        f"per step   : {g.prompts_per_step} prompts x {g.group_size} samples = "
        f"{g.prompts_per_step * g.group_size} responses ({prompts_per_replica} prompts per "
        f"replica), {m} mini-batch(es) x {g.ppo_epochs} epoch(s) = {m * g.ppo_epochs} "
        f"optimizer step(s)",
        f"memory per rank (estimate, {dtype_bytes}-byte params):",
        f"  weights {weights / GIB:8.2f} GiB   grads (fp32) {grads / GIB:8.2f} GiB   "
        f"optimizer {optimizer / GIB:8.2f} GiB" + (" (sharded over DP)" if on_gpu else ""),
        f"  reference {ref / GIB:6.2f} GiB   rollout KV cache {kv / GIB:8.2f} GiB "
        f"({seqs} sequences x {capacity} positions)   activations {acts / GIB:8.2f} GiB",
        f"  total   {total / GIB:8.2f} GiB" + (
            "" if not on_gpu else "  (fits an 80 GiB GPU)" if total < 76 * GIB else
            "  (does NOT fit an 80 GiB GPU: lower rollout.max_batch_size, "
            "train.micro_batch_tokens or raise TP/PP)"),
    ]
    lines += rollout_memory_lines(arch, tp, pp, dtype_bytes, seqs, capacity,
                                  drafter=bool(cfg.rollout.speculative.drafter),
                                  mode=cfg.rollout.pipeline_mode)
    return "\n".join(lines)


def rollout_memory_lines(arch, tp: int, pp: int, dtype_bytes: int, seqs: int,
                         capacity: int, *, drafter: bool,
                         mode: str = "pipelined") -> list[str]:
    """The rollout engine's memory on each pipeline stage (one TP rank): the weights it
    reads in place (not extra), the KV cache of the stage's own layers for ``seqs``
    sequences of ``capacity`` positions, the float32 logits every stage receives from
    the last one (one decode step), and with a drafter the copies of the embedding /
    output layer the stages that do not own them receive. ``mode="gathered"``
    (``rollout.pipeline_mode``, PP > 1): every rank holds copies of the other stages'
    layers and of the vocabulary matrices it does not own, and the KV cache of all the
    layers for its share of the sequences."""
    h, v = arch.hidden_size, arch.padded_vocab_size(tp) // tp
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    per_layer = (h * (q + 2 * kvw) + q * h + 3 * h * arch.ffn_hidden_size) / tp + 2 * h
    layers = arch.num_layers // pp
    kv = 2 * layers * seqs * max(arch.num_query_groups // tp, 1) * capacity \
        * arch.kv_channels * dtype_bytes
    logits = seqs * arch.vocab_size * 4
    gathered = mode == "gathered" and pp > 1
    if gathered:
        share = -(-seqs // pp)
        kv = kv * pp * share // seqs
        logits = share * arch.vocab_size * 4
    out = [f"rollout memory per pipeline stage (one TP rank; {seqs} sequences x "
           f"{capacity} positions; weights read in place, not extra"
           + (f"; gathered: all layers, {-(-seqs // pp)} sequences per rank" if gathered
              else "") + "):"]
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        vocab_mats = int(first) + int(last and (pp > 1 or not arch.tie_word_embeddings))
        weights = (layers * per_layer + vocab_mats * v * h) * dtype_bytes
        copies = (2 - vocab_mats) * v * h * dtype_bytes if drafter and pp > 1 else 0
        if gathered:  # the other stages' layers, the vocabulary matrices not owned
            mats = (0 if first or (last and pp == 2) else 1) if arch.tie_word_embeddings \
                else int(not first) + int(not last)
            copies = ((pp - 1) * layers * per_layer + mats * v * h) * dtype_bytes
        extra = kv + logits + copies
        out.append(f"  stage {s}: layers {s * layers}-{(s + 1) * layers - 1}, weights "
                   f"{weights / GIB:7.2f} GiB; KV cache {kv / GIB:7.2f} GiB + logits "
                   f"{logits / GIB:5.2f} GiB" + (
                       f" + copies of the other stages' weights {copies / GIB:5.2f} GiB"
                       if gathered else f" + vocabulary copies for the drafter "
                       f"{copies / GIB:5.2f} GiB" if copies else "")
                   + f" = {extra / GIB:7.2f} GiB for the rollout")
    return out
