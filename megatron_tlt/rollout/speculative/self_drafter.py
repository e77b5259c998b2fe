"""The self-drafter: the policy's own weight-only int8 copy as a drafter.

A drafter that is a cheaper copy of the policy agrees with it far better than a
one-layer drafter (SmolLM2-135M at T=1: α 0.967 for an int8 copy with one scale per
output channel against 0.23-0.44 for the one-layer drafter, docs/benchmarks.md), needs
no training and cannot go stale: it is re-quantized from the current weights whenever
they changed (``SelfDraftRunner.pack_weights``, called at the start of every
``generate``), so after every policy update on every replica, bit-identically
(quantization is elementwise, ``rollout/speculative/quantize.py``).

``SelfDraftRunner`` is a full-depth ``ModelRunner`` over quantized weights: every linear
(QKV, output projection, fc1, fc2) and the LM head are int8 (``quantize_int8``: per
output channel, or per group of inputs), the norms float copies, the embedding the
target's own (a row lookup). Optionally the LM head keeps only a draft vocabulary's
rows (``draft_vocabulary_by_mass``: the tokens carrying the most p̃ mass), which shrinks
the head's share of the weight stream. Under tensor parallelism each rank quantizes its
own shards (column-parallel rows are whole channels; a row-parallel shard's scales
cover its slice of the inputs), and the forward reduces over the TP group exactly as
the target's runner does.

It is fed tokens, not target features: ``SelfDraftDecoder`` (``self_decoder.py``) keeps
its own KV cache in step with the accepted tokens and drafts through the same chain and
tree code (``drafting.py``) as the one-layer drafter, so verification is unchanged.

    engine.attach_drafter(SelfDrafter(group=0, draft_vocab=ids))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...config.kinds.self_drafter import SELF_ARMS, SelfSettings
from ...config.sections import DEFAULT_ARMS
from .drafter_kind import Drafter, MemoryTerm, own_kv_bytes
from .quantize import check_blocks
from .quantize_fp8 import resolve_format


@dataclass
class SelfDrafterConfig:
    """The quantized copy's settings."""

    group: int = 0  # inputs per int8 scale; 0 = one scale per output channel
    act_block: int = 32  # inputs per activation scale (int8 activations); 0 = float
    # "int8", "fp8" (E4M3 through torch._scaled_mm, quantize_fp8.py: activations scaled
    # per row, act_block unused) or "auto" (fp8 where the device multiplies it natively
    # and group is 0, else int8)
    format: str = "auto"
    feature_layers: tuple = field(default=(), init=False)  # no EAGLE features

    def __post_init__(self):
        check_blocks(self.group, self.act_block)
        resolve_format(self.format, torch.device("cpu"), self.group)  # checks the pair

    def check_target(self, arch) -> None:
        """Any target: the copy is made from it."""

    def to_dict(self) -> dict:
        return {"group": self.group, "act_block": self.act_block, "format": self.format}


