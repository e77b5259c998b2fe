"""The self-drafter's memory for the dry run (``memory_model``): its quantized copy of
the policy and the copy's KV cache, pure arithmetic on the architecture and the
``memory_model.Settings`` (docs/memory.md). Exact: the tensors ``SelfDraftRunner`` and
``SelfDraftDecoder.begin`` allocate (tests/rl/test_memory_model.py compares them with
what a tiny model's engine holds)."""

from __future__ import annotations

from ..spec_strategy import Strategy, parse_arms


def draft_slack(kinds: list) -> int:
    """The cache positions beyond a sequence's length that drafting and verification
    may use (``SpeculativeController.slack``) for the tuners of these kinds' settings:
    every arm and the fixed strategy (a tuner may always be switched to it)."""
    arms = [a for sc in kinds for bucket in parse_arms(sc.arms, sc.buckets).values()
            for a in bucket] + [Strategy.parse(sc.strategy) for sc in kinds]
    return max(max(a.verify_tokens, (a.depth - 1) * a.top_k) for a in arms) + 2


def self_matrices(arch, tp: int) -> list[tuple[int, int]]:
    """(rows, inputs) of every matrix of the self-drafter's copy on one TP rank: each
    layer's QKV, projection, fc1 (gate and up) and fc2 shards, and the LM head's
    vocabulary shard (the copy holds all layers, also at PP > 1: the gathered mode)."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kvw = arch.num_attention_heads * d, arch.num_query_groups * d
    layer = [((q + 2 * kvw) // tp, h), (h, q // tp), (2 * f // tp, h), (h, f // tp)]
    return layer * arch.num_layers + [(arch.padded_vocab_size(tp) // tp, h)]


def self_copy_bytes(arch, s) -> float:
    """Bytes the self-drafter's copy holds (``SelfDraftRunner.nbytes``): per matrix
    [N, K] with G = ceil(K / group) scales per row,

    - int8 without the CPU kernels: q (N x K) and float32 scales (N x G);
    - int8 packed for the CPU kernels (CPU float32): only their panel copy, rows padded
      to the panel width P (inputs to a multiple of 4 with int8 activations), its
      scales in panel layout (Np x G) and the scales (N x G);
    - FP8: the E4M3 matrix padded to multiples of 16 and a float32 scale per padded row;

    plus the norms (2 per layer and the final one), the QKV biases and RoPE's sign
    vector (head_dim) in the model's dtype. The embedding is the policy's own."""
    h, db = arch.hidden_size, s.dtype_bytes
    up = lambda n, m: -(-n // m) * m  # noqa: E731
    packed = s.self_drafter == "int8" and s.cpu_kernels
    total = 0
    for n, k in self_matrices(arch, s.tp):
        if s.self_drafter == "fp8":
            total += up(n, 16) * up(k, 16) + 4 * up(n, 16)
            continue
        groups = -(-k // (min(s.self_group, k) if s.self_group else k))
        if packed:
            rows = up(n, max(s.panel_rows, 1))
            total += rows * (up(k, 4) if s.self_act_block else k) + 4 * rows * groups
        else:
            total += n * k
        total += 4 * n * groups
    bias = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.kv_channels // s.tp \
        if arch.qkv_bias else 0
    small = arch.num_layers * (2 * h + bias) + h + arch.kv_channels
    return total + small * db


def self_kv_rows(s) -> int:
    """The self-drafter's cache rows: the engine's running-batch bound (each stage's
    share in the gathered mode) up to the speculation threshold (batches above it
    decode plainly; ``SelfDraftDecoder.begin``)."""
    rows = -(-s.rollout_rows // s.pp) if s.gathered else s.rollout_rows
    return max(1, min(max(rows, 1), s.spec_threshold or rows))


def self_kv_positions(s) -> int:
    """Positions per row of the self-drafter's cache: the call's capacity, the draft
    slack and the root; without the CPU kernels (the padded catch-up) a capacity more."""
    kernels = s.cpu_kernels and s.self_drafter == "int8"
    return s.capacity + s.self_slack + 1 + (0 if kernels else s.capacity)
