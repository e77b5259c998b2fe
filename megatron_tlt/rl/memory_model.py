"""Per-rank memory of one RL step, by phase: pure arithmetic on the config and the
architecture (no torch), for ``pretrain_rl_tlt.py --dry-run``.

A step has three phases that never overlap in time:

- rollout: the engine decodes on the trained weights (read in place) with its KV cache,
  the logits of a decode step, a prefill chunk's working set, and with speculation the
  drafter, its KV cache and the feature store (the self-drafter: the KV cache of its
  quantized copy); at PP > 1 in gathered mode copies of the other stages' weights;
- log-probs: forward-only passes over the step's micro-batches for the old policy's
  log-probs (when the update cannot take them from its own first forward) and the
  reference's (``grpo.kl_beta > 0``);
- update: forward/backward of one micro-batch at a time under the configured
  recomputation, plus the loss's vocabulary-sized temporaries on the last stage, then
  the optimizer step.

What lives through all (weights, fp32 gradient buffers, optimizer state, the frozen
reference model when ``grpo.kl_beta > 0``, the CPU kernels' packed weight copies, the
self-drafter's quantized copy of the policy, and the KV caches unless they are released
before the update) is *resident*. The peak is
``resident + max(rollout-only, log-probs-only, update-only)``.

The micro-batch is the worst the trainer can build (``rl/samples.plan_micro_batches``:
``train.micro_batch_size`` samples and ``train.micro_batch_tokens`` padded positions at
most, each fitted to its longest sample): the dry run does not know the lengths, so it
takes every row count's longest samples under the budget, up to the cap
(``memory_terms.budget_shapes``); given a step's lengths (``estimate(lengths=...)``,
tools/measure_memory.py) it models the micro-batches the trainer builds from them.

Where each number comes from (``Term.basis``):

- ``exact``: sizes of tensors the code allocates (weights, gradient buffers, Adam
  state, KV cache, feature store): the same arithmetic on every device.
- ``cpu-validated``: the eager (local-spec) layer's saved activations and the loss's
  vocabulary temporaries, counted tensor by tensor from the code and checked against
  measured peak RSS (tools/measure_memory.py, docs/memory.md).
- ``gpu-model``: GPU-only assumptions, checked by the GPU check's peak memory per
  phase: activations per layer by Korthikanti et al. 2022 (16-bit; docs/memory.md),
  with the attention and MLP terms written for GQA and SwiGLU, sequence parallelism,
  the distributed optimizer's sharding over DP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from ..models.sizes import layer_params, stage_params
from ..rollout.speculative import drafters
from ..spec_strategy import Strategy, parse_arms
from . import memory_moe
from .memory_terms import (activation_bytes, budget_shapes, cpu_layer_tensors,
                           forward_layer_bytes, graph_keys, graph_pool_bytes,
                           logprob_pass_bytes, loss_token_bytes, loss_vocab_bytes,
                           optimizer_step_bytes, planned_shapes, recomputed_bytes,
                           rollout_stages)

GIB = 1024 ** 3
GPU_BYTES = 80 * 10 ** 9          # an "80 GB" H100 / A100
GPU_USABLE = 0.95                 # the CUDA context, NCCL buffers, fragmentation
# CPU only, measured (tools/measure_memory.py, docs/memory.md): the libraries' pages
# (torch, megatron-core, transformers imported: 395-415 MiB), the RSS a run holds beyond
# its tensors once set up (tokenizer, prompt set, Python objects), and what glibc's heap
# keeps (``_heap_terms``: freed blocks under its dynamic mmap threshold stay mapped)
CPU_LIBRARIES_BYTES = 400 * 1024 ** 2
CPU_PROCESS_BYTES = 64 * 1024 ** 2
HEAP_LAYERS = 4.0
GLIBC_MMAP_MAX = 32 * 1024 ** 2   # glibc's largest dynamic mmap threshold (64-bit)
PHASES = ("resident", "rollout", "log-probs", "update")
# the widest panel of the CPU kernels' GEMM (AVX-512: 48 output rows; AVX2 16, portable
# 8): an int8 matrix packed for them has its rows padded to a multiple of it
PANEL_ROWS_MAX = 48


@dataclass
class Term:
    name: str
    nbytes: float
    phase: str                    # resident | rollout | log-probs | update
    basis: str                    # exact | cpu-validated | gpu-model
    note: str = ""


@dataclass
class Settings:
    """What the estimate reads from the config (``settings(cfg, ...)``)."""

    tp: int
    pp: int
    dp: int
    on_gpu: bool
    dtype_bytes: int
    micro_batch: int              # rows of the modelled micro-batch
    seq: int                      # its positions per row (fitted to its longest sample)
    loss_tokens: int              # its response tokens (loss rows)
    micro_batches: int            # per optimizer step on this replica
    rollout_rows: int             # sequences decoded at once
    capacity: int                 # KV positions per row
    prefill_tokens: int
    sequence_parallel: bool
    recompute: str                # none | selective | full
    recompute_method: str         # uniform | block
    recompute_layers: int
    loss_chunk: Optional[int]     # rows per token_stats chunk (0 in the config: all)
    distributed_optimizer: bool
    reference: bool
    gathered: bool                # rollout.pipeline_mode=gathered at PP > 1
    cpu_kernels: bool             # CPU float32 packed weight copies
    kv_released: bool             # the KV cache is freed before the update
    offload: bool = False         # train.offload_during_rollout (``_lent_terms``)
    device: str = "cuda"          # platform.device as configured
    cuda_graphs: bool = False     # rollout.cuda_graphs captures decode steps (GPU)
    # speculation's arms as (depth, top_k, verify_tokens), the running batch it
    # speculates at (rollout.speculative.threshold) and whether the confidence stop
    # cuts chains (a verification key per width)
    arms: tuple = ()
    spec_threshold: int = 0
    cut_chains: bool = False
    # the drafter kinds the run holds (``drafters.configured_kinds``; each adds its own
    # memory terms), their caches' draft slack, the ``rollout.speculative`` settings
    # they read, and the CPU kernels' panel width packed int8 matrices are padded to
    kinds: tuple = ()
    draft_slack: int = 0
    spec: object = None
    panel_rows: int = PANEL_ROWS_MAX
    # the micro-batches the update may run, (rows, positions, loss rows) each: the
    # estimate takes the worst (empty: micro_batch x seq above); "budget" (the worst
    # lengths up to the cap) or "lengths" (a step's real lengths)
    shapes: tuple = ()
    shapes_from: str = ""
    # the GRPO options that change the step's memory
    old_pass: bool = False        # a forward-only pass of the policy for old log-probs
    entropy_grad: bool = False    # grpo.entropy_coef > 0: the entropy has a backward
    dual_clip: bool = False
    tis: bool = False
    kl_type: str = "k3"
    ppo_epochs: int = 1
    dynamic_rounds: int = 0       # DAPO's extra rollout rounds at most
    # mixture of experts (``memory_moe``): the expert-parallel size and routing replay
    ep: int = 1
    routing_replay: bool = False
    # rollout.kv_cache=paged (``planner/paged.py``): the budget per GPU in positions
    # (K, V and expert routes of the stage's layers; all layers in the gathered mode),
    # the positions a row in flight holds on average, and the budget's bytes
    kv_paged: bool = False
    kv_tokens: float = 0.0
    kv_held: float = 0.0
    kv_budget_bytes: float = 0.0
    kv_note: str = ""
    kv_block: int = 16  # rollout.kv_block_size (the drafters' paged pools' blocks)

    @property
    def graphed_drafting(self) -> bool:
        """Some kind's drafting forwards are captured in CUDA graphs."""
        return any(k.graphed_drafting for k in self.kinds)

    @property
    def drafter_reads_vocabulary(self) -> bool:
        return any(k.reads_vocabulary() for k in self.kinds)