class SelfDrafter(Drafter):
    """The self-drafter: the copy's settings and, optionally, a draft vocabulary (sorted
    target token ids; None = the full vocabulary) and a ``source`` runner to quantize
    instead of the target (tests use another model's weights for a deliberately poor
    copy). Config value ``self``; its settings are ``rollout.speculative.kinds.self``
    (``config/kinds/self_drafter.py``)."""

    name = "self"
    label = "the self-drafter"
    color = "tab:orange"
    fed = "tokens"
    copies_policy = True
    settings_section = SelfSettings

    def __init__(self, group: int = 0, draft_vocab: Optional[torch.Tensor] = None,
                 source=None, act_block: int = 32, format: str = "auto"):
        self.config = SelfDrafterConfig(group=group, act_block=act_block, format=format)
        self.draft_vocab = None if draft_vocab is None else torch.sort(
            torch.as_tensor(draft_vocab, dtype=torch.long)).values
        self.source = source
        self._runner = None  # the copy (``SelfDraftRunner``), kept across attaches

    def settings(self) -> dict:
        return {"kind": self.name, **self.config.to_dict()}

    def make_decoder(self, target):
        """The ``SpeculativeDecoder`` for ``target``'s rows (``self_decoder``). The
        quantized copy is kept across attaches to the same target: attaching again
        re-quantizes only if the weights changed since (``pack_weights``)."""
        from .self_decoder import SelfDraftDecoder

        return SelfDraftDecoder(self, target)

    def runner_for(self, target):
        """This drafter's copy of ``target`` (a ``SelfDraftRunner``): the kept one, or a
        new one."""
        from .self_runner import SelfDraftRunner

        if self._runner is None or self._runner.target is not target:
            self._runner = SelfDraftRunner(target, self)
        return self._runner

    def token_runner(self, target):
        """The copy of ``target``, on its kernels, quantized from its current weights."""
        copy = self.runner_for(target)
        copy.kernels = target.kernels  # (the copy's panels follow the kernels)
        copy.pack_weights()
        return copy

    @classmethod
    def joins(cls, sc) -> bool:
        return cls.section(sc).also

    @classmethod
    def check_settings(cls, sc) -> None:
        """``also`` adds the self-drafter beside a drafter of another kind."""
        from ...config import ConfigError

        if cls.section(sc).also and sc.drafter in ("", cls.name):
            raise ConfigError("rollout.speculative.kinds.self.also=true needs a drafter "
                              "checkpoint in rollout.speculative.drafter (the kind the "
                              f"self-drafter is weighed against), got {sc.drafter!r}")

    @classmethod
    def tuner_config(cls, sc):
        """``sc`` with the self-drafter's arms: ``kinds.self.arms``, or with auto
        ``SELF_ARMS`` while ``arms`` is the default (else ``arms``); empty: ``arms``."""
        arms = cls.section(sc).arms
        if arms == "":
            return sc
        if arms == "auto":
            arms = SELF_ARMS if sc.arms == DEFAULT_ARMS else sc.arms
        return dataclasses.replace(sc, arms=arms)

    @classmethod
    def from_value(cls, value: str, *, arch, dtype, device, sc=None,
                   seed: int = 0) -> Optional["SelfDrafter"]:
        if value != cls.name:
            return None
        if sc is None:
            return cls()
        s = cls.section(sc)
        return cls(group=s.group, act_block=s.act_block, format=s.format)

    @classmethod
    def check_layout(cls, cfg) -> None:
        """At PP > 1 the copy quantizes the gathered rollout's whole-model copy; the
        stage-to-stage rollout holds one stage's layers per rank."""
        from ...config import ConfigError

        pp = cfg.parallel.pipeline_model_parallel_size
        if pp > 1 and cfg.rollout.pipeline_mode != "gathered":
            raise ConfigError(
                f"the self-drafter (rollout.speculative.drafter=self or "
                f"rollout.speculative.kinds.self.also=true) at "
                f"parallel.pipeline_model_parallel_size={pp} needs rollout.pipeline_mode="
                f"gathered (every pipeline rank then quantizes its copy of the whole "
                f"model), got rollout.pipeline_mode={cfg.rollout.pipeline_mode}")

    # ---------------------------------------------------------------- the dry run
    @classmethod
    def kv_layers(cls, arch) -> int:
        return arch.num_layers  # the copy holds all layers (gathered at PP > 1)

    @classmethod
    def memory_terms(cls, arch, s, sc) -> list[MemoryTerm]:
        """Its quantized copy (resident: kept through the update and re-quantized after
        it) and the copy's KV cache for the rollout (all layers, up to the speculation
        threshold's rows). Exact: the tensors ``SelfDraftRunner`` and
        ``SelfDraftDecoder.begin`` allocate (tests/rl/test_memory_model.py)."""
        fmt = copy_format(sc, s.on_gpu)
        rows, positions = copy_kv_rows(s), copy_kv_positions(s, fmt)
        kv = own_kv_bytes(arch, s, layers=arch.num_layers, rows=rows, positions=positions)
        packed = " (CPU kernels' panels)" if s.cpu_kernels and fmt == "int8" else ""
        experts = " and int8 experts" if arch.is_moe else ""
        return [MemoryTerm("self-drafter copy", copy_bytes(arch, s, sc, fmt), "resident",
                           f"the policy's {fmt} copy, all layers{experts} and the LM "
                           f"head{packed}; kept through the update"),
                MemoryTerm("self-drafter KV", kv, "rollout",
                           f"all layers, {rows} rows (up to the threshold) x "
                           + (f"{s.capacity + s.draft_slack + 1} positions in blocks "
                              "(paged, in the KV budget)" if s.kv_paged
                              else f"{positions} positions"))]


def copy_format(sc, on_gpu: bool) -> str:
    """The copy's number format: ``kinds.self.format``, where "auto" is FP8 on a GPU
    (compute capability >= 8.9 taken as given) with per-channel scales, else int8."""
    s = SelfDrafter.section(sc)
    if s.format != "auto":
        return s.format
    return "fp8" if on_gpu and s.group == 0 else "int8"


