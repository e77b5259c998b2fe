"""The dry run's memory formulas, one tensor family at a time: the rollout's per-stage
weights, KV cache and copies, the CUDA graphs' pools, the update's saved activations
under recomputation and the loss's vocabulary temporaries. Each takes the model's
``Settings`` (``memory_model``) as ``s``; ``memory_model.estimate`` adds them up by
phase."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    """The tensors (bytes) one eager local-spec layer keeps for ``tokens`` positions
    (saved tensors of a real layer, ``torch.autograd.graph.saved_tensors_hooks``): 3 per
    RMSNorm of h, attention's Q, expanded K and V and output of q, SwiGLU's 2f, f, f,
    f, and the float32 softmax [b, a/t, s, s]. Selective recomputation keeps instead of
    the attention's the fused QKV output whole (q + 2 kvw: V, saved for the recomputed
    core attention, is a view of it), the rotary outputs of Q and K and the output."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    t, db = s.tp, s.dtype_bytes
    attn = [q + 2 * kvw, q, kvw, q] if s.recompute == "selective" else [q] * 4
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


def recomputed_bytes(arch, s, *, layers: int) -> float:
    """Of ``activation_bytes`` under full recomputation, the chunk rebuilt in the
    backward (``recompute_num_layers`` layers' full activations), 0 otherwise."""
    if s.recompute != "full":
        return 0.0
    n = max(1, min(s.recompute_layers, layers))
    return n * layer_activation_bytes(arch, replace(s, recompute="none"),
                                      tokens=s.micro_batch * s.seq)


def loss_vocab_bytes(arch, s) -> tuple[float, str]:
    """The loss's vocabulary-sized tensors on the last stage at the micro-batch's worst
    moment (the layers' activations are all alive at each), with T = b x S positions,
    V the vocabulary shard, c = ``train.loss_chunk_tokens`` rows (``rl/token_stats.py``;
    the whole micro-batch's loss rows when 0) and db the model's bytes per element:

    - the output layer's [S, b, V] result and the model's transposed copy [b, S, V]
      (the logits), for a moment both: 2·T·V·db;
    - the loss's forward: the logits and one chunk's fp32 rows, their exp and the
      product inside ``linalg.vecdot``: T·V·db + 3·c·V·4 (+ the rows in the model
      dtype before the cast when it is not fp32);
    - its backward: the logits, the gradient of the logits (model dtype, written chunk
      by chunk) and one chunk's fp32 log-probs and softmax: 2·T·V·db + 2·c·V·4 (+ the
      chunk's gradient rows cast to the model dtype); the entropy bonus works in place
      on the same two (no further chunk);
    - the output layer's backward: the gradient of the logits, its contiguous [S, b, V]
      copy (megatron-core's weight-gradient GEMM) and the weight gradient V x h in the
      model dtype: 2·T·V·db + V·h·db (the logits themselves are freed by then)."""
    v = arch.padded_vocab_size(s.tp) // s.tp
    db, n, T = s.dtype_bytes, s.loss_tokens, s.micro_batch * s.seq
    c = min(s.loss_chunk or n, n) if n else 0
    cast = 0 if db == 4 else c * v * db
    moments = {
        "output layer": 2 * T * v * db,
        "loss forward": T * v * db + 3 * c * v * 4 + cast,
        "loss backward": 2 * T * v * db + 2 * c * v * 4 + cast,
        "output layer backward": 2 * T * v * db + v * arch.hidden_size * db,
    }
    worst = max(moments, key=moments.get)
    return moments[worst], f"logits {T} x V/TP, loss in chunks of {c} rows; worst: {worst}"


def loss_token_bytes(s) -> tuple[float, str]:
    """The loss's per-token tensors ([b, S] fp32, rl/grpo.py ``policy_loss``): the
    log-probs and entropies scattered back, the old / rollout (/ reference) log-probs of
    the micro-batch, the ratio, the clipped surrogate and their autograd copies, and per
    option a few more (dual clip 4, TIS 3, the KL term 4, the entropy bonus 2). Small
    next to the vocabulary: modelled so every option has its term."""
    count = 24 + 4 * bool(s.dual_clip) + 3 * bool(s.tis) + 4 * bool(s.reference) \
        + 2 * bool(s.entropy_grad)
    return count * s.micro_batch * s.seq * 4, f"{count} [b, S] fp32 tensors"


