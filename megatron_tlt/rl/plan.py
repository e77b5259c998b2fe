"""``pretrain_rl_tlt.py --dry-run``: check a recipe against a world size and print the
parallel layout and each rank's memory by phase (``memory_model``: resident, rollout,
update, the peak against an 80 GB GPU), without loading any weights; then the planner's
predicted step time with and without TLT (``megatron_tlt.planner``, docs/planning.md).

The architecture comes from ``models.known.architecture``: the model folder's config.json
when it exists here, else the public config of a model the recipes name, so a cluster
recipe can be checked on a laptop.
"""

from __future__ import annotations

from ..config import Config, mini_batch_count
from ..models.known import KNOWN_ARCHITECTURES, architecture  # noqa: F401 (re-exported)
from ..models.sizes import active_params
from ..validation import validate
from . import memory_model, memory_terms
from .memory_model import GIB


def dry_run(cfg: Config, world_size: int) -> str:
    """Validate ``cfg`` for ``world_size`` processes; return the report text."""
    arch, arch_from = architecture(cfg)
    validate(cfg, arch, world_size)  # every rule, as the launch
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    g = cfg.grpo
    m = mini_batch_count(cfg)
    est = memory_model.estimate(cfg, arch, world_size)
    from .kv_budget import report_lines as kv_lines
    s = est.settings
    prompts_per_replica = g.prompts_per_step // dp
    ep = cfg.parallel.expert_model_parallel_size
    active = (f", {active_params(arch) / 1e9:.2f}B active: {arch.num_experts} experts "
              f"top-{arch.moe_topk}" if arch.is_moe else "")
    rollout = (f"EP {ep} (experts over consecutive DP ranks); a rollout replica is the EP "
               f"group, {tp * pp * ep} ranks, {dp // ep} replica(s)" if ep > 1 else
               f"a rollout replica is {tp * pp} rank(s), {dp} replica(s)")
    lines = [
        f"recipe OK for world size {world_size}",
        f"model      : {cfg.model.hf_path} ({arch.model_type}, "
        f"{arch.num_parameters / 1e9:.2f}B params{active}, {arch.num_layers} layers, hidden "
        f"{arch.hidden_size}; architecture from {arch_from})",
        f"layout     : TP {tp} x PP {pp} x DP {dp} = {world_size} ranks; {rollout}",
        f"per step   : {g.prompts_per_step} prompts x {g.group_size} samples = "
        f"{g.prompts_per_step * g.group_size} responses ({prompts_per_replica} prompts per "
        f"replica), {m} mini-batch(es) x {g.ppo_epochs} epoch(s) = {m * g.ppo_epochs} "
        f"optimizer step(s); micro-batches of {s.micro_batch} x {s.seq} positions",
    ]
    lines += memory_model.report_lines(est) + offload_lines(est)
    lines += kv_lines(cfg, arch, world_size, est)
    lines += rollout_memory_lines(arch, tp, pp, s.dtype_bytes, s.rollout_rows, s.capacity,
                                  drafter=s.drafter_reads_vocabulary,
                                  mode=cfg.rollout.pipeline_mode,
                                  paged_tokens=s.kv_tokens if s.kv_paged else 0.0)
    from ..planner import predict_for_config  # predicted, with its assumptions listed

    try:
        lines += predict_for_config(cfg, world_size, arch=arch).lines()
    except FileNotFoundError as e:  # a calibration table missing (--calibration)
        lines.append(f"predicted step time: not available here ({e})")
    return "\n".join(lines)


def rollout_memory_lines(arch, tp: int, pp: int, dtype_bytes: int, seqs: int,
                         capacity: int, *, drafter: bool,
                         mode: str = "pipelined", paged_tokens: float = 0.0) -> list[str]:
    """The rollout engine's memory on each pipeline stage (one TP rank): the weights it
    reads in place (not extra), the KV cache of the stage's own layers for ``seqs``
    sequences of ``capacity`` positions, the float32 logits every stage receives from
    the last one (one decode step), and with a drafter the copies of the embedding /
    output layer the stages that do not own them receive. ``mode="gathered"``
    (``rollout.pipeline_mode``, PP > 1): every rank holds copies of the other stages'
    layers and of the vocabulary matrices it does not own, and the KV cache of all the
    layers for its share of the sequences. ``paged_tokens`` (rollout.kv_cache=paged):
    the KV cache is that many positions (the budget), not sequences x capacity."""
    stages = memory_terms.rollout_stages(arch, tp, pp, dtype_bytes, seqs, capacity,
                                         drafter=drafter, mode=mode)
    gathered = stages[0]["gathered"]
    shape = f"{seqs} sequences x {capacity} positions"
    if paged_tokens:
        per = memory_terms.rollout_stages(arch, tp, pp, dtype_bytes, 1, 1, drafter=drafter,
                                          mode=mode)[0]["kv"]
        for st in stages:
            st["kv"] = per * paged_tokens
        shape = f"{seqs} sequences in flight, paged: {paged_tokens:,.0f} positions"
    out = [f"rollout memory per pipeline stage (one TP rank; {shape}; weights read in "
           "place, not extra"
           + (f"; gathered: all layers, {stages[0]['share']} sequences per rank"
              if gathered else "") + "):"]
    for st in stages:
        kv, logits, copies = st["kv"], st["logits"], st["copies"]
        extra = kv + logits + copies
        out.append(f"  stage {st['stage']}: layers {st['first_layer']}-{st['last_layer']}, "
                   f"weights {st['weights'] / GIB:7.2f} GiB; KV cache {kv / GIB:7.2f} GiB + "
                   f"logits {logits / GIB:5.2f} GiB" + (
                       f" + copies of the other stages' weights {copies / GIB:5.2f} GiB"
                       if gathered else f" + vocabulary copies for the drafter "
                       f"{copies / GIB:5.2f} GiB" if copies else "")
                   + f" = {extra / GIB:7.2f} GiB for the rollout")
    return out


def update_only_bytes(est: memory_model.Estimate) -> float:
    """The resident bytes ``train.offload_during_rollout`` lends to the rollout."""
    return sum(x.nbytes for x in est.terms if x.phase == "resident" and x.name in memory_model.UPDATE_ONLY)


def offload_lines(est: memory_model.Estimate) -> list[str]:
    """The rollout phase with and without ``train.offload_during_rollout``."""
    lent = update_only_bytes(est)
    on = est.total("rollout") if est.settings.offload else est.total("rollout") - lent
    off = on + lent
    now = "on" if est.settings.offload else "off"
    return [f"  rollout total with train.offload_during_rollout=true "
            f"{(est.resident + on) / memory_model.GIB:8.2f} GiB, =false {(est.resident + off) / memory_model.GIB:8.2f} "
            f"GiB ({lent / memory_model.GIB:.2f} GiB lent by the update; {now} in this config)"]