def copy_matrices(arch, tp: int) -> list[tuple[int, int]]:
    """(rows, inputs) of every int8 linear of the copy on one TP rank: each layer's QKV
    and projection shards, a dense layer's fc1 (gate and up) and fc2 shards, and the LM
    head's vocabulary shard (the copy holds all layers, also at PP > 1: the gathered
    mode). A mixture-of-experts layer's experts: ``copy_expert_matrices``."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kvw = arch.num_attention_heads * d, arch.num_query_groups * d
    attn, mlp = [((q + 2 * kvw) // tp, h), (h, q // tp)], [(2 * f // tp, h), (h, f // tp)]
    out = []
    for i in range(arch.num_layers):
        out += attn + ([] if arch.is_moe_layer(i) else mlp)
    return out + [(arch.padded_vocab_size(tp) // tp, h)]


def copy_expert_matrices(arch, tp: int, ep: int) -> list[tuple[int, int, int]]:
    """(experts, rows, inputs) of every stacked int8 expert tensor of the copy on one
    rank: per MoE layer this rank's num_experts / EP experts' fc1 [2F/TP, H] and fc2
    [H, F/TP] (``quantize_experts``)."""
    e, h, f = arch.num_experts // max(ep, 1), arch.hidden_size, arch.moe_ffn_hidden_size
    return [(e, 2 * f // tp, h), (e, h, f // tp)] * len(arch.moe_layers)


def copy_bytes(arch, s, sc, fmt: str) -> float:
    """Bytes the copy holds (``SelfDraftRunner.nbytes``): per matrix [N, K] with
    G = ceil(K / group) scales per row,

    - int8 without the CPU kernels: q (N x K) and float32 scales (N x G);
    - int8 packed for the CPU kernels (CPU float32): only their panel copy, rows padded
      to the panel width P (inputs to a multiple of 4 with int8 activations), its
      scales in panel layout (Np x G) and the scales (N x G);
    - FP8: the E4M3 matrix padded to multiples of 16 and a float32 scale per padded row;
    - experts (whatever the format): int8 q (E x N x K) and float32 scales (E x N x G);

    plus the norms (2 per layer and the final one, Qwen3's per-head query and key norms),
    the QKV biases, an MoE layer's router (num_experts x hidden) and RoPE's sign vector
    (head_dim) in the model's dtype. The embedding is the policy's own."""
    h, db = arch.hidden_size, s.dtype_bytes
    up = lambda n, m: -(-n // m) * m  # noqa: E731
    packed = fmt == "int8" and s.cpu_kernels
    own = SelfDrafter.section(sc)
    group, act_block = own.group, own.act_block
    total = 0
    for n, k in copy_matrices(arch, s.tp):
        if fmt == "fp8":
            total += up(n, 16) * up(k, 16) + 4 * up(n, 16)
            continue
        groups = -(-k // (min(group, k) if group else k))
        if packed:
            rows = up(n, max(s.panel_rows, 1))
            total += rows * (up(k, 4) if act_block else k) + 4 * rows * groups
        else:
            total += n * k
        total += 4 * n * groups
    for e, n, k in copy_expert_matrices(arch, s.tp, s.ep):
        groups = -(-k // (min(group, k) if group else k))
        total += e * n * k + 4 * e * n * groups
    bias = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.kv_channels // s.tp \
        if arch.qkv_bias else 0
    qk = 2 * arch.kv_channels if arch.qk_layernorm else 0
    small = arch.num_layers * (2 * h + bias + qk) + h + arch.kv_channels \
        + len(arch.moe_layers) * arch.num_experts * h
    return total + small * db


def copy_kv_rows(s) -> int:
    """The copy's cache rows: the engine's running-batch bound (each stage's share in
    the gathered mode) up to the speculation threshold (batches above it decode
    plainly; ``SelfDraftDecoder.begin``)."""
    rows = -(-s.rollout_rows // s.pp) if s.gathered else s.rollout_rows
    return max(1, min(max(rows, 1), s.spec_threshold or rows))


def copy_kv_positions(s, fmt: str) -> int:
    """Positions per row of the copy's cache: the call's capacity, the draft slack and
    the root; without the CPU kernels (the padded catch-up) a capacity more."""
    kernels = s.cpu_kernels and fmt == "int8"
    return s.capacity + s.draft_slack + 1 + (0 if kernels else s.capacity)
