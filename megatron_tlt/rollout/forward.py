"""Incremental (KV-cached) forward over a megatron-core GPTModel's own parameters.

megatron-core's ``GPTModel.forward`` recomputes the whole sequence; its inference
contexts assume CUDA and same-position batches. Rollouts need per-sequence positions,
a shrinking batch and a per-step cost close to streaming the weights once, so this
module runs the same computation as the model's decoder layers directly on the
model's parameter tensors (references: the trainer's in-place updates are seen; the
fused CPU kernels read a panel-layout copy that ``pack_weights`` refreshes, which the
engine calls at the start of every ``generate``). It mirrors megatron-core exactly:
fused QKV laid out per query group, rotate-half RoPE from the model's own
``rotary_pos_emb``, RMSNorm, SwiGLU with the fused ``linear_fc1``, vocabulary-parallel
embedding and output layer; under tensor parallelism the row-parallel outputs and the
embedding are all-reduced over the TP group and the logits all-gathered, like the
model's own layers do.

Qwen3's query / key norm and mixture-of-experts MLPs (and the experts each token was
routed to, kept beside the keys) are ``rollout.experts``.

``extend`` is the one kernel: it appends T new tokens per sequence at per-sequence
cache positions and attends to the cached prefix plus the new tokens (causally, or with
a caller's mask among the new tokens, for tree verification). Prefill is ``extend`` from
position 0; decode is ``extend`` with T=1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import collectives
from ..models.gpt import ModelArch
from . import experts
from .cpu_kernels import MAX_FUSED_ROWS
from .flash import attend as flash_attend
from .kv_cache import KVCache
from .ops import _linear, attention_bias


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: Optional[torch.Tensor]
    proj_w: torch.Tensor
    ln2: torch.Tensor
    fc1_w: Optional[torch.Tensor]  # None on a mixture-of-experts layer
    fc2_w: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor] = None  # qk_layernorm (Qwen3)
    k_norm: Optional[torch.Tensor] = None
    router_w: Optional[torch.Tensor] = None  # mixture of experts: the router and the
    w13: Optional[torch.Tensor] = None  # local experts' stacked fc1 / fc2 (copies)
    w2: Optional[torch.Tensor] = None


def _bias(module) -> Optional[torch.Tensor]:
    b = getattr(module, "bias", None)
    return b if isinstance(b, torch.Tensor) and b.numel() > 0 else None


def _norm_weight(layer, local_name: str, linear) -> torch.Tensor:
    norm = getattr(layer, local_name, None)
    w = getattr(norm, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    return linear.layer_norm_weight  # Transformer Engine spec: norm fused into the linear


class ModelRunner:
    """Runs the target model incrementally against a ``KVCache``.

    Holds references to the model's parameters; call ``refresh()`` if the model's
    parameter tensors were replaced (in-place updates need nothing).
    """

    def __init__(self, model, arch: ModelArch):
        from megatron.core import parallel_state as ps

        self.model = model
        self.arch = arch
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        self.groups = arch.num_query_groups // self.tp_size
        self.heads_per_group = arch.num_attention_heads // arch.num_query_groups
        self.head_dim = arch.kv_channels
        self.eps = arch.norm_epsilon
        self.scale = self.head_dim ** -0.5
        # id(weight) -> (weight, its panel copy, content fingerprint at packing) for the
        # fused CPU kernels (pack_weights)
        self._panels: dict[int, tuple] = {}
        self._packed_stack: Optional[tuple] = None
        self.moe_shape = self.expert_group = self.ep_group = None
        if arch.is_moe:
            ep, er = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
            local = arch.num_experts // ep
            self.moe_shape = experts.MoeShape(arch.num_experts, arch.moe_topk,
                                              arch.moe_norm_topk_prob, er * local, local)
            # the experts' partial sums: over TP x EP (the TP group at EP = 1)
            if ep > 1:
                self.expert_group = ps.get_expert_tensor_and_model_parallel_group()
                self.ep_group = ps.get_expert_model_parallel_group()  # decode together
            else:
                self.expert_group = self.tp_group
        self.refresh()
        self._finish_init()

    @classmethod
    def from_tensors(cls, *, embed_w: torch.Tensor, layers: list["_Layer"],
                     final_norm: torch.Tensor, output_w: torch.Tensor, groups: int,
                     heads_per_group: int, eps: float = 1e-5,
                     rope_theta: float = 10000.0) -> "ModelRunner":
        """A runner over plain weight tensors (no megatron-core model, TP 1, rotate-half
        RoPE with base ``rope_theta``): the same decode paths as a model's runner. The
        CPU kernels' calibration (``kernel_policy``) times them on synthetic weights."""
        self = cls.__new__(cls)
        self.model = self.arch = None
        self.moe_shape = self.expert_group = self.ep_group = None
        self.tp_size, self.tp_rank, self.tp_group = 1, 0, None
        self.groups, self.heads_per_group = groups, heads_per_group
        self.head_dim = layers[0].qkv_w.shape[0] // (groups * (heads_per_group + 2))
        self.eps = eps
        self.scale = self.head_dim ** -0.5
        self._panels, self._packed_stack = {}, None
        self.embed_w, self.vocab_start = embed_w, 0
        self.layers = list(layers)
        self.index_layers()
        self.final_norm, self.output_w = final_norm, output_w
        self._rope_theta = rope_theta
        self._finish_init()
        return self

    # the fused kernel may end the whole decoder stack with the final norm (a runner
    # over one pipeline stage's layers sets this False)
    whole_stack = True
    pp_size = 1  # pipeline stages decoding together (rollout.pipeline)
    shares_prompts = False  # the pipeline ranks split a call's prompts (rollout.gathered)
    supports_graphs = True  # the plain decode forward can be captured (CUDA graphs)

    @property
    def decides_alone(self) -> bool:
        """Whether this rank takes the decode decisions alone (``agree`` is a no-op:
        no TP group, no pipeline stages or expert-parallel replicas decoding together)."""
        return self.tp_group is None and self.ep_group is None

    # ------------------------------------------------------------------ a call's layout
    def call_rows(self, max_batch: int) -> int:
        """The running-batch bound of this rank's share of a call whose replica runs
        ``max_batch`` rows (all of them here)."""
        return max_batch

    def run_call(self, prompts: list, decode: Callable[[list[int], bool], list], stats,
                 hidden_dtype: torch.dtype, grouped: bool = False) -> tuple[list, object]:
        """Decode one ``generate`` call: ``decode(indices, hidden_on_device)`` runs the
        generation loop over those requests and returns their ``RolloutOutput``s. Here
        this rank decodes every request. Returns the outputs in prompt order and the
        call's ``GenerateStats`` (``stats``, which the loop filled). ``grouped``: keep a
        prompt's requests on one rank where a runner splits them (share_prefill)."""
        return decode(list(range(len(prompts))), False), stats

    def _finish_init(self) -> None:
        w = self.embed_w if self.embed_w is not None else self.layers[0].qkv_w
        self.dtype = w.dtype
        self.device = w.device
        self._rope_len = 0
        self._cos = self._sin = None
        self.attention = "sdpa"  # or "flash" (set by the engine; CUDA + flash-attn only)
        # fused CPU decode kernels (set by the engine, fp32 CPU only): the built module,
        # or kernel_policy.PolicyKernels (the module and where it measured faster)
        self.kernels = None
        half = self.head_dim // 2
        self._sin_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(
            device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ weights
    def refresh(self) -> None:
        m = self.model
        self.embed_w = m.embedding.word_embeddings.weight
        self.vocab_start = self.tp_rank * self.embed_w.shape[0]
        self.set_layers(m.decoder.layers)
        self.final_norm = m.decoder.final_layernorm.weight
        self.output_w = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights \
            else m.output_layer.weight

    def set_layers(self, layers) -> None:
        """Read the weight tensors (references) of these megatron-core decoder layers
        (the experts of a mixture-of-experts layer: stacked copies, ``experts``)."""
        self.layers, self._stacks = [], []
        for layer in layers:
            att, mlp = layer.self_attention, layer.mlp
            norms = {}
            if hasattr(getattr(att, "q_layernorm", None), "weight"):
                norms = dict(q_norm=att.q_layernorm.weight, k_norm=att.k_layernorm.weight)
            if hasattr(mlp, "router"):
                stack = experts.StackedExperts(mlp)
                self._stacks.append(stack)
                mlp_w = dict(fc1_w=None, fc2_w=None, router_w=mlp.router.weight,
                             w13=stack.w13, w2=stack.w2,
                             ln2=_norm_weight(layer, "pre_mlp_layernorm", None))
            else:
                mlp_w = dict(fc1_w=mlp.linear_fc1.weight, fc2_w=mlp.linear_fc2.weight,
                             ln2=_norm_weight(layer, "pre_mlp_layernorm", mlp.linear_fc1))
            self.layers.append(_Layer(
                ln1=_norm_weight(layer, "input_layernorm", att.linear_qkv),
                qkv_w=att.linear_qkv.weight, qkv_b=_bias(att.linear_qkv),
                proj_w=att.linear_proj.weight, **norms, **mlp_w))
        self.index_layers()
        self._panels = {}
        self._packed_stack = None

    def index_layers(self) -> None:
        """Which of ``self.layers`` are mixture-of-experts layers (their index among
        them, where their routes are kept: ``route_shape``), and whether the stack is
        plain (no QK norm, no experts: the fused whole-stack kernel applies)."""
        moe = [i for i, lw in enumerate(self.layers) if lw.router_w is not None]
        self.moe_index = {i: j for j, i in enumerate(moe)}
        self.route_shape = (len(moe), self.moe_shape.topk) if moe else None
        self.plain_stack = not moe and all(lw.q_norm is None for lw in self.layers)

    def refresh_copies(self) -> None:
        """Re-copy the stacked experts from their parameters (every ``generate``; with
        the CPU kernels, the changed ones)."""
        fingerprint = None if self.kernels is None else self.kernels.fingerprint
        for stack in getattr(self, "_stacks", ()):
            stack.refresh(fingerprint)

    # ------------------------------------------------------------------ kernel choice
    def fused_ok(self, family: str, rows: int) -> bool:
        """Whether the fused CPU kernels run ``rows`` rows of ``family`` ("decode": the
        fused decoder stack; "linear": the panel GEMM of the LM head and of the general
        path; "argmax"): built, at most MAX_FUSED_ROWS rows, and where their policy
        (rollout.cpu_kernels=auto: the per-build calibration) says they are faster."""
        k = self.kernels
        if k is None or rows > MAX_FUSED_ROWS:
            return False
        policy = getattr(k, "policy", None)
        return policy is None or policy.allows(family, rows)

    @property
    def fused_max_rows(self) -> int:
        """Decode batches of 1..this many rows use the fused decoder stack."""
        k = self.kernels
        if k is None:
            return 0
        policy = getattr(k, "policy", None)
        return MAX_FUSED_ROWS if policy is None else min(MAX_FUSED_ROWS,
                                                         policy.max_rows("decode"))

    # ------------------------------------------------------------------ panel copies
    def kernel_weights(self) -> list[torch.Tensor]:
        """The weight matrices the fused CPU kernels multiply by."""
        return [w for lw in self.layers for w in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w)
                if w is not None] + [self.output_w]

    def pack_weights(self) -> None:
        """Bring the fused CPU kernels' panel copies of the weights (``cpu_kernels``: one
        in-order weight stream per matrix) up to date with the current parameters. The
        engine calls this at the start of every ``generate``, so changes to the model's
        parameters between calls are always seen; code that calls ``extend`` directly
        and changes weights in place between calls calls it too. A matrix is re-copied
        only when its content fingerprint (a 64-bit hash of every element, ~20 ms for
        SmolLM2's 540 MB against ~85 ms for the copy) changed. The copies cost one more
        model's worth of memory (CPU float32 only; without the kernels nothing is
        copied). A mixture-of-experts layer's stacked experts are re-copied first."""
        self.refresh_copies()
        if self.kernels is None:
            self._panels, self._packed_stack = {}, None
            return
        old, self._panels = self._panels, {}
        mats = list({id(w): w for w in self.kernel_weights()}.values())  # each once
        fps = self.kernels.fingerprint([w.detach() for w in mats]).tolist()
        ws, bufs = [], []
        panel = self.kernels.PANEL
        for w, fp in zip(mats, fps):
            shape = (-(-w.shape[0] // panel), w.shape[1], panel)
            prev = old.get(id(w))
            same = prev is not None and prev[0] is w and tuple(prev[1].shape) == shape
            buf = prev[1] if same else torch.empty(shape, dtype=w.dtype)
            self._panels[id(w)] = (w, buf, fp)
            if same and prev[2] == fp:
                continue  # unchanged since it was packed
            ws.append(w.detach())
            bufs.append(buf)
        if ws:
            self.kernels.pack_weights(ws, bufs)
        self._packed_stack = None

    def _panel(self, w: torch.Tensor) -> torch.Tensor:
        """``w``'s panel copy (made now if ``pack_weights`` has not seen it)."""
        entry = self._panels.get(id(w))
        if entry is None or entry[0] is not w:
            entry = (w, self.kernels.pack_weight(w.detach()), None)  # re-packed next time
            self._panels[id(w)] = entry
        return entry[1]

    def _fused_stack(self) -> tuple:
        """Per-layer lists in the order of ``cpu_kernels.decode_layers``' arguments."""
        if self._packed_stack is None:
            L, pw = self.layers, self._panel
            self._packed_stack = (
                [lw.ln1 for lw in L], [pw(lw.qkv_w) for lw in L],
                [lw.qkv_b if lw.qkv_b is not None else _NO_TENSOR for lw in L],
                [pw(lw.proj_w) for lw in L], [lw.ln2 for lw in L],
                [pw(lw.fc1_w) for lw in L], [pw(lw.fc2_w) for lw in L])
        return self._packed_stack

    def rope(self, positions: torch.Tensor, limit: Optional[int] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, head_dim] in the model dtype.

        ``limit`` (an upper bound on positions + 1) avoids reading the positions back
        to the host, which CUDA-graph capture needs.
        """
        need = limit if limit is not None else (
            int(positions.max().item()) + 1 if positions.numel() else 1)
        cos, sin = self.rope_tables(need)
        return cos[positions], sin[positions]

    def rope_tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= need, head_dim] for positions 0.. (grown on demand)."""
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 256)
            if self.model is not None:
                freqs = self.model.rotary_pos_emb.get_emb(n).reshape(n, -1).float()
            else:  # from_tensors: rotate-half RoPE with base _rope_theta
                d = self.head_dim
                inv = 1.0 / self._rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
                f = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()
                freqs = torch.cat([f, f], dim=-1)
            self._cos = torch.cos(freqs).to(self.dtype).to(self.device)
            self._sin = torch.sin(freqs).to(self.dtype).to(self.device)
            self._rope_len = n
        return self._cos, self._sin

    # ------------------------------------------------------------------ pieces
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:  # (skipped without TP: the decode hot path)
            collectives.all_reduce(x, group=self.tp_group)
        return x

    def _residual(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x + (row-parallel linear of inp), all-reduced over TP before the add."""
        if self.tp_group is None:
            return self._lin(inp, w, residual=x)
        return x + self._all_reduce(self._lin(inp, w))

    def _lin(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``_linear`` through the fused CPU GEMM when few rows (verification and
        drafting forwards are a handful of tokens per sequence)."""
        rows = x.numel() // x.shape[-1]
        if not self.fused_ok("linear", rows):
            return _linear(x, w, b, residual)
        lead = x.shape[:-1]
        res = None if residual is None else residual.reshape(rows, -1).contiguous()
        out = self.kernels.linear(x.reshape(rows, -1).contiguous(), self._panel(w),
                                  w.shape[0], b, res)
        return out.view(*lead, out.shape[-1])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(tokens, self.embed_w)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.embed_w.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed_w)
        x = x.masked_fill(outside[..., None], 0.0)
        return self._all_reduce(x)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps)

    # The stage boundaries of the forward: the whole model here; a pipeline stage's
    # runner (``rollout.pipeline``) receives its input from the previous stage and
    # hands its output on instead.
    def stage_input(self, make: Callable[[], torch.Tensor], shape: tuple) -> torch.Tensor:
        """The first layer's input: ``make()`` (the embedding) on the first stage."""
        return make()

    def stage_output(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states from the last layer's output ``x``."""
        return self.final_hidden(x)

    def prepare_drafter(self, drafter) -> None:
        """Called before a drafter is attached (nothing to do for the whole model)."""

    def release_memory(self) -> None:
        """Free what the runner holds for rollouts only, between them: the stacked
        experts of MoE layers (the rest it reads in place; a gathered runner also frees
        its layer copies)."""
        for stack in getattr(self, "_stacks", ()):
            stack.release()

    def sync_vocab(self) -> None:
        """Bring copies of the embedding and output layer up to date with their owners'
        parameters (a pipeline runner's between two generates; here they are read in
        place: nothing to do)."""

    def agree(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the deciding rank (TP rank 0) holds it, on every rank of the
        model-parallel group that decodes together (in place)."""
        if self.tp_group is not None:
            collectives.broadcast(tensor, 0, self.tp_group)  # TP rank 0
        if self.ep_group is not None:  # EP > 1: the group decodes together (expert_call)
            collectives.broadcast(tensor, 0, self.ep_group)
        return tensor

    def agree_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Like ``agree``, for a decision taken once per call, before any split of
        the prompts (every rank of the model-parallel group)."""
        return self.agree(tensor)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [..., vocab_size] from final hidden states."""
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.fused_ok("linear", flat.shape[0]):
            local = self.kernels.linear(flat.contiguous(), self._panel(self.output_w),
                                        self.output_w.shape[0]).view(*lead, -1)
        else:
            local = _linear(hidden, self.output_w).float()
        if self.tp_group is not None:
            local = torch.cat(collectives.all_gather(local, self.tp_group), dim=-1)
        return local[..., : self.arch.vocab_size]

    # ------------------------------------------------------------------ the kernel
    def extend(self, cache: KVCache, rows: torch.Tensor, tokens: torch.Tensor,
               start: torch.Tensor, *, rope_positions: Optional[torch.Tensor] = None,
               new_token_mask: Optional[torch.Tensor] = None,
               capture: Optional[Callable[[int, torch.Tensor], None]] = None,
               span: Optional[int] = None, embeds: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Append ``tokens`` [B, T] to cache rows ``rows`` [B] at positions start[b]+t.

        Attention sees each row's cached prefix (positions < start[b]) and the new
        tokens: causally, or as ``new_token_mask`` [B or 1, T, W] (True = may attend)
        says, over the last W >= T cache slots up to the new tokens (W > T lets tree
        drafting see nodes written by earlier calls; slots before those are the prefix,
        always visible). ``rope_positions`` [B, T] overrides the rotary positions (default
        start+t; trees use depth). Returns final hidden states [B, T, hidden] (after
        the final norm). ``capture(layer_index, hidden)`` sees every layer's output.
        ``span`` fixes how many cache positions attention reads (default: just
        enough); a static span keeps the step free of host reads (CUDA graphs).
        ``embeds`` [B, T, hidden] replaces the token embedding as the first layer's
        input (the drafter's fused input); ``tokens`` then only gives the shape.
        """
        b, t = tokens.shape
        if (self.fused_ok("decode", b * t) and new_token_mask is None
                and rope_positions is None and isinstance(rows, slice)
                and cache.layout == "bgsd"):
            return self._decode_fused(cache, rows, tokens, start, capture, embeds)
        ar = torch.arange(t, device=tokens.device)
        write_pos = start[:, None] + ar[None, :]  # [B, T]
        if rope_positions is None:
            rope_positions = write_pos
        # every position lies in the cache: the tables cover it without a host read
        cos, sin = self.rope(rope_positions, limit=max(span or 0, cache.capacity))
        if span is None:  # callers that know their longest row pass ``span``
            span = int(start.max().item()) + t  # keys 0..span-1
        flash = (self.attention == "flash" and new_token_mask is None
                 and isinstance(rows, slice))
        mask = None if flash else self._attention_bias(start, t, span, new_token_mask)

        # rotate-half RoPE as x*cos + roll(x, d/2)*sin_signed, applied to q and k at once
        cos, sin = cos[:, :, None, None, :], (sin * self._sin_sign)[:, :, None, None, :]
        g, hpg, d = self.groups, self.heads_per_group, self.head_dim
        row_index = torch.arange(b, device=tokens.device)[:, None]
        x = self.stage_input(lambda: self.embed(tokens) if embeds is None else embeds,
                             (b, t))
        for i, lw in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), lw.ln1, self.eps)
            qkv = self._lin(h, lw.qkv_w, lw.qkv_b).view(b, t, g, hpg + 2, d)
            if lw.q_norm is not None:
                qkv = experts.qk_norm(qkv, lw.q_norm, lw.k_norm, self.eps, hpg)
            qk = qkv[:, :, :, : hpg + 1]
            qk = torch.addcmul(qk * cos, torch.roll(qk, d // 2, dims=-1), sin)
            q, k, v = qk[:, :, :, :hpg], qk[:, :, :, hpg], qkv[:, :, :, hpg + 1]
            if flash:
                o = flash_attend(cache, i, rows, q, k, v, start, self.scale)
            else:
                k_all, v_all = cache.write(i, rows, write_pos, k, v, span, row_index)
                q = q.permute(0, 2, 3, 1, 4).reshape(b, g, hpg * t, d)
                o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                                   scale=self.scale)
                o = o.view(b, g, hpg, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, g * hpg * d)
            x = self._residual(x, o, lw.proj_w)
            h = F.rms_norm(x, (x.shape[-1],), lw.ln2, self.eps)
            if lw.router_w is not None:
                x = x + self._moe(i, lw, h, cache, rows, write_pos)
            else:
                a, u = torch.chunk(self._lin(h, lw.fc1_w), 2, dim=-1)
                x = self._residual(x, F.silu(a) * u, lw.fc2_w)
            if capture is not None:
                capture(i, x)
        return self.stage_output(x)

    def _attention_bias(self, start: torch.Tensor, t: int, span: int,
                        new_token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return attention_bias(start, t, span, new_token_mask, self.dtype,
                              self.heads_per_group)

    def _decode_fused(self, cache: KVCache, rows: slice, tokens: torch.Tensor,
                      start: torch.Tensor, capture, embeds=None) -> torch.Tensor:
        """``extend`` for causal chains with the fused CPU kernels (``cpu_kernels``): the
        same math as the general path. The B x T new tokens become B*T query rows, each
        mapped to its sequence's cache row (T=1: a decode step; T>1: chain verification
        or drafter catch-up; the kernel writes every key before attending). Without
        tensor parallelism and per-layer capture the whole stack is one kernel call;
        otherwise three kernel calls and the panel GEMMs per layer, with the
        TP all-reduces between them."""
        b, t = tokens.shape
        first = rows.start or 0
        pos = (start[:, None] + torch.arange(t, device=start.device)).reshape(-1)
        row_of = None
        if t > 1 or first != 0:
            row_of = torch.arange(first, first + b, device=start.device).repeat_interleave(t)
        x = (self.embed(tokens.reshape(-1)) if embeds is None
             else embeds.reshape(b * t, -1).contiguous())
        cap = None if capture is None else (lambda i, h: capture(i, h.view(b, t, -1)))
        return self.extend_chains(cache, row_of, pos, x, cap).view(b, t, -1)

    def extend_chains(self, cache: KVCache, row_of: Optional[torch.Tensor], pos: torch.Tensor,
                      x: torch.Tensor, capture=None) -> torch.Tensor:
        """Fused-kernel forward of Q query rows: row q is input ``x[q]`` at position
        ``pos[q]`` of cache row ``row_of[q]`` (None: row q). Rows of one cache row at
        consecutive positions form a causal chain (all keys are written before any
        attention), so ragged per-sequence chains run in one call. Returns final
        hidden states [Q, hidden]. Needs ``self.kernels`` and the "bgsd" layout; a paged
        cache is read in place through its block table."""
        kern = self.kernels
        x = self.stage_input(lambda: x, (x.shape[0],))
        cos, sin = self.rope(pos, limit=cache.capacity)  # positions lie in the cache
        cos, sin = cos.contiguous(), (sin * self._sin_sign).contiguous()
        g, hpg, d = self.groups, self.heads_per_group, self.head_dim
        pos = pos.contiguous()
        table = cache.block_table() if cache.paged else None
        if self.tp_group is None and capture is None and self.whole_stack and self.plain_stack:
            return kern.decode_layers(x, *self._fused_stack(), self.final_norm, cache.k,
                                      cache.v, cos, sin, pos, g, hpg, d, self.scale, self.eps,
                                      row_of, table)
        for i, lw in enumerate(self.layers):
            h = kern.rms_norm(x, lw.ln1, self.eps)
            qkv = kern.linear(h, self._panel(lw.qkv_w), lw.qkv_w.shape[0], lw.qkv_b)
            if lw.q_norm is not None:
                qkv = experts.qk_norm_rows(qkv, lw.q_norm, lw.k_norm, self.eps, g, hpg, d)
            o = kern.rope_attend(qkv, cos, sin, cache.k[i], cache.v[i], pos,
                                 g, hpg, d, self.scale, row_of, table)
            x = self._fused_residual(x, o, lw.proj_w)
            h = kern.rms_norm(x, lw.ln2, self.eps)
            if lw.router_w is not None:
                rows = row_of if row_of is not None else torch.arange(x.shape[0],
                                                                      device=x.device)
                x = x + self._moe(i, lw, h, cache, rows, pos)
            else:
                fc1 = kern.linear(h, self._panel(lw.fc1_w), lw.fc1_w.shape[0])
                x = self._fused_residual(x, kern.silu_mul(fc1), lw.fc2_w)
            if capture is not None:
                capture(i, x)
        return self.stage_output(x)

    def _moe(self, i: int, lw: _Layer, h: torch.Tensor, cache: KVCache, rows,
             positions: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s mixture of experts of h [..., hidden] (this rank's experts'
        partial sums all-reduced over TP x EP); the tokens' experts kept in ``cache`` at
        (``rows``, ``positions``), as ``experts.record`` takes them."""
        out, idx = self._expert_mlp(h.reshape(-1, h.shape[-1]), lw)
        cache.record_routes(self.moe_index[i], rows, positions, idx)
        if self.expert_group is not None:
            collectives.all_reduce(out, group=self.expert_group)
        return out.view(h.shape)

    def _expert_mlp(self, x: torch.Tensor, lw: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts of layer ``lw`` for tokens x [N, hidden]: their partial
        sums and the chosen experts (``experts.moe``)."""
        return experts.moe(x, lw.router_w, lw.w13, lw.w2, self.moe_shape)

    def _fused_residual(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor):
        wp, n = self._panel(w), w.shape[0]
        if self.tp_group is None:
            return self.kernels.linear(inp, wp, n, None, x)
        return x + self._all_reduce(self.kernels.linear(inp, wp, n))


_NO_TENSOR = torch.empty(0)