def logprob_pass_bytes(arch, s, *, reference: bool) -> tuple[float, str]:
    """A forward-only log-prob pass over one micro-batch (the old policy's,
    ``Policy.logprobs``, or the reference's, ``Trainer._fill_logprobs``) at its worst
    moment: the output layer's result and the model's transposed copy (2·T·V·db), then
    ``models.inference.token_logprobs``' fp32 copy beside the logits (megatron-core's
    cross-entropy works in place on it): T·V·(db + 4). The reference pass keeps the
    previous micro-batch's logits until the next forward returns (one T·V·db more at
    the output layer), a layer's forward temporaries beside it are small."""
    v = arch.padded_vocab_size(s.tp) // s.tp
    db, T = s.dtype_bytes, s.micro_batch * s.seq
    out = (3 if reference else 2) * T * v * db
    return max(out, T * v * (db + 4)), f"logits {T} x V/TP, fp32 log-softmax copy"


def forward_layer_bytes(arch, s) -> float:
    """One layer's forward temporaries without saving (a no-grad forward: the log-prob
    passes, a recomputed layer's own forward is in ``activation_bytes``): the residual,
    norm and a spare of h, the larger of attention's (QKV, rotary copies, the output)
    and the MLP's (fc1's 2f, SiLU, the product) and, unfused (CPU), the attention's
    scores and softmax [b, a/t, S, S] in fp32."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    t, T, db = s.tp, s.micro_batch * s.seq, s.dtype_bytes
    width = 3 * h + max(q + 2 * kvw + 3 * (q + kvw) + q, 4 * f) / t
    scores = 0 if s.on_gpu else 2 * s.micro_batch * arch.num_attention_heads / t * s.seq ** 2 * 4
    return T * db * width + scores


def optimizer_step_bytes(arch, s, shard: float) -> float:
    """Temporaries of the optimizer step (after the backward, the activations freed):
    torch's AdamW (megatron-core's fallback without Transformer Engine or Apex), on CPU
    one parameter at a time (the square root of the second moment and its scaled copy:
    2 x the largest matrix, the vocabulary one, in fp32), on GPU over all tensors at once
    (``_foreach_sqrt`` of the second moments: the rank's optimizer shard in fp32)."""
    if not s.on_gpu:
        return 2 * (arch.padded_vocab_size(s.tp) // s.tp) * arch.hidden_size * 4
    return shard * 4 / (s.dp if s.distributed_optimizer else 1)


# ----------------------------------------------------------------------- micro-batches
def budget_shapes(*, capacity: int, max_new: int, rows: int, micro_batch_size: int,
                  micro_batch_tokens: int, multiple: int = 1) -> list[tuple]:
    """The micro-batches ``rl/samples.plan_micro_batches`` can build from ``rows``
    samples of at most ``capacity`` positions, as (rows, positions, loss rows): for each
    row count r, the longest positions r samples may have under the token budget
    (``micro_batch_tokens``; one sample over it has a micro-batch of its own, at any
    length up to ``capacity``), each with every response at most ``max_new`` tokens.
    Positions round up to ``multiple`` (sequence parallelism's TP, ``MicroBatch.fitted``).
    The dry run takes the worst of them: shorter samples can make a micro-batch of more
    rows and more positions in all than the cap's."""
    out = set()
    for r in range(1, max(1, min(micro_batch_size, rows)) + 1):
        longest = capacity if r == 1 or not micro_batch_tokens \
            else min(capacity, micro_batch_tokens // r)
        if longest < 2:
            break
        out.add((r, -(-longest // multiple) * multiple, r * min(max_new, longest - 1)))
    return sorted(out)


def planned_shapes(lengths, *, group_size: int, mini_batches: int, micro_batch_size: int,
                   micro_batch_tokens: int, multiple: int = 1) -> list[tuple]:
    """The micro-batches the trainer builds from a step's samples, (rows, positions,
    loss rows) each: ``lengths`` one (prompt, response) token count per sample in step
    order (prompt-major groups of ``group_size``), split into mini-batches by prompt
    (``prompt % mini_batches``), each planned as ``plan_micro_batches`` does (sorted by
    length, at most ``micro_batch_size`` samples and ``micro_batch_tokens`` padded
    positions) and fitted to its longest sample."""
    out = []
    for m in range(mini_batches):
        mine = sorted((p + r, r) for i, (p, r) in enumerate(lengths)
                      if (i // group_size) % mini_batches == m)
        cur: list = []
        for total, resp in mine:
            longest = max([x for x, _ in cur] + [total])
            over = micro_batch_tokens and longest * (len(cur) + 1) > micro_batch_tokens
            if cur and (len(cur) >= micro_batch_size or over):
                out.append(cur)
                cur = []
            cur.append((total, resp))
        if cur:
            out.append(cur)
    return sorted({(len(c), -(-max(x for x, _ in c) // multiple) * multiple,
                    sum(r for _, r in c)) for c in out})
