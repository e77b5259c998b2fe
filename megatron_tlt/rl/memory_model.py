"""Per-rank memory of one RL step, by phase: pure arithmetic on the config and the
architecture (no torch), for ``pretrain_rl_tlt.py --dry-run``.

A step has two phases that never overlap in time:

- rollout: the engine decodes on the trained weights (read in place) with its KV cache,
  the logits of a decode step, a prefill chunk's working set, and with speculation the
  drafter, its KV cache and the feature store (the self-drafter: the KV cache of its
  quantized copy); at PP > 1 in gathered mode copies of the other stages' weights;
- update: forward/backward of one micro-batch at a time under the configured
  recomputation, plus the loss's vocabulary-sized temporaries on the last stage.

What lives through both (weights, fp32 gradient buffers, optimizer state, the frozen
reference model when ``grpo.kl_beta > 0``, the CPU kernels' packed weight copies, the
self-drafter's quantized copy of the policy, and the KV caches unless they are released
before the update) is *resident*. The peak is
``resident + max(rollout-only, update-only)``.

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
from dataclasses import dataclass, field
from typing import Optional

from ..models.sizes import layer_params, stage_params
from ..rollout.speculative import drafters
from ..spec_strategy import Strategy, parse_arms
from .memory_terms import (activation_bytes, cpu_layer_tensors, graph_keys, graph_pool_bytes,
                           loss_vocab_bytes, rollout_stages)

GIB = 1024 ** 3
GPU_BYTES = 80 * 10 ** 9          # an "80 GB" H100 / A100
GPU_USABLE = 0.95                 # the CUDA context, NCCL buffers, fragmentation
# CPU only, measured (tools/measure_memory.py, docs/memory.md): the RSS a run holds
# beyond its tensors once set up (tokenizer, prompt set, Python objects: 53-70 MB on
# the CPU cells), and the share of the update's layer activations that glibc keeps
# resident as freed heap blocks (its dynamic mmap threshold serves tensors under
# 32 MiB from the heap; the forward's freed temporaries of every layer stay mapped:
# 0.77-1.0 of the activations on the cells, nothing with MALLOC_MMAP_THRESHOLD_ fixed)
CPU_PROCESS_BYTES = 64 * 1024 ** 2
CPU_HEAP_RETENTION = 0.85
GLIBC_MMAP_MAX = 32 * 1024 ** 2   # glibc's largest dynamic mmap threshold (64-bit)
PHASES = ("resident", "rollout", "update")
# the widest panel of the CPU kernels' GEMM (AVX-512: 48 output rows; AVX2 16, portable
# 8): an int8 matrix packed for them has its rows padded to a multiple of it
PANEL_ROWS_MAX = 48


@dataclass
class Term:
    name: str
    nbytes: float
    phase: str                    # resident | rollout | update
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
    micro_batch: int              # rows per micro-batch
    seq: int                      # positions per row (prompt + response, worst case)
    loss_tokens: int              # response tokens per micro-batch (loss rows)
    micro_batches: int            # per optimizer step on this replica
    rollout_rows: int             # sequences decoded at once
    capacity: int                 # KV positions per row
    prefill_tokens: int
    sequence_parallel: bool
    recompute: str                # none | selective | full
    recompute_method: str         # uniform | block
    recompute_layers: int
    loss_chunk: Optional[int]     # rows per token_stats chunk; None: the inline loss
    distributed_optimizer: bool
    reference: bool
    gathered: bool                # rollout.pipeline_mode=gathered at PP > 1
    cpu_kernels: bool             # CPU float32 packed weight copies
    kv_released: bool             # the KV cache is freed before the update
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

    @property
    def graphed_drafting(self) -> bool:
        """Some kind's drafting forwards are captured in CUDA graphs."""
        return any(k.graphed_drafting for k in self.kinds)

    @property
    def drafter_reads_vocabulary(self) -> bool:
        return any(k.reads_vocabulary() for k in self.kinds)