def settings(cfg, world_size: int, *, kv_released: Optional[bool] = None,
             lengths: Optional[Sequence[tuple]] = None, arch=None,
             kv_gib: Optional[float] = None) -> Settings:
    """``lengths``: a step's (prompt, response) tokens per sample of this replica, in
    step order; the micro-batches are then the trainer's for them (else the worst the
    budget allows up to the cap). ``arch``: needed with ``rollout.kv_cache=paged``
    (the budget's positions), whose budget ``kv_gib`` replaces
    ``rollout.kv_cache_gib``."""
    g, t, r, par = cfg.grpo, cfg.train, cfg.rollout, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = max(world_size // (tp * pp), 1)
    on_gpu = cfg.platform.device != "cpu"
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(
        cfg.model.dtype, 2 if on_gpu else 4)
    capacity = cfg.data.max_prompt_tokens + g.max_new_tokens
    per_replica = g.prompts_per_step * g.group_size // dp
    gbs = t.global_batch_size or g.prompts_per_step * g.group_size
    mini = max(per_replica * dp // gbs, 1)
    sp_mode = str(getattr(par, "sequence_parallel", "off"))
    sequence_parallel = tp > 1 and (sp_mode == "on" or (sp_mode == "auto" and on_gpu))
    multiple = tp if sequence_parallel else 1
    if lengths:
        shapes = planned_shapes(lengths, group_size=g.group_size, mini_batches=mini,
                                micro_batch_size=t.micro_batch_size,
                                micro_batch_tokens=t.micro_batch_tokens, multiple=multiple)
    else:
        shapes = budget_shapes(capacity=capacity, max_new=g.max_new_tokens,
                               rows=max(per_replica // mini, 1),
                               micro_batch_size=t.micro_batch_size,
                               micro_batch_tokens=t.micro_batch_tokens, multiple=multiple)
    rows, seq, loss = max(shapes, key=lambda x: (x[0] * x[1], x[1]))
    chunk = int(getattr(t, "loss_chunk_tokens", 0) or 0)
    sc = r.speculative
    kinds = drafters.configured_kinds(cfg)
    paged = _paged_fields(cfg, arch, world_size, kv_gib, dtype_bytes) \
        if r.kv_cache == "paged" else {}
    return Settings(
        tp=tp, pp=pp, dp=dp, on_gpu=on_gpu, dtype_bytes=dtype_bytes, micro_batch=rows,
        seq=seq, loss_tokens=loss,
        micro_batches=max(math.ceil(per_replica / mini / rows), 1),
        # at EP > 1 the EP group's replicas decode their requests together
        rollout_rows=paged.pop("rows", None)
        or min(per_replica * par.expert_model_parallel_size, r.max_batch_size),
        capacity=capacity,
        prefill_tokens=r.prefill_tokens, sequence_parallel=sequence_parallel,
        recompute=str(getattr(t, "recompute_granularity", "none")),
        recompute_method=str(getattr(t, "recompute_method", "uniform")),
        recompute_layers=int(getattr(t, "recompute_num_layers", 1)),
        loss_chunk=chunk,
        distributed_optimizer=on_gpu and t.optimizer in ("auto", "megatron"),
        reference=g.kl_beta > 0,
        gathered=pp > 1 and r.pipeline_mode == "gathered",
        cpu_kernels=not on_gpu and dtype_bytes == 4 and r.cpu_kernels != "false",
        kv_released=bool(getattr(r, "release_memory", True)) if kv_released is None
        else kv_released,
        offload=bool(getattr(t, "offload_during_rollout", False)),
        device=str(cfg.platform.device),
        cuda_graphs=on_gpu and r.cuda_graphs != "false"
        and not (pp > 1 and r.pipeline_mode == "pipelined"),
        arms=tuple(sorted({a for k in kinds for a in _arms(k.tuner_config(sc))})),
        spec_threshold=sc.threshold,
        cut_chains=sc.min_draft_prob > 0,
        kinds=tuple(kinds), draft_slack=drafters.configured_slack(kinds, sc), spec=sc,
        shapes=tuple(shapes), shapes_from="lengths" if lengths else "budget",
        # the trainer's rule (``Trainer.train_step``): the old log-probs come from the
        # update's own forward with one epoch and one mini-batch
        old_pass=not g.use_rollout_logprobs and (g.ppo_epochs > 1 or mini > 1),
        entropy_grad=g.entropy_coef > 0, dual_clip=g.dual_clip_c > 0, tis=g.tis_cap > 0,
        kl_type=g.kl_type, ppo_epochs=g.ppo_epochs,
        dynamic_rounds=g.dynamic_sampling_rounds if g.dynamic_sampling else 0,
        ep=par.expert_model_parallel_size, routing_replay=g.routing_replay, **paged)


def _paged_fields(cfg, arch, world_size: int, kv_gib: Optional[float],
                  dtype_bytes: int) -> dict:
    """The paged cache's settings (``planner/paged.for_config``: the budget, the rows it
    keeps in flight on the planner's length model); a budget below one row of the
    longest prompt is the config's error."""
    from ..config import ConfigError
    from ..planner.paged import for_config

    if arch is None:
        raise ValueError("memory_model.settings: rollout.kv_cache=paged needs the arch")
    pe = for_config(cfg, arch, world_size, kv_gib=kv_gib, dtype_bytes=dtype_bytes)
    p = pe.plan
    if p.tokens < pe.min_tokens:
        need = (pe.min_tokens * pe.token_bytes + pe.draft_bytes) / GIB
        drafters = (f" beside the drafters' paged caches ({pe.draft_bytes / GIB:.3g} GiB)"
                    if pe.draft_bytes else "")
        raise ConfigError(
            f"rollout.kv_cache_gib={pe.budget_bytes / GIB:.3g} holds {p.tokens:,.0f} "
            f"positions per GPU{drafters}, fewer than one row of the longest prompt "
            f"(data.max_prompt_tokens={cfg.data.max_prompt_tokens} + 1, in blocks of "
            f"rollout.kv_block_size={p.block}: {pe.min_tokens} positions); set "
            f"rollout.kv_cache_gib to at least {math.ceil(need * 1000) / 1000:g} (or 0 for "
            "what max_batch_size slots reserve)")
    note = (f"paged: {p.tokens:,.0f} positions ("
            + ("rollout.kv_cache_gib" if pe.from_config else "max_batch_size slots' worth")
            + (f" less the drafters' {pe.draft_bytes / GIB:.2f} GiB" if pe.from_config
               and pe.draft_bytes else "")
            + f"), {pe.replica_rows} rows in flight x {p.held:,.0f} held on average "
            f"(limited by {p.limited_by}), blocks of {p.block}")
    return dict(kv_paged=True, kv_tokens=p.tokens, kv_held=p.held, kv_block=p.block,
                kv_budget_bytes=pe.budget_bytes, kv_note=note, rows=pe.replica_rows)


def _arms(sc) -> tuple:
    """Every speculative strategy the tuner may pick, as (depth, top_k, verify_tokens)."""
    arms = [a for bucket in parse_arms(sc.arms, sc.buckets).values() for a in bucket]
    if sc.policy == "fixed":
        arms.append(Strategy.parse(sc.strategy))
    return tuple(sorted({(a.depth, a.top_k, a.verify_tokens) for a in arms if not a.is_off}))


# ----------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    settings: Settings
    terms: list = field(default_factory=list)

    def total(self, phase: str) -> float:
        return sum(x.nbytes for x in self.terms if x.phase == phase)

    @property
    def resident(self) -> float:
        return self.total("resident")

    @property
    def rollout_total(self) -> float:
        return self.resident + self.total("rollout")

    @property
    def logprobs_total(self) -> float:
        return self.resident + self.total("log-probs")

    @property
    def update_total(self) -> float:
        return self.resident + self.total("update")

    @property
    def peak(self) -> float:
        return max(self.rollout_total, self.logprobs_total, self.update_total)

    @property
    def peak_phase(self) -> str:
        totals = {"rollout": self.rollout_total, "log-probs": self.logprobs_total,
                  "update": self.update_total}
        return max(totals, key=totals.get)

    def as_dict(self) -> dict:
        return {x.name: x.nbytes for x in self.terms}


def estimate(cfg, arch, world_size: int, *, kv_released: Optional[bool] = None,
             lengths: Optional[Sequence[tuple]] = None,
             kv_gib: Optional[float] = None) -> Estimate:
    """The worst rank's memory per phase for ``cfg`` on ``world_size`` ranks (``lengths``,
    ``kv_gib``: see ``settings``)."""
    return estimate_settings(arch, settings(cfg, world_size, kv_released=kv_released,
                                            lengths=lengths, arch=arch, kv_gib=kv_gib))


def estimate_settings(arch, s: Settings) -> Estimate:
    """``estimate`` for settings already read from a config: the resident and rollout
    terms, and the log-probs and update terms of the worst of ``s.shapes``."""
    est = Estimate(s)
    shard = max(stage_params(arch, s.tp, s.pp, k, s.ep) for k in range(s.pp))
    est.terms += _resident_terms(arch, s, shard) + _rollout_terms(arch, s) \
        + [Term(*t) for t in memory_moe.fixed_terms(arch, s)]
    worst, rollout = None, est.total("rollout")
    for rows, seq, loss in s.shapes or ((s.micro_batch, s.seq, s.loss_tokens),):
        mb = replace(s, micro_batch=rows, seq=seq, loss_tokens=loss)
        terms = _heap_terms(arch, mb, phase="rollout", working=rollout) \
            + _logprob_terms(arch, mb) + _update_terms(arch, mb, shard) \
            + [Term(*t) for t in memory_moe.update_terms(arch, mb)]
        worst_phase = max(sum(x.nbytes for x in terms if x.phase == p)
                          + (rollout if p == "rollout" else 0)
                          for p in ("rollout", "log-probs", "update"))
        if worst is None or worst_phase > worst[0]:
            worst = (worst_phase, terms, mb)
    est.terms += worst[1] + _lent_terms(est.terms, s)
    est.settings = worst[2]
    return est


# the resident terms only the update reads: lent to the rollout with
# train.offload_during_rollout (rl/offload.py)
UPDATE_ONLY = ("grads", "optimizer", "expert optimizer (EP)")


def _lent_terms(terms: list, s: Settings) -> list[Term]:
    """``train.offload_during_rollout``: the gradient buffers and the optimizer state
    (Adam's moments, fp32 main copies) leave the device (pinned host memory; on CPU a
    temporary file) from the rollout's start until after it, so the rollout phase
    holds the resident terms less these: a negative rollout term. The log-prob and
    update phases have them back."""
    if not s.offload:
        return []
    lent = [x for x in terms if x.phase == "resident" and x.name in UPDATE_ONLY]
    where = "pinned host memory" if s.on_gpu else "a temporary file"
    basis = "gpu-model" if any(x.basis == "gpu-model" for x in lent) else "exact"
    return [Term("lent by the update", -sum(x.nbytes for x in lent), "rollout", basis,
                 f"train.offload_during_rollout: grads + optimizer state in {where}")]


def _resident_terms(arch, s: Settings, shard: float) -> list[Term]:
    db, tp, pp = s.dtype_bytes, s.tp, s.pp
    out = [Term("weights", shard * db, "resident", "exact", f"{db}-byte parameters"),
           Term("grads", shard * 4, "resident", "exact", "fp32 main_grad buffers")]
    opt = shard * (8 if db == 4 else 12) / (s.dp if s.distributed_optimizer else 1)
    out.append(Term("optimizer", opt, "resident",
                    "gpu-model" if s.distributed_optimizer else "exact",
                    ("fp32 master + " if db != 4 else "") + "Adam moments"
                    + (f", sharded over DP {s.dp}" if s.distributed_optimizer else "")))
    if s.reference:
        out.append(Term("reference", shard * db, "resident", "exact",
                        f"frozen copy (grpo.kl_beta, KL {s.kl_type})"))
    if s.cpu_kernels:
        mats = arch.num_layers // pp * (layer_params(arch, tp) - 2 * arch.hidden_size) \
            + (arch.padded_vocab_size(tp) // tp) * arch.hidden_size
        out.append(Term("cpu kernel copies", mats * 4, "resident", "exact",
                        "packed weight panels (rollout.cpu_kernels)"))
    if not s.on_gpu:
        out.append(Term("libraries (CPU)", CPU_LIBRARIES_BYTES, "resident", "cpu-validated",
                        "torch, megatron-core, transformers loaded"))
        out.append(Term("process (CPU)", CPU_PROCESS_BYTES, "resident", "cpu-validated",
                        "tokenizer, prompts, Python objects"))
    return out


def _rollout_terms(arch, s: Settings) -> list[Term]:
    db, tp, pp = s.dtype_bytes, s.tp, s.pp
    positions = s.capacity + s.draft_slack  # the target's cache: drafts' slack included
    stages = rollout_stages(arch, tp, pp, db, s.rollout_rows, positions,
                            drafter=s.drafter_reads_vocabulary,
                            mode="gathered" if s.gathered else "pipelined")
    worst = max(stages, key=lambda x: x["kv"] + x["logits"] + x["copies"])
    extra = f"; DAPO's up to {s.dynamic_rounds} extra rounds reuse it" \
        if s.dynamic_rounds else ""
    kv, what = worst["kv"], f"{s.rollout_rows} rows x {positions} positions"
    if s.kv_paged:  # the budget's positions (its expert routes: memory_moe)
        kv = s.kv_tokens * rollout_stages(arch, tp, pp, db, 1, 1, drafter=False,
                                          mode="gathered" if s.gathered else "pipelined"
                                          )[0]["kv"]
        what = s.kv_note
    out = [Term("KV cache", kv, "rollout" if s.kv_released else "resident", "exact",
                what + ("" if s.kv_released else ", kept through the update") + extra),
           Term("decode logits", worst["logits"] * 3, "rollout", "cpu-validated",
                "fp32 logits of a step and two sampling temporaries")]
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    prefill = min(s.prefill_tokens, s.rollout_rows * (s.capacity - 1))
    out.append(Term("prefill working set",
                    prefill * db * (3 * h + (2 * q + 2 * kvw + 4 * f) / tp),
                    "rollout", "cpu-validated", f"one layer's temporaries for {prefill} tokens"))
    if worst["copies"]:
        out.append(Term("gathered copies" if s.gathered else "vocabulary copies",
                        worst["copies"], "rollout", "exact",
                        "other stages' weights" if s.gathered
                        else "the drafter's embedding / output layer"))
    # each drafter kind's own terms (``Drafter.memory_terms``); with the paged cache
    # its KV cache pages too, a pool of the rows that speculate inside the budget
    for kind in s.kinds:
        for t in kind.memory_terms(arch, s, s.spec):
            phase = "rollout" if t.lifetime == "rollout" and s.kv_released else "resident"
            out.append(Term(t.name, t.nbytes, phase, "exact", t.note))
    if s.cuda_graphs:
        keys = graph_keys(arch, s)
        pools = [graph_pool_bytes(k) for k in keys.values()]
        out.append(Term("CUDA graph pools", sum(p + i for p, i in pools),
                        "rollout" if s.kv_released else "resident", "gpu-model",
                        f"{len(keys['target'])} target + {len(keys['drafter'])} drafter "
                        "keys: outputs + largest working set per pool, static inputs"))
    return out


def _shape_note(s: Settings) -> str:
    how = {"budget": "the worst train.micro_batch_size / micro_batch_tokens allow up to "
                     f"{s.capacity} positions",
           "lengths": "the largest the trainer builds from the step's lengths"}
    return f"{s.micro_batch} x {s.seq} positions" + (
        f" ({how[s.shapes_from]})" if s.shapes_from in how else "")


def _logprob_terms(arch, s: Settings) -> list[Term]:
    """The forward-only passes before the update (old policy, reference) on the last
    stage: the larger of a layer's forward temporaries and the logits' moment."""
    if not (s.old_pass or s.reference):
        return []
    which = " and ".join(n for n, on in (("old policy", s.old_pass),
                                         ("reference", s.reference)) if on)
    vocab, how = logprob_pass_bytes(arch, s, reference=s.reference)
    layer = forward_layer_bytes(arch, s)
    basis = "gpu-model" if s.on_gpu else "cpu-validated"
    out = [Term("log-prob forward", max(vocab, layer), "log-probs", basis,
                f"{which}: {_shape_note(s)}; " + (how if vocab >= layer
                                                  else "a layer's temporaries"))]
    return out + _heap_terms(arch, s, phase="log-probs")


def _update_terms(arch, s: Settings, shard: float) -> list[Term]:
    h, layers, pp = arch.hidden_size, arch.num_layers // s.pp, s.pp
    first = activation_bytes(arch, s, layers=layers, in_flight=min(pp, s.micro_batches))
    last = activation_bytes(arch, s, layers=layers)
    vocab, how = loss_vocab_bytes(arch, s)
    basis = "gpu-model" if s.on_gpu else "cpu-validated"
    outside = s.micro_batch * s.seq * 3 * h * s.dtype_bytes  # final norm, embedding out
    out = []
    if pp > 1 and first > last + vocab:
        out.append(Term("activations", first + outside, "update", basis,
                        f"first stage, {min(pp, s.micro_batches)} micro-batches in flight, "
                        f"recompute {s.recompute}"))
    else:
        # full recomputation: a chunk's layers are rebuilt in the backward after the loss's
        # and the output layer's (their vocabulary tensors freed): the larger moment counts
        chunk = recomputed_bytes(arch, s, layers=layers)
        out.append(Term("activations", last - chunk + outside, "update", basis,
                        f"{_shape_note(s)}, recompute {s.recompute}"
                        + (", sequence parallel" if s.sequence_parallel else "")
                        + (": the checkpointed inputs" if chunk else "")))
        if chunk > vocab:
            out.append(Term("recomputed layers", chunk, "update", basis,
                            "one chunk's activations, rebuilt in the backward"))
        else:
            out.append(Term("loss vocabulary", vocab, "update", "cpu-validated", how))
        tokens, note = loss_token_bytes(s)
        options = [n for n, on in (("entropy bonus", s.entropy_grad), ("KL", s.reference),
                                   ("dual clip", s.dual_clip), ("TIS", s.tis)) if on]
        out.append(Term("loss per-token", tokens, "update", "cpu-validated",
                        note + (f" ({', '.join(options)})" if options else "")))
    out += _heap_terms(arch, s, phase="update")
    step = optimizer_step_bytes(arch, s, shard)
    if step > sum(x.nbytes for x in out):  # after the backward: the activations are freed
        return [Term("optimizer step", step, "update", basis, "AdamW's temporaries")]
    return out


def _heap_terms(arch, s: Settings, *, phase: str, working: float = 0.0) -> list[Term]:
    """CPU only: glibc's heap beside the live tensors (docs/memory.md). Tensors under its
    dynamic mmap threshold (32 MiB at most) come from the heap, which keeps the blocks
    they free: in the update about ``HEAP_LAYERS`` layers' worth of such tensors at the
    micro-batch's positions beyond the live ones (the forward's temporaries, the
    backward's gradients, a recomputed layer or core attention; measured 3-4.6 whether
    or not the layers are recomputed), and after it, through the next rollout and
    log-prob passes, those plus the freed activations, less what the phase's own
    ``working`` set reuses.

    Not monotone in the positions: a tensor that grows past the threshold leaves the
    heap for its own mapping. So the dry run's bound (micro-batches from the budget,
    no lengths known) takes the worst of its micro-batch at 1/16 .. 16/16 of its
    positions: shorter responses must not model above it."""
    if s.on_gpu:
        return []
    fractions = range(1, 17) if s.shapes_from == "budget" else (16,)
    shapes = [replace(s, seq=max(1, s.seq * k // 16)) for k in fractions]
    retention = max(_heap_retention(arch, x) for x in shapes)
    if phase == "update":
        return [Term("heap retention (CPU)", retention, "update", "cpu-validated",
                     f"glibc's freed blocks: {HEAP_LAYERS:g} layers' tensors under 32 MiB")]
    kept = max(_heap_kept(arch, x) for x in shapes)
    return [Term("heap kept (CPU)", max(kept - working, 0.0), phase, "cpu-validated",
                 "the update's freed activations and blocks, in glibc's heap from the "
                 "second step on")]


def _heap_retention(arch, s: Settings) -> float:
    tokens = s.micro_batch * s.seq
    layer = cpu_layer_tensors(arch, replace(s, recompute="none"), tokens=tokens)
    return HEAP_LAYERS * sum(x for x in layer if x < GLIBC_MMAP_MAX)


def _heap_kept(arch, s: Settings) -> float:
    sizes = cpu_layer_tensors(arch, s, tokens=s.micro_batch * s.seq)
    small = sum(x for x in sizes if x < GLIBC_MMAP_MAX) / sum(sizes)
    return small * activation_bytes(arch, s, layers=arch.num_layers // s.pp) \
        + _heap_retention(arch, s)


# ----------------------------------------------------------------------- the report
def report_lines(est: Estimate) -> list[str]:
    s = est.settings
    where = "GPU" if s.on_gpu else "CPU"
    if s.device == "auto":
        where += " (platform.device=auto; platform.device=cpu for the CPU model)"
    out = [f"memory per rank by phase (dry-run model; {s.dtype_bytes}-byte params, "
           f"{where}):"]
    for phase in PHASES:
        total = est.total(phase)
        if phase == "log-probs" and not total:
            continue
        out.append(f"  {phase:9s} {total / GIB:7.2f} GiB"
                   + {"resident": "  (through every phase)", "rollout": "  (rollout only)",
                      "log-probs": "  (old / reference log-prob passes only)",
                      "update": "  (update only)"}[phase])
        for x in est.terms:
            if x.phase == phase:
                out.append(f"    {x.name:22s} {x.nbytes / GIB:8.2f} GiB  [{x.basis}] {x.note}")
    logprobs = (f"   log-probs total {est.logprobs_total / GIB:8.2f} GiB"
                if est.total("log-probs") else "")
    out.append(f"  rollout total {est.rollout_total / GIB:8.2f} GiB{logprobs}   update total "
               f"{est.update_total / GIB:8.2f} GiB")
    out.append(f"  peak         {est.peak / GIB:8.2f} GiB ({est.peak_phase})")
    if s.on_gpu:
        limit = GPU_BYTES * GPU_USABLE
        if est.peak <= limit:
            out.append(f"  fits an 80 GB GPU ({est.peak / GIB:.1f} of {limit / GIB:.1f} GiB "
                       f"usable)")
        else:
            out.append(f"  does NOT fit an 80 GB GPU ({est.peak / GIB:.1f} > "
                       f"{limit / GIB:.1f} GiB usable): " + advice(est))
    out.append("  basis: [exact] tensor sizes; [cpu-validated] checked against measured "
               "peak RSS on CPU (docs/memory.md); [gpu-model] GPU-only assumptions, "
               "checked by make gpu-check's peak memory per phase")
    return out


def advice(est: Estimate) -> str:
    s, d = est.settings, est.as_dict()
    tips = []
    if est.peak_phase != "rollout":
        if s.recompute != "full":
            tips.append("train.recompute_granularity=full" if s.recompute == "selective"
                        else "train.recompute_granularity=selective (or full)")
        if not s.loss_chunk or s.loss_chunk > 1024:
            tips.append("train.loss_chunk_tokens=1024")
        if s.micro_batch > 1 or s.seq > 4096:
            tips.append("a smaller train.micro_batch_tokens / micro_batch_size")
    elif s.kv_paged:
        tips.append("a smaller rollout.kv_cache_gib (the dry run proposes one)")
    else:
        tips.append("a smaller rollout.max_batch_size")
    if not s.kv_released and d.get("KV cache"):
        tips.append("rollout.release_memory=true (the KV cache freed before the update)")
    tips.append("a larger TP or PP")
    return "; ".join(tips)
