"""The rollout forward's Qwen3 pieces: the per-head query / key norm and the
mixture-of-experts MLP, on the model's own parameters (``forward.ModelRunner`` calls
them per layer).

Query / key norm (``qk_layernorm``): RMSNorm over each head's ``head_dim`` values with
one weight shared by the heads, after the QKV projection and before RoPE, as
megatron-core's ``q_layernorm`` / ``k_layernorm`` (eager torch ops: two ``rms_norm`` over
views of the fused QKV rows; the fused CPU kernels' per-layer path calls them between
its QKV GEMM and its RoPE + attention kernel).

Mixture-of-experts MLP (``moe``), per token, as megatron-core's ``TopKRouter`` +
``SequentialMLP``:

1. router logits in float32 (``x @ router.T``), the top-k experts: with
   ``norm_topk_prob`` the k largest logits softmaxed (megatron-core's
   ``moe_router_pre_softmax=False``), else softmax over every expert, then its k largest;
2. the (token, expert) pairs this rank holds (experts ``first .. first + local - 1``:
   all of them at EP = 1) sorted by expert (a stable sort: fixed shapes, no host read),
   each expert's rows one GEMM: ``torch._grouped_mm`` over the experts' weights stacked
   [local, out, in] with the group ends from a scatter-add count (no ``bincount``, whose
   output size would need a host read on CUDA). Pairs of other ranks' experts join the
   last group with weight 0 (``_grouped_mm`` leaves rows after the last group end
   undefined);
3. SiLU-gated activation, the second grouped GEMM, each pair's output times its weight
   written back to (token, slot) by the inverse permutation and summed over the k slots
   (no atomics: the same sum on every run);
4. under TP (expert weights sharded over TP as a dense MLP's) and EP (each rank its own
   experts) the partial sums are all-reduced once over the expert tensor-and-model group
   (TP x EP ranks; the TP group at EP = 1): one all-reduce of [tokens, hidden] per MoE
   layer, where a dense layer all-reduces its MLP output over TP.

The stacked expert weights are copies of the megatron-core experts' parameters (which
are separate tensors per expert): ``StackedExperts.refresh`` re-copies them at every
``generate`` (``ModelRunner.pack_weights``), one pass over this rank's experts (with the
fused CPU kernels only the experts whose content fingerprint changed, as the kernels'
panel copies), and they cost one more copy of this rank's expert weights while the
runner lives (freed between rollouts with the runner's other rollout memory).

Routes: ``moe`` returns the chosen expert ids [tokens, k] (int16; the caller stores them
per cache row and position in the KV cache's ``routes``: ``record``), so a rollout can
hand them to the trainer (routing replay, ``models.moe_replay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROUTE_DTYPE = torch.int16


def qk_norm(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
            heads_per_group: int) -> torch.Tensor:
    """``qkv`` [..., groups, heads_per_group + 2, head_dim] with the query heads and the key
    RMS-normalised per head (the value untouched)."""
    d = qkv.shape[-1]
    q = F.rms_norm(qkv[..., :heads_per_group, :], (d,), q_norm, eps)
    k = F.rms_norm(qkv[..., heads_per_group: heads_per_group + 1, :], (d,), k_norm, eps)
    return torch.cat([q, k, qkv[..., heads_per_group + 1:, :]], dim=-2)


def qk_norm_rows(qkv: torch.Tensor, q_norm, k_norm, eps: float, groups: int,
                 heads_per_group: int, head_dim: int) -> torch.Tensor:
    """``qk_norm`` of fused QKV rows [rows, groups * (hpg + 2) * head_dim] (the fused
    kernels' layout), contiguous."""
    rows = qkv.shape[0]
    out = qk_norm(qkv.view(rows, groups, heads_per_group + 2, head_dim), q_norm, k_norm, eps,
                  heads_per_group)
    return out.reshape(rows, -1).contiguous()


@dataclass
class MoeShape:
    """Routing of a model's MoE layers as this rank runs them."""

    num_experts: int
    topk: int
    norm_topk_prob: bool
    first: int  # global index of this rank's first expert
    local: int  # experts this rank holds


class StackedExperts:
    """One MoE layer's local experts as two stacked tensors ([local, 2F/TP, H] and
    [local, H, F/TP]) copied from the megatron-core experts' parameters."""

    def __init__(self, mlp):
        self.sources = [(e.linear_fc1.weight, e.linear_fc2.weight)
                        for e in mlp.experts.local_experts]
        fc1, fc2 = self.sources[0]
        n = len(self.sources)
        self.shapes = ((n, *fc1.shape), (n, *fc2.shape))
        self.w13 = torch.empty(self.shapes[0], dtype=fc1.dtype, device=fc1.device)
        self.w2 = torch.empty(self.shapes[1], dtype=fc2.dtype, device=fc2.device)
        self.refresh()

    @torch.no_grad()
    def refresh(self, fingerprint=None) -> None:
        """Copy the parameters' current values (the trainer updates them in place);
        storage released by ``release`` is made again. ``fingerprint`` (the CPU
        kernels': a 64-bit content hash per tensor) skips the experts that did not
        change since the last copy."""
        if self.w13.numel() == 0:
            self.w13.resize_(self.shapes[0])
            self.w2.resize_(self.shapes[1])
            self._hashes = None
        hashes = None
        if fingerprint is not None:
            hashes = fingerprint([w.detach() for pair in self.sources for w in pair]).tolist()
        old = getattr(self, "_hashes", None)
        for j, (fc1, fc2) in enumerate(self.sources):
            if old is not None and hashes is not None and old[2 * j: 2 * j + 2] == \
                    hashes[2 * j: 2 * j + 2]:
                continue
            self.w13[j].copy_(fc1)
            self.w2[j].copy_(fc2)
        self._hashes = hashes

    def release(self) -> None:
        """Free the copies' storage (the tensors stay, referred to by the runner's
        layers); the next ``refresh`` makes it again."""
        self.w13.set_()
        self.w2.set_()
        self._hashes = None


def route(x: torch.Tensor, router_w: torch.Tensor, shape: MoeShape
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in x's dtype, expert ids [N, k] int64) for tokens x [N, H]."""
    logits = x.float() @ router_w.float().t()
    if shape.norm_topk_prob:
        top, idx = torch.topk(logits, shape.topk, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        weights, idx = torch.topk(torch.softmax(logits, dim=-1), shape.topk, dim=-1)
    return weights.to(x.dtype), idx


def replayed(x: torch.Tensor, router_w: torch.Tensor, shape: MoeShape,
             idx: torch.Tensor) -> torch.Tensor:
    """The weights of given experts ``idx`` [N, k] (routing replay), as ``route`` would
    weigh them had it chosen them."""
    logits = x.float() @ router_w.float().t()
    if shape.norm_topk_prob:
        return torch.softmax(logits.gather(-1, idx), dim=-1).to(x.dtype)
    return torch.softmax(logits, dim=-1).gather(-1, idx).to(x.dtype)


_GROUPED_OK: dict = {}  # (device type, dtype) -> whether torch._grouped_mm runs there


def _grouped(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w[g].T per group of rows (group g ends at row ends[g]); w [G, out, in].
    ``torch._grouped_mm`` where it runs (CPU; CUDA in bf16), else one GEMM per group
    over every row, masked to the group's (the same fixed shapes, no host read; G times
    the work: the float32 CUDA path)."""
    key = (x.device.type, x.dtype)
    if _GROUPED_OK.get(key, True):
        try:
            out = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
            _GROUPED_OK[key] = True
            return out
        except RuntimeError:
            _GROUPED_OK[key] = False
    group = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device,
                                                  dtype=ends.dtype), right=True)
    out = x.new_zeros(x.shape[0], w.shape[1])
    for g in range(w.shape[0]):
        out += (group == g).to(x.dtype)[:, None] * (x @ w[g].t())
    return out


def local_pairs(weights: torch.Tensor, idx: torch.Tensor, shape: MoeShape
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (token, slot) pair's expert among this rank's [N*k] and its weight: a pair
    whose expert another rank holds goes to this rank's last expert with weight 0."""
    local = idx.reshape(-1) - shape.first
    mine = (local >= 0) & (local < shape.local)
    flat = weights.reshape(-1)
    return (torch.where(mine, local, torch.full_like(local, shape.local - 1)),
            torch.where(mine, flat, torch.zeros_like(flat)))


def moe(x: torch.Tensor, router_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        shape: MoeShape, idx: Optional[torch.Tensor] = None,
        act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the MoE MLP for tokens x [N, H] (to be all-reduced over TP x
    EP), and the chosen experts [N, k] (``ROUTE_DTYPE``). ``idx`` forces the experts;
    ``act`` maps each grouped GEMM's input rows first (the self-drafter's int8 copy
    quantizes them, ``speculative.quantize_experts``)."""
    act = act or (lambda rows: rows)
    n, k = x.shape[0], shape.topk
    if idx is None:
        weights, idx = route(x, router_w, shape)
    else:
        idx = idx.long()
        weights = replayed(x, router_w, shape, idx)
    group, w = local_pairs(weights, idx, shape)
    order = torch.sort(group, stable=True).indices
    counts = torch.zeros(shape.local, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, group, torch.ones_like(group, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    h = _grouped(act(rows), w13, ends)
    a, u = torch.chunk(h, 2, dim=-1)
    y = _grouped(act(F.silu(a) * u), w2, ends) * w.index_select(0, order)[:, None]
    pairs = torch.empty_like(y)
    pairs[order] = y  # back to (token, slot) order
    return pairs.view(n, k, -1).sum(1), idx.to(ROUTE_DTYPE)


def routes_to_host(outputs: list) -> None:
    """Every output's ``routes`` (device copies made as rows finished) to the host in
    one copy: a finished row costs no host read inside the decode loop."""
    have = [o for o in outputs if o is not None and o.routes is not None]
    if not have or have[0].routes.device.type == "cpu":
        return
    host = torch.cat([o.routes for o in have]).to("cpu")
    for o, part in zip(have, host.split([o.routes.shape[0] for o in have])):
        o.routes = part


def record(store: torch.Tensor, rows, positions: torch.Tensor, idx: torch.Tensor) -> None:
    """Write experts ``idx`` [tokens, k] into one MoE layer's ``store`` [rows, capacity,
    k] (a KV cache's ``routes[layer]``): ``rows`` a slice of B cache rows and
    ``positions`` [B, T] (tokens in row-major order), or a tensor of each token's cache
    row and ``positions`` [tokens]."""
    if isinstance(rows, slice):
        b, t = positions.shape
        bi = torch.arange(b, device=positions.device)[:, None]
        store[rows][bi, positions] = idx.view(b, t, -1)
    else:
        store[rows, positions] = idx
