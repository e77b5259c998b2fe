"""The dry run's memory formulas, one tensor family at a time: the rollout's per-stage
weights, KV cache and copies, the CUDA graphs' pools, the update's saved activations
under recomputation and the loss's vocabulary temporaries. Each takes the model's
``Settings`` (``memory_model``) as ``s``; ``memory_model.estimate`` adds them up by
phase."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.sizes import layer_params
from ..rollout.kv_cache import kv_bytes


# ----------------------------------------------------------------------- rollout
def rollout_stages(arch, tp: int, pp: int, dtype_bytes: int, seqs: int, capacity: int, *,
                   drafter: bool, mode: str = "pipelined") -> list[dict]:
    """The rollout engine's memory on each pipeline stage (one TP rank): its weights
    (read in place, not extra), the KV cache of its own layers for ``seqs`` sequences of
    ``capacity`` positions, the float32 logits of one decode step (every stage receives
    them from the last), and the copies it holds: with a drafter that reads the target's vocabulary matrices at PP > 1 the
    vocabulary matrices it does not own; in gathered mode (``rollout.pipeline_mode``,
    PP > 1) the other stages' layers and vocabulary matrices, and the KV cache of all
    layers for its share of the sequences."""
    h, v = arch.hidden_size, arch.padded_vocab_size(tp) // tp
    per_layer = layer_params(arch, tp)
    layers = arch.num_layers // pp
    kv = kv_bytes(num_layers=layers, rows=seqs, kv_heads=max(arch.num_query_groups // tp, 1),
                  capacity=capacity, head_dim=arch.kv_channels, itemsize=dtype_bytes)
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


def graph_keys(arch, s) -> dict[str, list]:
    """The keys a rollout may capture, by decoder: the target's plain step per bucket
    and, with a drafter, its verifications per bucket up to the threshold (a chain arm
    depth + 1 tokens, every width up to it when the confidence stop cuts chains; a
    tree arm verify_tokens + 1 tokens and mask width); the one-layer drafter's catch-up
    and chain steps (every width up to the draft slack) and tree steps (top_k nodes
    per row over the nodes fed so far), all with embeddings as inputs (none where no
    kind's drafting is graphed)."""
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
    if not s.graphed_drafting:  # no kind's drafting is graphed (a quantized copy drafts
        drafter = set()  # eagerly)
    return {"target": [key(*k) for k in sorted(target)],
            "drafter": [key(*k, e=True) for k in sorted(drafter)]}


# ----------------------------------------------------------------------- activations
def layer_activation_bytes(arch, s, *, tokens: int) -> float:
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


def cpu_layer_tensors(arch, s, *, tokens: int) -> list[float]:
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


def activation_bytes(arch, s, *, layers: int, in_flight: int = 1) -> float:
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


def loss_vocab_bytes(arch, s) -> tuple[float, str]:
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
