"""Per-rank memory of one RL step, by phase: pure arithmetic on the config and the
architecture (no torch), for ``pretrain_rl_tlt.py --dry-run``.

A step has two phases that never overlap in time:

- rollout: the engine decodes on the trained weights (read in place) with its KV cache,
  the logits of a decode step, a prefill chunk's working set, and with speculation the
  drafter, its KV cache and the feature store; at PP > 1 in gathered mode copies of the
  other stages' weights;
- update: forward/backward of one micro-batch at a time under the configured
  recomputation, plus the loss's vocabulary-sized temporaries on the last stage.

What lives through both (weights, fp32 gradient buffers, optimizer state, the frozen
reference model when ``grpo.kl_beta > 0``, the CPU kernels' packed weight copies, and
the KV cache unless it is released before the update) is *resident*. The peak is
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

from ..spec_strategy import Strategy, parse_arms

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
    drafter: bool
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
        reference=g.kl_beta > 0, drafter=bool(r.speculative.drafter)
        or bool(cfg.drafter_group.enable),
        gathered=pp > 1 and r.pipeline_mode == "gathered",
        cpu_kernels=not on_gpu and dtype_bytes == 4 and r.cpu_kernels != "false",
        kv_released=bool(getattr(r, "release_memory", True)) if kv_released is None
        else kv_released,
        device=str(cfg.platform.device),
        cuda_graphs=on_gpu and r.cuda_graphs != "false"
        and not (pp > 1 and r.pipeline_mode == "pipelined"),
        arms=_arms(r.speculative) if r.speculative.drafter or cfg.drafter_group.enable
        else (),
        spec_threshold=r.speculative.threshold,
        cut_chains=r.speculative.min_draft_prob > 0)


def _arms(sc) -> tuple:
    """Every speculative strategy the tuner may pick, as (depth, top_k, verify_tokens)."""
    arms = [a for bucket in parse_arms(sc.arms, sc.buckets).values() for a in bucket]
    if sc.policy == "fixed":
        arms.append(Strategy.parse(sc.strategy))
    return tuple(sorted({(a.depth, a.top_k, a.verify_tokens) for a in arms if not a.is_off}))


# ----------------------------------------------------------------------- weights
def layer_params(arch, tp: int) -> float:
    """One decoder layer's parameters on one TP rank (norms replicated)."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    bias = (q + 2 * kvw) if arch.qkv_bias else 0
    return (h * (q + 2 * kvw) + bias + q * h + 3 * h * arch.ffn_hidden_size) / tp + 2 * h


