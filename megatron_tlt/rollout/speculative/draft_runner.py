"""The drafter's incremental forward: its one layer run like the target's (same
kernels, TP and cache code) with the target's embedding, RoPE and output layer (or its
draft-vocabulary rows)."""

from __future__ import annotations

import torch

from ... import collectives
from ...models.drafter import EagleDrafter
from ..forward import _NO_TENSOR, ModelRunner
from ..kv_cache import KVCache


class DraftRunner(ModelRunner):
    """The drafter's layer run like the target's (same kernels, TP and cache code),
    with the target's embedding, RoPE and output layer (or its draft-vocabulary rows)."""

    refreshes = 0  # its weights are the drafter's own: never re-made from the target's
    refresh_seconds = 0.0

    def __init__(self, drafter: EagleDrafter, target: ModelRunner):
        self.drafter = drafter
        self.target = target
        super().__init__(target.model, target.arch)
        self._te: dict[int, torch.nn.Module] = {}
        if drafter.config.fp8:  # FP8 GEMMs through the layer's Transformer Engine linears
            att, mlp = drafter.layer.self_attention, drafter.layer.mlp
            self._te = {id(m.weight): m for m in (att.linear_qkv, att.linear_proj,
                                                  mlp.linear_fc1, mlp.linear_fc2)}

    @property
    def fused_drafting(self) -> bool:
        """Whether greedy chains may run in one call (``cpu_kernels.draft_chain``): a
        plain layer (that kernel has no QK norm)."""
        return self.plain_stack

    def _lin(self, x, w, b=None, residual=None):
        mod = self._te.get(id(w))
        if mod is None:
            return super()._lin(x, w, b, residual)
        from ...models.drafter import fp8_context

        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, -1)
        pad = (-rows) % 16  # FP8 GEMMs need the row count to be a multiple of 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        with fp8_context(True):
            out, bias = mod(x2)  # the module adds its own bias
        out = out[:rows]
        if bias is not None:
            out = out + bias
        if residual is not None:
            out = residual.reshape(rows, -1) + out
        return out.view(*x.shape[:-1], -1)

    def refresh(self) -> None:
        """Re-read weights (the target's shared ones too): call after either changed
        tensors by replacement, or after the target's output layer was updated and a
        draft vocabulary is used (its rows are a copy)."""
        t, d = self.target, self.drafter
        self.set_layers([d.layer])
        self.embed_w, self.vocab_start = t.embed_w, t.vocab_start
        self.final_norm = d.norm
        self.fc_w = d.fc.weight
        self.feature_fc_w = d.feature_fc.weight if d.feature_fc is not None else None
        self.d2t = d.d2t
        if self.d2t is not None:
            self.output_w = self._gather_rows(t.output_w, self.d2t)
        else:
            self.output_w = t.output_w

    def kernel_weights(self) -> list[torch.Tensor]:
        """The drafter's own matrices (the target's output layer, when shared, is packed
        by the target's runner and read from there)."""
        extra = [self.fc_w] + ([self.feature_fc_w] if self.feature_fc_w is not None else [])
        return [w for w in super().kernel_weights() if w is not self.target.output_w] + extra

    def _panel(self, w: torch.Tensor) -> torch.Tensor:
        if w is self.target.output_w:
            return self.target._panel(w)
        return super()._panel(w)

    def _gather_rows(self, local_w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the vocab-parallel output weight, on every TP rank."""
        with torch.no_grad():
            if self.target.tp_group is None:
                return local_w[ids].contiguous()
            per = local_w.shape[0]
            local = ids - self.target.vocab_start
            inside = (local >= 0) & (local < per)
            rows = local_w[local.clamp(0, per - 1)] * inside[:, None].to(local_w.dtype)
            collectives.all_reduce(rows, group=self.target.tp_group)
            return rows.contiguous()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary (the full one without pruning)."""
        if self.d2t is None:
            return self.logits(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = self._lin(flat.contiguous(), self.output_w).float()
        return out.view(*hidden.shape[:-1], -1)

    def reduce_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features [N, F] as the drafter's h [N, H] (EAGLE-3: feature_fc
        over the three layers; otherwise they are h already)."""
        if self.feature_fc_w is None:
            return feats
        return self._lin(feats.contiguous(), self.feature_fc_w)

    def inputs(self, tokens: torch.Tensor, h: torch.Tensor, *, target_features: bool
               ) -> torch.Tensor:
        """fc(concat(embed(tokens), h)) for tokens [N] and h [N, F]; ``target_features``
        marks h as the target's (EAGLE-3 features are reduced first)."""
        if target_features:
            h = self.reduce_features(h)
        x = torch.cat([self.embed(tokens), h.to(self.dtype)], dim=-1)
        return self._lin(x.contiguous(), self.fc_w)


    @property
    def fp8(self) -> bool:
        """Whether the drafter's GEMMs run in FP8 (through Transformer Engine)."""
        return bool(self._te)

    def draft_chain_fused(self, cache: KVCache, tok: torch.Tensor, feats: torch.Tensor,
                          row_of: torch.Tensor, pos: torch.Tensor, last: torch.Tensor,
                          start: torch.Tensor, depth: int, vocab_size: int,
                          start_max: int) -> list[list[int]]:
        """Catch-up and a greedy chain of ``depth`` drafts per row in one call of the
        fused CPU kernels (``cpu_kernels.draft_chain``): the pending pairs (``tok`` [N],
        target features ``feats`` [N, F], cache row ``row_of`` and position ``pos`` of
        each), each row's root query index ``last`` [B] and length ``start`` [B];
        ``vocab_size`` is the target's; ``start_max`` the host's max of ``start``.
        Returns the drafted target token ids per row."""
        h = self.reduce_features(feats).to(self.dtype).contiguous()
        draft_vocab = self.output_w.shape[0] if self.d2t is not None else vocab_size
        return self.kernels.draft_chain(
            tok, h, row_of, pos, last, start, depth, draft_vocab,
            self.d2t if self.d2t is not None else _NO_TENSOR, self.embed_w,
            self._panel(self.fc_w), *self._fused_stack(), self.final_norm, cache.k, cache.v,
            *self.rope_tables(start_max + depth), self.groups, self.heads_per_group,
            self.head_dim, self.scale, self.eps, self._panel(self.output_w),
            self.output_w.shape[0]).tolist()