def settings(cfg, world_size: int, *, kv_released: Optional[bool] = None,
             inline_loss: bool = False) -> Settings:
    """``inline_loss``: the loss of a trainer that predates ``rl/token_stats.py`` (full
    [n, V/t] fp32 copies); the config's ``train.loss_chunk_tokens`` otherwise (0: one
    chunk of the whole micro-batch)."""
    g, t, r, par = cfg.grpo, cfg.train, cfg.rollout, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = max(world_size // (tp * pp), 1)
    on_gpu = cfg.platform.device != "cpu"
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(
        cfg.model.dtype, 2 if on_gpu else 4)
    capacity = cfg.data.max_prompt_tokens + g.max_new_tokens
    rows = t.micro_batch_size
    if t.micro_batch_tokens:
        rows = max(1, min(rows, t.micro_batch_tokens // capacity))
    per_replica = g.prompts_per_step * g.group_size // dp
    gbs = t.global_batch_size or g.prompts_per_step * g.group_size
    mini = max(per_replica * dp // gbs, 1)
    sp_mode = str(getattr(par, "sequence_parallel", "off"))
    chunk = int(getattr(t, "loss_chunk_tokens", 0) or 0) or rows * g.max_new_tokens
    sc = r.speculative
    kinds = drafters.configured_kinds(cfg)
    return Settings(
        tp=tp, pp=pp, dp=dp, on_gpu=on_gpu, dtype_bytes=dtype_bytes, micro_batch=rows,
        seq=capacity, loss_tokens=rows * g.max_new_tokens,
        micro_batches=max(math.ceil(per_replica / mini / rows), 1),
        rollout_rows=min(per_replica, r.max_batch_size), capacity=capacity,
        prefill_tokens=r.prefill_tokens,
        sequence_parallel=tp > 1 and (sp_mode == "on" or (sp_mode == "auto" and on_gpu)),
        recompute=str(getattr(t, "recompute_granularity", "none")),
        recompute_method=str(getattr(t, "recompute_method", "uniform")),
        recompute_layers=int(getattr(t, "recompute_num_layers", 1)),
        loss_chunk=None if inline_loss else chunk,
        distributed_optimizer=on_gpu and t.optimizer in ("auto", "megatron"),
        reference=g.kl_beta > 0,
        gathered=pp > 1 and r.pipeline_mode == "gathered",
        cpu_kernels=not on_gpu and dtype_bytes == 4 and r.cpu_kernels != "false",
        kv_released=bool(getattr(r, "release_memory", True)) if kv_released is None
        else kv_released,
        device=str(cfg.platform.device),
        cuda_graphs=on_gpu and r.cuda_graphs != "false"
        and not (pp > 1 and r.pipeline_mode == "pipelined"),
        arms=tuple(sorted({a for k in kinds for a in _arms(k.tuner_config(sc))})),
        spec_threshold=sc.threshold,
        cut_chains=sc.min_draft_prob > 0,
        kinds=tuple(kinds), draft_slack=drafters.configured_slack(kinds, sc), spec=sc)


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
    def update_total(self) -> float:
        return self.resident + self.total("update")

    @property
    def peak(self) -> float:
        return max(self.rollout_total, self.update_total)

    @property
    def peak_phase(self) -> str:
        return "rollout" if self.rollout_total >= self.update_total else "update"

    def as_dict(self) -> dict:
        return {x.name: x.nbytes for x in self.terms}


def estimate(cfg, arch, world_size: int, *, kv_released: Optional[bool] = None,
             inline_loss: bool = False) -> Estimate:
    """The worst rank's memory per phase for ``cfg`` on ``world_size`` ranks."""
    return estimate_settings(arch, settings(cfg, world_size, kv_released=kv_released,
                                            inline_loss=inline_loss))


def estimate_settings(arch, s: Settings) -> Estimate:
    """``estimate`` for settings already read from a config."""
    db, tp, pp = s.dtype_bytes, s.tp, s.pp
    est = Estimate(s)
    add = est.terms.append
    # the worst stage: the most parameters (the vocabulary matrices) and, in the update,
    # the first stage's in-flight micro-batches or the last one's loss
    shard = max(stage_params(arch, tp, pp, k) for k in range(pp))
    add(Term("weights", shard * db, "resident", "exact", f"{db}-byte parameters"))
    add(Term("grads", shard * 4, "resident", "exact", "fp32 main_grad buffers"))
    opt = shard * (8 if db == 4 else 12) / (s.dp if s.distributed_optimizer else 1)
    add(Term("optimizer", opt, "resident", "gpu-model" if s.distributed_optimizer else "exact",
             ("fp32 master + " if db != 4 else "") + "Adam moments"
             + (f", sharded over DP {s.dp}" if s.distributed_optimizer else "")))
    if s.reference:
        add(Term("reference", shard * db, "resident", "exact", "frozen copy (grpo.kl_beta)"))
    if s.cpu_kernels:
        mats = arch.num_layers // pp * (layer_params(arch, tp) - 2 * arch.hidden_size) \
            + (arch.padded_vocab_size(tp) // tp) * arch.hidden_size
        add(Term("cpu kernel copies", mats * 4, "resident", "exact",
                 "packed weight panels (rollout.cpu_kernels)"))

    if not s.on_gpu:
        add(Term("process (CPU)", CPU_PROCESS_BYTES, "resident", "cpu-validated",
                 "tokenizer, prompts, Python objects"))

    # rollout
    stages = rollout_stages(arch, tp, pp, db, s.rollout_rows, s.capacity,
                            drafter=s.drafter_reads_vocabulary,
                            mode="gathered" if s.gathered else "pipelined")
    worst = max(stages, key=lambda x: x["kv"] + x["logits"] + x["copies"])
    add(Term("KV cache", worst["kv"], "rollout" if s.kv_released else "resident", "exact",
             f"{s.rollout_rows} rows x {s.capacity} positions"
             + ("" if s.kv_released else ", kept through the update")))
    add(Term("decode logits", worst["logits"] * 3, "rollout", "cpu-validated",
             "fp32 logits of a step and two sampling temporaries"))
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    prefill = min(s.prefill_tokens, s.rollout_rows * (s.capacity - 1))
    add(Term("prefill working set", prefill * db * (3 * h + (2 * q + 2 * kvw + 4 * f) / tp),
             "rollout", "cpu-validated", f"one layer's temporaries for {prefill} tokens"))
    if worst["copies"]:
        add(Term("gathered copies" if s.gathered else "vocabulary copies", worst["copies"],
                 "rollout", "exact", "other stages' weights" if s.gathered
                 else "the drafter's embedding / output layer"))
    for kind in s.kinds:  # each drafter kind's own terms (``Drafter.memory_terms``)
        for t in kind.memory_terms(arch, s, s.spec):
            phase = "rollout" if t.lifetime == "rollout" and s.kv_released else "resident"
            add(Term(t.name, t.nbytes, phase, "exact", t.note))
    if s.cuda_graphs:
        keys = graph_keys(arch, s)
        pools = [graph_pool_bytes(k) for k in keys.values()]
        add(Term("CUDA graph pools", sum(p + i for p, i in pools),
                 "rollout" if s.kv_released else "resident", "gpu-model",
                 f"{len(keys['target'])} target + {len(keys['drafter'])} drafter keys: "
                 "outputs + largest working set per pool, static inputs"))

    # update
    layers = arch.num_layers // pp
    first = activation_bytes(arch, s, layers=layers, in_flight=min(pp, s.micro_batches))
    last = activation_bytes(arch, s, layers=layers)
    vocab, how = loss_vocab_bytes(arch, s)
    basis = "gpu-model" if s.on_gpu else "cpu-validated"
    outside = s.micro_batch * s.seq * 3 * h * db  # the final norm, the embedding output
    if pp > 1 and first > last + vocab:
        add(Term("activations", first + outside, "update", basis,
                 f"first stage, {min(pp, s.micro_batches)} micro-batches in flight, "
                 f"recompute {s.recompute}"))
    else:
        add(Term("activations", last + outside, "update", basis,
                 f"{s.micro_batch} x {s.seq} positions, recompute {s.recompute}"
                 + (", sequence parallel" if s.sequence_parallel else "")))
        add(Term("loss vocabulary", vocab, "update", "cpu-validated", how))
    if not s.on_gpu:  # glibc's heap serves the layers' tensors under its 32 MiB limit
        acts = next(x.nbytes for x in est.terms if x.name == "activations")
        sizes = cpu_layer_tensors(arch, s, tokens=s.micro_batch * s.seq)
        heap = sum(x for x in sizes if x < GLIBC_MMAP_MAX) / sum(sizes)
        add(Term("heap retention (CPU)", CPU_HEAP_RETENTION * heap * acts, "update",
                 "cpu-validated", f"glibc keeps freed layer temporaries: "
                 f"{CPU_HEAP_RETENTION} x the activations under 32 MiB per tensor"))
    return est


# ----------------------------------------------------------------------- the report
def report_lines(est: Estimate) -> list[str]:
    s = est.settings
    where = "GPU" if s.on_gpu else "CPU"
    if s.device == "auto":
        where += " (platform.device=auto; platform.device=cpu for the CPU model)"
    out = [f"memory per rank by phase (dry-run model; {s.dtype_bytes}-byte params, "
           f"{where}):"]
    for phase, total in (("resident", est.resident), ("rollout", est.total("rollout")),
                         ("update", est.total("update"))):
        out.append(f"  {phase:8s} {total / GIB:8.2f} GiB"
                   + {"resident": "  (through both phases)",
                      "rollout": "  (rollout only)", "update": "  (update only)"}[phase])
        for x in est.terms:
            if x.phase == phase:
                out.append(f"    {x.name:22s} {x.nbytes / GIB:8.2f} GiB  [{x.basis}] {x.note}")
    out.append(f"  rollout total {est.rollout_total / GIB:8.2f} GiB   update total "
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
    if est.peak_phase == "update":
        if s.recompute != "full":
            tips.append("train.recompute_granularity=full" if s.recompute == "selective"
                        else "train.recompute_granularity=selective (or full)")
        if s.loss_chunk is None or s.loss_chunk > 1024:
            tips.append("train.loss_chunk_tokens=1024")
        if s.micro_batch > 1 or s.seq > 4096:
            tips.append("a smaller train.micro_batch_tokens / micro_batch_size")
    else:
        tips.append("a smaller rollout.max_batch_size")
    if not s.kv_released and d.get("KV cache"):
        tips.append("rollout.release_memory=true (the KV cache freed before the update)")
    tips.append("a larger TP or PP")
    return "; ".join(tips)