def stage_params(arch, tp: int, pp: int, stage: int) -> float:
    """Parameters of pipeline stage ``stage`` on one TP rank: its layers and the
    vocabulary matrices it owns (the embedding on the first, the output layer on the
    last, one shared matrix at PP = 1 with tied embeddings)."""
    v = arch.padded_vocab_size(tp) // tp
    first, last = stage == 0, stage == pp - 1
    mats = int(first) + int(last and (pp > 1 or not arch.tie_word_embeddings))
    return (arch.num_layers // pp) * layer_params(arch, tp) + mats * v * arch.hidden_size \
        + (arch.hidden_size if last else 0)


def rollout_stages(arch, tp: int, pp: int, dtype_bytes: int, seqs: int, capacity: int, *,
                   drafter: bool, mode: str = "pipelined") -> list[dict]:
    """The rollout engine's memory on each pipeline stage (one TP rank): its weights
    (read in place, not extra), the KV cache of its own layers for ``seqs`` sequences of
    ``capacity`` positions, the float32 logits of one decode step (every stage receives
    them from the last), and the copies it holds: with a drafter at PP > 1 the
    vocabulary matrices it does not own; in gathered mode (``rollout.pipeline_mode``,
    PP > 1) the other stages' layers and vocabulary matrices, and the KV cache of all
    layers for its share of the sequences."""
    h, v = arch.hidden_size, arch.padded_vocab_size(tp) // tp
    per_layer = layer_params(arch, tp)
    layers = arch.num_layers // pp
    kv = kv_bytes(arch, tp, layers, seqs, capacity, dtype_bytes)
    logits = seqs * arch.vocab_size * 4
    gathered = mode == "gathered" and pp > 1
    share = -(-seqs // pp)
    if gathered:
        kv = kv * pp * share // seqs
        logits = share * arch.vocab_size * 4
    out = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        vocab_mats = int(first) + int(last and (pp > 1 or not arch.tie_word_embeddings))
        weights = (layers * per_layer + vocab_mats * v * h) * dtype_bytes
        copies = (2 - vocab_mats) * v * h * dtype_bytes if drafter and pp > 1 else 0
        if gathered:
            mats = (0 if first or (last and pp == 2) else 1) if arch.tie_word_embeddings \
                else int(not first) + int(not last)
            copies = ((pp - 1) * layers * per_layer + mats * v * h) * dtype_bytes
        out.append(dict(stage=s, first_layer=s * layers, last_layer=(s + 1) * layers - 1,
                        weights=weights, kv=kv, logits=logits, copies=copies,
                        gathered=gathered, share=share))
    return out


def kv_bytes(arch, tp: int, layers: int, rows: int, capacity: int, dtype_bytes: int) -> float:
    return (2 * layers * rows * max(arch.num_query_groups // tp, 1) * capacity
            * arch.kv_channels * dtype_bytes)


# ----------------------------------------------------------------------- CUDA graphs
def graph_buckets(rows: int) -> list[int]:
    """The batch-size buckets graphs are captured at (``rollout.cuda_graphs.bucket_for``):
    1, 2, 4, ... below ``rows``, then ``rows``."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return out + [rows]


@dataclass
class GraphKey:
    """One captured forward's memory (``rollout/cuda_graphs.py``): its static input
    buffers (ordinary allocations), its static output (held in the pool) and its
    forward's working set at the peak (in the pool during capture, then free there for
    the next key's capture)."""

    inputs: float
    output: float
    working: float


def graph_key_bytes(arch, *, tp: int, dtype_bytes: int, bucket: int, tokens: int,
                    width: int, capacity: int, embeds: bool = False) -> GraphKey:
    """The memory of the key (``bucket`` rows, ``tokens`` new tokens per row, tree mask
    ``width`` or 0, the drafter's inputs as ``embeds``) over a cache of ``capacity``
    positions (the span a graphed step attends over), on one TP rank.

    Working set (the torch path with SDPA, ``ModelRunner.extend``): the additive
    attention mask [bucket, 1, tokens x query heads per group (tokens > 1), capacity]
    held through the forward, and at its peak either the mask's construction (int64
    relative indices [bucket, capacity], bools and a model-dtype [bucket, tokens,
    capacity] before the per-head copy; a tree's gathered mask and its bounds) or one
    layer's temporaries for the n = bucket x tokens new tokens: the residual, the norm
    and a spare of h, and the larger of attention's (QKV, and three rotary temporaries
    of Q and K) and the MLP's (fc1's 2f, SiLU and the gated product) widths, with the
    rotary tables (3 x n x head_dim)."""
    h, f, d, db = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels, dtype_bytes
    q = arch.num_attention_heads * d / tp
    kvw = max(arch.num_query_groups // tp, 1) * d
    hpg = arch.num_attention_heads // max(arch.num_query_groups, 1)
    n = bucket * tokens
    inputs = n * 8 + bucket * 8 + (n * 8 + n * width if width else 0) \
        + (n * h * db if embeds else 0)
    output = n * h * db
    bias = bucket * (tokens * hpg if tokens > 1 else 1) * capacity * db
    building = bucket * capacity * 16 + bucket * tokens * capacity * (db + 3) \
        + (bucket * tokens * capacity * 2 if width else 0)
    layer = n * db * (3 * h + max(q + 2 * kvw + 3 * (q + kvw), 4 * f / tp) + 3 * d)
    return GraphKey(inputs, output, bias + max(building, layer))


def graph_pool_bytes(keys: list) -> tuple[float, float]:
    """(pool, static inputs) of one decoder's keys (``GraphKey``s) sharing one pool:
    the keys' outputs and the largest working set (a capture reuses the blocks the
    earlier captures' intermediates freed), and the input buffers beside it."""
    if not keys:
        return 0.0, 0.0
    return (sum(k.output for k in keys) + max(k.working for k in keys),
            sum(k.inputs for k in keys))


def graph_keys(arch, s: "Settings") -> dict[str, list]:
    """The keys a rollout may capture, by decoder: the target's plain step per bucket
    and, with a drafter, its verifications per bucket up to the threshold (a chain arm
    depth + 1 tokens, every width up to it when the confidence stop cuts chains; a
    tree arm verify_tokens + 1 tokens and mask width); the one-layer drafter's catch-up
    and chain steps (every width up to the draft slack) and tree steps (top_k nodes
    per row over the nodes fed so far), all with embeddings as inputs."""
    db, cap = s.dtype_bytes, s.capacity
    key = lambda b, t, w=0, e=False: graph_key_bytes(  # noqa: E731
        arch, tp=s.tp, dtype_bytes=db, bucket=b, tokens=t, width=w, capacity=cap, embeds=e)
    buckets = graph_buckets(max(s.rollout_rows, 1))
    target = {(b, 1, 0) for b in buckets}
    drafter = set()
    spec = [b for b in buckets if b <= max(s.spec_threshold, 1)] if s.arms else []
    slack = max([max(v, (dp - 1) * k) for dp, k, v in s.arms] or [0]) + 2
    for b in spec:
        for depth, top_k, verify in s.arms:
            if top_k == 1:
                lo = 2 if s.cut_chains else depth + 1
                target |= {(b, t, 0) for t in range(lo, depth + 2)}
            else:
                target.add((b, verify + 1, verify + 1))
                drafter |= {(b, top_k, 1 + top_k * dd) for dd in range(1, depth)}
        drafter |= {(b, t, 0) for t in range(1, slack + 1)}
    return {"target": [key(*k) for k in sorted(target)],
            "drafter": [key(*k, e=True) for k in sorted(drafter)]}


# ----------------------------------------------------------------------- activations
def layer_activation_bytes(arch, s: Settings, *, tokens: int) -> float:
    """Bytes one decoder layer keeps for its backward for ``tokens`` = b x seq positions
    of one micro-batch, with no recomputation.

    GPU (Transformer Engine / fused kernels, 16-bit): Korthikanti et al. 2022 per
    token, in 16-bit units of h: without sequence parallelism 10 + 24/t, with it
    34/t, plus 5·a·s/(h·t) for the attention scores; "24" is the attention's
    Q, K, V and projection input (4q + 4kvw bytes) and the MLP's fc1 output and fc2
    input (6f for SwiGLU, 16h for GPT's 4h GELU), written here for GQA and SwiGLU.

    CPU (local spec, eager): counted from the autograd graph of megatron-core's local
    layer: each RMSNorm keeps its input, normalised input and output (3h), core
    attention keeps Q, the GQA-expanded K and V, its output (4q) and the softmax
    probabilities in float32 (a·s per token), SwiGLU keeps fc1's output (2f), the
    gate's copy (f), SiLU's output (f) and fc2's input (f)."""
    if not s.on_gpu:
        return sum(cpu_layer_tensors(arch, s, tokens=tokens))
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    a, t, seq, db = arch.num_attention_heads, s.tp, s.seq, s.dtype_bytes
    replicated = 10 * h / (t if s.sequence_parallel else 1)
    per_token = db / 2 * (replicated + (4 * q + 4 * kvw + 6 * f) / t)
    scores = 0 if s.recompute == "selective" else 5 * a * seq / t * db / 2
    return tokens * (per_token + scores)


def cpu_layer_tensors(arch, s: Settings, *, tokens: int) -> list[float]:
    """The tensors (bytes) one eager local-spec layer keeps for ``tokens`` positions:
    3 per RMSNorm of h, attention's Q, expanded K and V and output of q (selective
    recomputation: Q, K, V before the expansion and the output), SwiGLU's 2f, f, f, f,
    and the float32 softmax [b, a/t, s, s] unless recomputed."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    t, db = s.tp, s.dtype_bytes
    attn = [q, kvw, kvw, q] if s.recompute == "selective" else [q] * 4
    widths = [h] * 6 + [w / t for w in attn] + [2 * f / t] + [f / t] * 3
    out = [tokens * w * db for w in widths]
    if s.recompute != "selective":
        out.append(tokens * arch.num_attention_heads / t * s.seq * 4)
    return out


def activation_bytes(arch, s: Settings, *, layers: int, in_flight: int = 1) -> float:
    """Saved activations of ``layers`` layers for ``in_flight`` micro-batches under
    the configured recomputation (the whole stage's layers of each micro-batch whose
    backward has not run yet)."""
    tokens = s.micro_batch * s.seq
    full = layer_activation_bytes(arch, s, tokens=tokens)
    inputs = tokens * arch.hidden_size * s.dtype_bytes / (s.tp if s.sequence_parallel else 1)
    if s.recompute == "full":
        n = max(1, min(s.recompute_layers, layers))
        if s.recompute_method == "block":  # the first n layers recomputed, the rest kept
            kept = n * inputs + (layers - n) * full
        else:  # chunks of n layers: each chunk's input kept
            kept = math.ceil(layers / n) * inputs
        # the backward recomputes one chunk at a time: its full activations, once
        return in_flight * kept + n * full
    return in_flight * layers * full


def loss_vocab_bytes(arch, s: Settings) -> tuple[float, str]:
    """The loss's vocabulary-sized tensors on the last stage, at their worst moment.

    Unchunked (the whole micro-batch at once): the logits [b, S, V/t] stay alive; the
    loss rows are copied out ([n, V/t]), log-probs work on a float32 copy
    (megatron-core's cross-entropy keeps it as the softmax), the entropy metric makes
    three float32 [n, V/t] temporaries (x - max, exp, product); in the backward the
    logits' gradient is materialised twice ([b, S, V/t] from the row selection and a
    contiguous copy for the output layer) next to the kept softmax.

    Chunked (``train.loss_chunk_tokens`` = c, rl/token_stats.py): the logits stay
    alive; the forward makes per chunk an fp32 copy of its rows, their exp and the
    product inside ``linalg.vecdot`` (3 x [c, V/t] fp32); the backward writes the
    logits' gradient [b, S, V/t] chunk by chunk (per chunk the rows and their softmax in
    fp32, and the gradient rows in the model dtype when it is not fp32), and the output
    layer's backward makes a contiguous copy of it."""
    v = arch.padded_vocab_size(s.tp) // s.tp
    db, n, T = s.dtype_bytes, s.loss_tokens, s.micro_batch * s.seq
    if s.loss_chunk is None:
        fwd = T * v * db + n * v * (db + 4 + (0 if db == 4 else 4) + 12)
        bwd = 3 * T * v * db + n * v * (4 + (0 if db == 4 else db))
        return max(fwd, bwd), f"whole micro-batch: {n} loss rows, {T} positions"
    c = min(s.loss_chunk, n)
    fwd = T * v * db + 3 * c * v * 4
    bwd = max(2 * T * v * db + c * v * (8 + (0 if db == 4 else db)), 3 * T * v * db)
    return max(fwd, bwd), f"logits {T} x V/TP, loss in chunks of {c} rows"


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
                            drafter=s.drafter, mode="gathered" if s.gathered else "pipelined")
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
    if s.drafter:
        rows = s.rollout_rows
        add(Term("drafter", (layer_params(arch, tp) + 2 * h * h / tp) * db, "resident",
                 "exact", "one layer + fc"))
        add(Term("drafter KV + features", kv_bytes(arch, tp, 1, rows, s.capacity, db)
                 + rows * s.capacity * h * db, "rollout" if s.kv_released else "resident",
                 "exact", "its KV cache, the feature store (the responses' hidden states)"))
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
