"""The self-drafter's copy of the policy (``SelfDraftRunner``): a full-depth
``ModelRunner`` over the target's weights quantized to int8 (or FP8), re-quantized
from the current weights whenever they changed. Qwen3's query / key norms are float
copies; a mixture-of-experts layer keeps a float copy of its router and its experts in
int8 (``quantize_experts.py``). The kind itself, its settings and its memory are
``self_drafter.py``."""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from ... import collectives
from .. import experts
from ..cpu_kernels import MAX_FUSED_ROWS
from ..forward import _NO_TENSOR, ModelRunner, _Layer
from .quantize import QuantWeight, int8_linear, panel_byte_offset, quantize_int8
from .quantize_experts import moe_int8, quantize_experts
from .quantize_fp8 import Fp8Weight, fp8_linear, quantize_fp8, resolve_format


class SelfDraftRunner(ModelRunner):
    """The target's weight-only int8 copy, run like the target (same attention, cache
    and TP code); ``_lin`` multiplies by the int8 weights (the CPU kernels' int8 panel
    GEMM where built, else the dequantizing reference)."""

    fused_drafting = False  # the fused greedy chain kernel is the EAGLE drafter's

    def __init__(self, target: ModelRunner, drafter):  # drafter: a SelfDrafter
        self.target = target
        self.source = drafter.source or target
        self.config = drafter.config
        # the copy's matrices: QuantWeight (int8) or Fp8Weight (E4M3)
        self.format = resolve_format(drafter.config.format, target.device, drafter.config.group)
        self.model, self.arch = target.model, target.arch
        self.tp_size, self.tp_rank, self.tp_group = target.tp_size, target.tp_rank, target.tp_group
        self.groups, self.heads_per_group = target.groups, target.heads_per_group
        self.head_dim, self.eps, self.scale = target.head_dim, target.eps, target.scale
        # mixture of experts: the target's routing and groups (the copy's experts are
        # this rank's, as the target's)
        self.moe_shape, self.expert_group = target.moe_shape, target.expert_group
        self.ep_group = target.ep_group
        self._panels, self._packed_stack = {}, None
        self.d2t = None if drafter.draft_vocab is None else drafter.draft_vocab.to(target.device)
        self.embed_w, self.vocab_start = target.embed_w, target.vocab_start
        self.layers: list[_Layer] = []
        self.index_layers()
        self.final_norm = self.output_w = None
        self._fp: Optional[list] = None  # source fingerprints at the last quantization
        self._offset = 0  # the kernels' panel byte offset (``quantize.panel_byte_offset``)
        self.refreshes = 0
        self.refresh_seconds = 0.0  # the last refresh's time
        self._finish_init()
        self.attention = target.attention

    # ------------------------------------------------------------------ weights
    def source_weights(self) -> list[torch.Tensor]:
        """The tensors the copy is made from, in a fixed order (an MoE layer's experts:
        the source runner's stacked copies, refreshed before the copy at every
        ``generate``)."""
        s = self.source
        return [t for lw in s.layers for t in (lw.ln1, lw.qkv_w, lw.qkv_b, lw.proj_w,
                                                lw.ln2, lw.fc1_w, lw.fc2_w, lw.q_norm,
                                                lw.k_norm, lw.router_w, lw.w13, lw.w2)
                if t is not None] + [s.final_norm, s.output_w]

    def refresh(self) -> None:
        """Re-quantize every linear and the LM head from the source's current weights
        (its local TP shards) and copy the norms; timed (``refresh_seconds``)."""
        t0 = time.perf_counter()
        s = self.source
        old = self.layers if len(self.layers) == len(s.layers) else [None] * len(s.layers)
        k = self._packer()
        self._offset = 0 if k is None else panel_byte_offset(k, self.config.act_block)
        with torch.no_grad():  # matrix by matrix, into the existing copy's tensors
            self.layers = [self._layer(o, lw) for o, lw in zip(old, s.layers)]
            self.index_layers()
            self.final_norm = _copy(self.final_norm, s.final_norm)
            head = s.output_w if self.d2t is None else self._head_rows(s, self.d2t)
            self.output_w = self._quant(self.output_w, head)
        self.embed_w, self.vocab_start = self.target.embed_w, self.target.vocab_start
        self._packed_stack = None
        self.refreshes += 1
        self.refresh_seconds = time.perf_counter() - t0

    def _layer(self, o: Optional[_Layer], lw: _Layer) -> _Layer:
        """The copy of source layer ``lw``, into ``o``'s tensors where they fit: int8
        linears (a dense MLP's, or int8 experts and a float router), float norms."""
        def opt(name: str, make):
            src = getattr(lw, name)
            return None if src is None else make(o and getattr(o, name), src)

        def experts_of(old, w):
            return quantize_experts(w, self.config.group, self.config.act_block, old)

        return _Layer(ln1=_copy(o and o.ln1, lw.ln1), qkv_w=self._quant(o and o.qkv_w, lw.qkv_w),
                      qkv_b=opt("qkv_b", _copy), proj_w=self._quant(o and o.proj_w, lw.proj_w),
                      ln2=_copy(o and o.ln2, lw.ln2), fc1_w=opt("fc1_w", self._quant),
                      fc2_w=opt("fc2_w", self._quant), q_norm=opt("q_norm", _copy),
                      k_norm=opt("k_norm", _copy), router_w=opt("router_w", _copy),
                      w13=opt("w13", experts_of), w2=opt("w2", experts_of))

    def _quant(self, old: Optional[QuantWeight], w: torch.Tensor) -> QuantWeight:
        """``w`` quantized, written into ``old``'s tensors when their shapes match (the
        copy's memory is allocated once; a refresh holds one matrix's temporaries). With
        the CPU kernels only their int8 panel copy is kept (``QuantWeight.pack``: one
        int8 copy of each matrix, not the row-major ``q`` beside it)."""
        if self.format == "fp8":
            return quantize_fp8(w, old if isinstance(old, Fp8Weight) else None)
        new = quantize_int8(w, self.config.group, self.config.act_block)
        k = self._packer()
        if k is not None:
            new.pack(*k.pack_int8(new.q, new.scale, new.act_block), self._offset)
        mine, fresh = ([] if old is None else old.tensors()), new.tensors()
        if (not isinstance(old, QuantWeight) or old.packed != new.packed
                or old.shape != new.shape
                or [t.shape for t in mine] != [t.shape for t in fresh]):
            return new
        for dst, src in zip(mine, fresh):
            dst.copy_(src)
        old.panel_offset = new.panel_offset
        return old

    @property
    def kernels(self):
        """The CPU kernels (int8 copies only: an FP8 copy runs none, whoever sets them)."""
        return self._kernels

    @kernels.setter
    def kernels(self, k) -> None:
        k = k if getattr(self, "format", "int8") == "int8" else None
        if k is not getattr(self, "_kernels", None):
            self._fp = None  # the panels follow the kernels: re-pack at the next check
        self._kernels = k

    def set_layers(self, layers) -> None:  # the copy is made by refresh()
        raise TypeError("SelfDraftRunner quantizes its source's layers in refresh()")

    def _head_rows(self, s: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the (vocab-parallel) output weight, whole on every TP rank."""
        w = s.output_w.detach()
        if self.tp_group is None:
            return w[ids].contiguous()
        per = w.shape[0]
        local = ids - s.vocab_start
        inside = (local >= 0) & (local < per)
        rows = (w[local.clamp(0, per - 1)] * inside[:, None].to(w.dtype)).contiguous()
        collectives.all_reduce(rows, group=self.tp_group)
        return rows

    def quant_weights(self) -> list[QuantWeight]:
        """Every quantized matrix of the copy (not the experts: ``QuantExperts``)."""
        return [w for lw in self.layers for w in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w)
                if w is not None] + [self.output_w]

    def own_tensors(self) -> list[torch.Tensor]:
        """Every tensor the copy holds: its matrices' tensors (int8 ``q`` or the
        kernels' panel copy, scales, panel scales; FP8 matrices and scales), the norms,
        the QKV biases, the QK norms, an MoE layer's router and int8 experts with their
        scales, the draft vocabulary's ids and RoPE's sign vector. Not the target's
        embedding and rotary tables, which it reads."""
        out = [t for lw in self.layers for t in (lw.ln1, lw.ln2, lw.qkv_b, lw.q_norm,
                                                 lw.k_norm, lw.router_w) if t is not None]
        out += [t for w in self.quant_weights() for t in w.tensors()]
        out += [t for lw in self.layers for w in (lw.w13, lw.w2) if w is not None
                for t in w.tensors()]
        return out + [t for t in (self.final_norm, self.d2t, self._sin_sign) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds (``own_tensors``, each storage once): its resident
        memory, beside the policy's weights."""
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in self.own_tensors()}
        return sum(held.values())

    def pack_weights(self) -> None:
        """Re-quantize when the source's weights changed since the last quantization
        (a content fingerprint per tensor through the CPU kernels; without them, every
        call: a GPU quantizes the copy in milliseconds, and version counters would miss
        writes through ``.data``, which optimizers use). The controller calls this at
        the start of every ``generate``, so each policy update is picked up. Not while
        the source's stacked experts are released (between rollouts): the next
        ``generate`` makes them, then this quantizes."""
        if any(lw.w13 is not None and lw.w13.numel() == 0 for lw in self.source.layers):
            return
        k = self.kernels
        if k is None or self.source.device.type != "cpu":
            self.refresh()
            return
        fp = k.fingerprint([t.detach().contiguous() for t in self.source_weights()]).tolist()
        changed = fp != self._fp or not self.layers
        if self.tp_group is not None:  # the TP ranks refresh together (the draft
            # vocabulary's rows are gathered collectively), whichever shards changed
            changed = collectives.max_values([float(changed)], group=self.tp_group)[0] > 0
        if changed:
            self.refresh()
            self._fp = fp

    def _int8_kernels(self) -> bool:
        k = self.kernels
        return (k is not None and hasattr(k, "linear_int8") and self.device.type == "cpu"
                and self.dtype == torch.float32 and self.output_w is not None
                and self.output_w.panel is not None)

    def _packer(self):
        """The kernels that pack the int8 matrices into their panel layout (CPU float32
        int8 copies with the int8 kernels built), else None (the matrices stay ``q``)."""
        k = self.kernels
        if (k is None or not hasattr(k, "linear_int8") or self.dtype != torch.float32
                or self.device.type != "cpu"):
            return None
        return k

    def kernel_weights(self) -> list[torch.Tensor]:
        return []  # no float panel copies: the int8 ones are made by refresh()

    def _fused_stack(self) -> tuple:
        """Per-layer lists in the order of ``cpu_kernels.decode_layers_int8``'s
        arguments, up to the group size."""
        if self._packed_stack is None:
            L = self.layers
            self._packed_stack = (
                [lw.ln1 for lw in L], [lw.qkv_w.panel for lw in L],
                [lw.qkv_w.panel_scale for lw in L],
                [lw.qkv_b if lw.qkv_b is not None else _NO_TENSOR for lw in L],
                [lw.proj_w.panel for lw in L], [lw.proj_w.panel_scale for lw in L],
                [lw.ln2 for lw in L], [lw.fc1_w.panel for lw in L],
                [lw.fc1_w.panel_scale for lw in L], [lw.fc2_w.panel for lw in L],
                [lw.fc2_w.panel_scale for lw in L], self.config.group or 1 << 40,
                self.config.act_block)
        return self._packed_stack

    def rope_tables(self, need: int):
        return self.target.rope_tables(need)

    # ------------------------------------------------------------------ forward pieces
    def _lin(self, x: torch.Tensor, w: QuantWeight, b: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``residual + x @ dequantize(w).T + b``: the int8 panel GEMM of the CPU kernels
        where built and packed (more than MAX_FUSED_ROWS rows in chunks of that many:
        each row's sums are computed alone, so a chunk's rows come out as in one call),
        else FP8 weights through ``torch._scaled_mm`` (``quantize_fp8``) or the int8
        reference (which reads a packed matrix back from its panels)."""
        rows = x.numel() // x.shape[-1]
        if w.panel is None or not self._int8_kernels():
            if isinstance(w, Fp8Weight):
                return fp8_linear(x, w, b, residual)
            return int8_linear(x, w, b, residual)
        lead, n, lin = x.shape[:-1], w.shape[0], self.kernels.linear_int8
        flat = x.reshape(rows, -1).contiguous()
        res = None if residual is None else residual.reshape(rows, -1).contiguous()
        if rows <= MAX_FUSED_ROWS:
            out = lin(flat, w.panel, w.panel_scale, n, w.group, w.act_block, b, res)
        else:
            out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
            for i in range(0, rows, MAX_FUSED_ROWS):
                j = min(rows, i + MAX_FUSED_ROWS)
                out[i:j] = lin(flat[i:j], w.panel, w.panel_scale, n, w.group, w.act_block, b,
                               None if res is None else res[i:j])
        return out.view(*lead, n)

    def fused_ok(self, family: str, rows: int) -> bool:
        """"decode" (the per-layer kernel path, ``extend_chains``) and "linear" run the
        int8 GEMM wherever the int8 kernels are built, up to MAX_FUSED_ROWS rows (the
        float kernels' calibration does not apply: the alternative here dequantizes the
        whole matrix per call); "argmax" as the target's policy says."""
        if family in ("decode", "linear"):
            return self._int8_kernels() and rows <= MAX_FUSED_ROWS
        return super().fused_ok(family, rows)

    def inputs(self, tokens: torch.Tensor, h: Optional[torch.Tensor] = None, *,
               target_features: bool = False) -> torch.Tensor:
        """The drafter's first-layer input for ``tokens``: their embedding (the copy is
        fed tokens; ``h``, the EAGLE drafter's feature input, is ignored)."""
        return self.embed(tokens)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary (the full one without a draft
        vocabulary; vocab-parallel at TP > 1, gathered like the target's)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = self._lin(flat.contiguous(), self.output_w).float()
        if self.d2t is None:
            if self.tp_group is not None:
                out = torch.cat(collectives.all_gather(out.contiguous(), group=self.tp_group),
                                dim=-1)
            out = out[:, : self.arch.vocab_size]
        return out.view(*hidden.shape[:-1], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(hidden)

    def extend_chains(self, cache, row_of, pos, x, capture=None) -> torch.Tensor:
        """The fused path's forward of ragged chains (``ModelRunner.extend_chains``)
        layer by layer: the CPU kernels' norm, RoPE + attention and SwiGLU pieces
        around the int8 GEMMs."""
        kern = self.kernels
        cos, sin = self.rope(pos, limit=cache.capacity)  # positions lie in the cache
        cos, sin = cos.contiguous(), (sin * self._sin_sign).contiguous()
        g, hpg, d = self.groups, self.heads_per_group, self.head_dim
        pos = pos.contiguous()
        table = cache.block_table() if cache.paged else None
        if (self.tp_group is None and capture is None and self._int8_kernels()
                and self.plain_stack):
            return kern.decode_layers_int8(x.contiguous(), *self._fused_stack(),
                                           self.final_norm, cache.k, cache.v, cos, sin, pos,
                                           g, hpg, d, self.scale, self.eps, row_of, table)
        for i, lw in enumerate(self.layers):
            h = kern.rms_norm(x, lw.ln1, self.eps)
            qkv = self._lin(h, lw.qkv_w, lw.qkv_b)
            if lw.q_norm is not None:
                qkv = experts.qk_norm_rows(qkv, lw.q_norm, lw.k_norm, self.eps, g, hpg, d)
            o = kern.rope_attend(qkv, cos, sin, cache.k[i], cache.v[i], pos,
                                 g, hpg, d, self.scale, row_of, table)
            x = self._residual(x, o, lw.proj_w)
            h = kern.rms_norm(x, lw.ln2, self.eps)
            if lw.router_w is not None:
                rows = row_of if row_of is not None else torch.arange(x.shape[0],
                                                                      device=x.device)
                x = x + self._moe(i, lw, h, cache, rows, pos)
            else:
                x = self._residual(x, kern.silu_mul(self._lin(h, lw.fc1_w)), lw.fc2_w)
            if capture is not None:
                capture(i, x)
        return kern.rms_norm(x, self.final_norm, self.eps)

    def _expert_mlp(self, x: torch.Tensor, lw: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
        """``ModelRunner._expert_mlp`` over the int8 experts
        (``quantize_experts.moe_int8``)."""
        return moe_int8(x, lw.router_w, lw.w13, lw.w2, self.moe_shape)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps)


def _copy(old: Optional[torch.Tensor], src: torch.Tensor) -> torch.Tensor:
    """A float copy of ``src``, into ``old`` when its shape matches."""
    if old is not None and old.shape == src.shape:
        return old.copy_(src.detach())
    return src.detach().clone()
