"""The dry run's memory terms of a mixture-of-experts policy (none for a dense model):
what experts, routing and expert parallelism add to ``memory_model``'s terms, as
(name, bytes, phase, basis, note) tuples it turns into ``Term``s.

The parameters themselves are counted by ``models.sizes.stage_params`` at the run's
expert-parallel size (each rank holds ``num_experts / EP`` experts of every MoE layer,
the router replicated), and so are the weights, gradient buffers, Adam moments and the
reference copy built from them. At EP > 1 the rollout engine decodes the EP group's
requests together (``rollout/expert_call.py``), so its rows, KV cache, logits and
drafters' caches are the group's union (``memory_model.settings``: ``rollout_rows``).
Here, beside those:

- resident: with the distributed optimizer the experts' fp32 master and moments are
  sharded over the expert-data-parallel group (DP / EP ranks), not over DP;
- rollout: the engine's stacked copy of this rank's experts (``experts.StackedExperts``,
  re-made at every ``generate``, freed with the KV cache) and the experts recorded per
  position beside the keys (int16 [MoE layers, rows, capacity, k], ``KVCache.routes``);
- update, per micro-batch of T positions and each MoE layer of the stage whose
  activations are kept (all of them, or under full recomputation the chunk rebuilt in
  the backward): the router's float32 logits and scores and its routing map [T, E]
  and top-k weights [T, k]; the all-to-all dispatcher's permuted tokens [T·k, h] kept
  for the experts' backward and the experts' outputs kept for the unpermute's weighting
  (and at EP > 1 the received copy), instead of a dense MLP's T tokens the experts'
  activations for T·k routed tokens of width ``moe_ffn_hidden_size`` (the difference
  from the dense MLP ``memory_terms`` counts), one layer's all-to-all send and receive
  buffers in flight, and with routing replay the micro-batch's recorded experts as the
  routers' int64 targets [T, k] per MoE layer;
- the replay record itself (the samples' routes, int16 per position x MoE layer x k for
  the rollout's rows x capacity) is host memory on a GPU (``routes_to_host``); on the
  CPU it is counted in the update.

Bases: the parameter, copy and record sizes are ``exact``; the router and dispatcher
activations follow megatron-core's MoE layer: a ``gpu-model`` assumption on a GPU, their
CPU form measured within 1.5 % of two Qwen3-MoE cells' peaks (docs/memory.md).
"""

from __future__ import annotations

from ..models.sizes import stage_expert_params, stage_layers

ROUTE_BYTES = 2  # int16 expert ids (rollout.experts.ROUTE_DTYPE)
REPLAY_INDEX_BYTES = 8  # the routers' replay targets (int64, models.moe_replay)


def moe_layers_of_stage(arch, pp: int, stage: int = None) -> int:
    """MoE layers on the fullest pipeline stage (``stage``: that one)."""
    stages = range(pp) if stage is None else [stage]
    return max(sum(1 for i in stage_layers(arch, pp, k) if arch.is_moe_layer(i))
               for k in stages)


def fixed_terms(arch, s) -> list[tuple]:
    """Resident and rollout terms (``memory_model.Settings`` ``s``)."""
    if not arch.is_moe:
        return []
    db, tp, pp, ep = s.dtype_bytes, s.tp, s.pp, s.ep
    experts = max(stage_expert_params(arch, tp, pp, k, ep) for k in range(pp))
    out = []
    edp = max(s.dp // ep, 1)
    if s.distributed_optimizer and edp < s.dp:
        per = 8 if db == 4 else 12
        out.append(("expert optimizer (EP)", experts * per * (1 / edp - 1 / s.dp),
                    "resident", "gpu-model",
                    f"the experts' {'fp32 master + ' if db != 4 else ''}Adam moments are "
                    f"sharded over the expert-data-parallel group ({edp} ranks), not DP {s.dp}"))
    phase = "rollout" if s.kv_released else "resident"
    whole = s.gathered and pp > 1  # the gathered rollout runs every layer on each stage
    stacked = stage_expert_params(arch, tp, 1, 0, ep) if whole else experts
    out.append(("stacked experts", stacked * db, phase, "exact",
                f"the engine's stacked copy of this rank's {arch.num_experts // ep} experts "
                "per MoE layer (grouped GEMMs), re-made every generate"))
    moe = len(arch.moe_layers) if whole else moe_layers_of_stage(arch, pp)
    positions = s.capacity + s.draft_slack  # the target's cache: drafts' slack included
    cells = s.kv_tokens if s.kv_paged else s.rollout_rows * positions
    out.append(("expert routes (KV)", moe * cells * arch.moe_topk * ROUTE_BYTES, phase,
                "exact", f"int16 experts per position: {moe} MoE layers x "
                f"top-{arch.moe_topk}, " + (f"the paged budget's {s.kv_tokens:,.0f} positions"
                                           if s.kv_paged else
                                           f"{s.rollout_rows} rows x {positions} positions")))
    return out


def update_terms(arch, s) -> list[tuple]:
    """Update terms for the micro-batch of ``s`` (rows x positions)."""
    if not arch.is_moe:
        return []
    db, tp, ep, k, e = s.dtype_bytes, s.tp, s.ep, arch.moe_topk, arch.num_experts
    h, f, fe = arch.hidden_size, arch.ffn_hidden_size, arch.moe_ffn_hidden_size
    tokens = s.micro_batch * s.seq
    moe = moe_layers_of_stage(arch, s.pp)
    kept = min(moe, max(1, s.recompute_layers)) if s.recompute == "full" else moe
    router = tokens * (9 * e + 4 * k)  # logits, scores (fp32), map (bool); top-k weights
    copies = 3 if ep > 1 else 2
    dispatch = copies * tokens * k * h * db / tp
    # the MLP's kept activations per width unit and token: the GPU's 6 halves (3 db) as
    # ``layer_activation_bytes``, the eager CPU layer's 2f + f + f + f (5 db)
    unit = 3 * db if s.on_gpu else 5 * db
    mlp = tokens * (k * fe - f) * unit / tp
    out = [("router + dispatcher", kept * (router + dispatch + mlp), "update", "gpu-model",
            f"{kept} MoE layers' router logits/scores [T, {e}], permuted tokens for "
            f"T x top-{k}, experts' activations at width {fe} in place of the dense "
            f"{f}; T = {tokens}"),
           ("all-to-all buffers", 2 * tokens * k * h * db / tp, "update", "gpu-model",
            "one layer's dispatch send and receive buffers in flight")]
    if s.routing_replay:
        out.append(("replay targets", tokens * moe * k * REPLAY_INDEX_BYTES, "update",
                    "exact", f"the micro-batch's recorded experts set on {moe} routers "
                    "(int64)"))
    if not s.on_gpu:
        out.append(("replay record", s.rollout_rows * s.capacity * len(arch.moe_layers) * k
                    * ROUTE_BYTES, "update", "exact",
                    "the samples' routes (int16), held from the rollout through the update"))
    return out
