"""The drafter's loss family: what to match, at which sampling settings, how deep.

Per token, speculative sampling accepts a draft with probability

    α = Σ_x min(p̃(x), q̃(x)) = 1 − TV(p̃, q̃)

where p̃ (target) and q̃ (drafter, over its draft vocabulary) are the rollout's
processed distributions: ``rollout.sampling.processed_logprobs`` at the request's
temperature, top-k and top-p, the same call decoding makes. The terms (``LossConfig``,
weights; any may be 0):

- ``kl``: forward KL(p̃ ‖ q_T) over the draft vocabulary, q_T the drafter's softmax at the
  rollout temperature (no truncation: every token p̃ keeps has a finite log q_T);
- ``tv``: TV(p̃, q̃) = 1 − α, the rejection rate itself;
- ``log_accept``: −log α (gradient (1/α)∇TV: trains from a cold start where TV stalls);
- ``hidden``: smooth-L1 between the drafter's output ĥ_{p+1} and the target's h_{p+1}.

``unroll`` = k trains depths 1..k of a drafting chain at once (training-time test): pass
j's input at position p is (s_{p+1}, ĥ^{(j-1)}_p), the drafter's own output of pass j−1
in place of the target's h_p, and its attention sees what decoding's draft cache holds
at depth j — pass-1 (target-feature) entries up to the chain's root p−j+1, then one
entry of each deeper pass (``chain_mask``). Each pass has the same targets as pass 1:
the depth-j draft at p predicts the same token s_{p+2}. Fed outputs are detached.

``drafter_loss`` is the functional form (any trainer); ``DrafterTrainer`` in trainer.py
wraps it with AdamW.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..config.drafter_loss import LOSS_PRESETS, LossConfig
from ..models.drafter import EagleDrafter
from ..rollout.sampling import processed_logprobs

__all__ = ["LossConfig", "LOSS_PRESETS", "chain_mask", "unrolled_forward", "batch_terms",
           "drafter_loss", "sampled_acceptance", "cache_target_probs"]


def drafter_pairs(tokens: Sequence[int], features: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter inputs of one sequence: for p = 0..N-2, (s_{p+1}, h_p). Returns
    (next tokens [N-1] long, features [N-1, F])."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    return ids[1:], features[:-1]


def chain_mask(n: int, passes: int, device=None) -> torch.Tensor:
    """[passes*n, passes*n] bool attention mask (True = masked) of ``passes`` unrolled
    passes laid out pass after pass, n positions each. A query of pass a at position p
    sees pass 1 at positions <= p-a+1 (the chain's root and the target-feature context
    before it) and pass i (2 <= i <= a) at position p-a+i: exactly the drafter cache a
    depth-a draft attends to in decoding."""
    pos = torch.arange(n, device=device).repeat(passes)
    pas = torch.arange(1, passes + 1, device=device).repeat_interleave(n)
    qp, qa = pos[:, None], pas[:, None]
    kp, ki = pos[None, :], pas[None, :]
    root = qp - qa + 1
    seen = ((ki == 1) & (kp <= root)) | ((ki >= 2) & (ki <= qa) & (kp == root + ki - 1))
    return ~seen


def unrolled_forward(drafter: EagleDrafter, embeds: torch.Tensor, h: torch.Tensor,
                     rope: torch.Tensor, passes: int) -> torch.Tensor:
    """Outputs [passes, B, n, H] of ``passes`` unrolled drafter passes over inputs
    embed(s_{p+1}) [B, n, H] and target h_p [B, n, H] (reduced), ``rope`` the target's
    ``rotary_pos_emb(n)``. Pass 1 is the plain causal forward; deeper passes are
    computed with it in one masked sequence (``chain_mask``), earlier passes' outputs
    (fed forward, detached) first without gradients."""
    if passes == 1:
        return drafter(embeds, h, rope)[None]
    b, n, hid = embeds.shape
    fed = [h]
    for j in range(1, passes + 1):
        pos = torch.arange(n, device=rope.device).repeat(j)
        mask = chain_mask(n, j, device=embeds.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and j == passes):
            out = drafter(embeds.repeat(1, j, 1), torch.cat(fed, dim=1), rope[pos], mask)
        if j < passes:  # pass j+1 reads pass j's output of the previous position
            last = out[:, (j - 1) * n:].detach()
            fed.append(torch.cat([h[:, :1], last[:, :-1]], dim=1))
    return out.view(b, passes, n, hid).transpose(0, 1)


def sampled_acceptance(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor,
                       d2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """α = Σ min(p̃, q̃) per row: ``p_logprobs`` [..., V] the target's processed
    log-probabilities over the full vocabulary, ``q_logprobs`` [..., V_d] the drafter's
    over its draft vocabulary (target ids ``d2t``; None = the full vocabulary)."""
    p = p_logprobs if d2t is None else p_logprobs[..., d2t]
    return torch.minimum(p.exp(), q_logprobs.exp()).sum(-1)


def _whole_vocab(runner) -> None:
    """Refuse a runner whose embedding and output layer are vocabulary slices (TP > 1):
    the loss needs them whole (``target_view.WholeVocabTarget``)."""
    from .target_view import WholeVocabTarget

    if getattr(runner, "tp_group", None) is not None and not isinstance(runner,
                                                                        WholeVocabTarget):
        raise ValueError("the drafter loss reads the target's embedding and output layer "
                         "whole; at tensor parallel size > 1 pass "
                         "drafter_training.target_view.WholeVocabTarget(runner) and call "
                         "inside its whole_vocab()")


def _head(drafter: EagleDrafter, runner) -> torch.Tensor:
    """Output-layer rows of the draft vocabulary (frozen)."""
    w = runner.output_w.detach()[: runner.arch.vocab_size]
    return w if drafter.d2t is None else w[drafter.d2t]


def _pad_batch(drafter: EagleDrafter, runner, batch):
    """Padded drafter inputs of a batch of ``DraftSample``: (next tokens [B, n], target
    features [B, n, F], next hidden h_{p+1} [B, n, H], positions whose prediction is a
    response token [B, n] bool, first such position per row [B])."""
    dev, dtype = runner.device, runner.dtype
    n = max(len(s.tokens) for s in batch) - 1
    b, hid = len(batch), drafter.config.hidden_size
    tok = torch.zeros(b, n, dtype=torch.long, device=dev)
    feat = torch.zeros(b, n, drafter.config.feature_width, dtype=dtype, device=dev)
    tgt = torch.zeros(b, n, hid, dtype=dtype, device=dev)
    mask = torch.zeros(b, n, dtype=torch.bool, device=dev)
    first = torch.zeros(b, dtype=torch.long, device=dev)
    for i, s in enumerate(batch):
        nt, f = drafter_pairs(s.tokens, s.features)
        m = nt.shape[0]
        # (detached: features an online trainer takes from the policy's own forward
        # must not carry the drafter's gradients into the policy)
        tok[i, :m], feat[i, :m] = nt.to(dev), f.detach().to(dev, dtype)
        tgt[i, :m] = s.final_hidden[1:].detach().to(dev, dtype)  # h_{p+1}
        # the prediction at p is token s_{p+2}: kept when that is a response token
        first[i] = max(s.prompt_len - 2, 0)
        mask[i, first[i]: m] = True
    return tok, feat, tgt, mask, first


@torch.no_grad()
def cache_target_probs(samples: Sequence, runner, drafter: EagleDrafter, cfg: LossConfig,
                       chunk: int = 512) -> None:
    """Keep on each ``DraftSample`` the target's processed probabilities over the
    drafter's draft vocabulary at every position that predicts a response token (with
    max p̃ and the target's top token; prompt positions hold zeros), so training epochs
    and α measurements skip the full-vocabulary head and its processing. Only for
    pruned draft vocabularies (the full one would be [N, V] per sample); a later change
    of draft vocabulary or settings ignores the cache, and samples already cached for
    the same settings and vocabulary are kept as they are."""
    if drafter.d2t is None:
        return
    _whole_vocab(runner)
    head = runner.output_w.detach()[: runner.arch.vocab_size]
    key = cfg.processing()
    vd = drafter.d2t.numel()
    for s in samples:
        c = getattr(s, "target_probs", None)
        if c is not None and c[0] == key and torch.equal(c[1], drafter.d2t):
            continue  # already cached for these settings and this vocabulary
        h = s.final_hidden[1:]
        # positions before the response never predict a response token (``_pad_batch``'s
        # mask): left at zero instead of paying the full-vocabulary head for them
        first = min(max(s.prompt_len - 2, 0), h.shape[0])
        p_d = torch.zeros(h.shape[0], vd)
        mx = torch.zeros(h.shape[0])
        top = torch.zeros(h.shape[0], dtype=torch.long)
        for i in range(first, h.shape[0], chunk):
            lp = processed_logprobs(h[i: i + chunk].to(head.device, head.dtype) @ head.t(),
                                    *key)
            m, t = lp.exp().max(-1)
            p_d[i: i + chunk], mx[i: i + chunk] = lp[:, drafter.d2t].exp().cpu(), m.cpu()
            top[i: i + chunk] = t.cpu()
        s.target_probs = (key, drafter.d2t.clone(), p_d, mx, top)


def _cached(batch, drafter, key, n, sel):
    """The cached (p̃ on the draft vocabulary, max p̃, top token) of the selected
    positions, or None unless every sample holds a cache for these settings."""
    if drafter.d2t is None:
        return None
    for s in batch:
        c = getattr(s, "target_probs", None)
        if c is None or c[0] != key or not torch.equal(c[1], drafter.d2t):
            return None
    vd = drafter.d2t.numel()
    dev = drafter.d2t.device
    p = torch.zeros(len(batch), n, vd, device=dev)
    mx = torch.zeros(len(batch), n, device=dev)
    top = torch.zeros(len(batch), n, dtype=torch.long, device=dev)
    for i, s in enumerate(batch):
        m = s.target_probs[2].shape[0]
        p[i, :m], mx[i, :m], top[i, :m] = (t.to(dev) for t in s.target_probs[2:])
    return p.reshape(-1, vd)[sel], mx.reshape(-1)[sel], top.reshape(-1)[sel]


def batch_terms(drafter: EagleDrafter, runner, batch: Sequence, cfg: LossConfig,
                passes: Optional[int] = None) -> dict:
    """Per-position loss terms of ``passes`` (default ``cfg.unroll``) unrolled passes over
    a batch of ``DraftSample``. Returns a dict of lists (one entry per pass, each a 1-D
    tensor over the positions where that depth drafts a response token: pass j skips
    the first j-1, whose chain root would lie in the prompt): ``alpha``, ``kl``, ``tv``,
    ``hidden``, ``top1``; and, per depth-1 position, ``p_max`` (max p̃) and
    ``vocab_mass`` (p̃'s mass inside the draft vocabulary)."""
    passes = passes or cfg.unroll
    _whole_vocab(runner)
    tok, feat, tgt, mask, first = _pad_batch(drafter, runner, batch)
    with torch.no_grad():
        emb = F.embedding(tok, runner.embed_w)
    h_in = drafter.reduce_features(feat)
    rope = runner.model.rotary_pos_emb(tok.shape[1])
    outs = unrolled_forward(drafter, emb, h_in, rope, passes)
    head = _head(drafter, runner)
    full_head = runner.output_w.detach()[: runner.arch.vocab_size]
    key = cfg.processing()
    temp = key[0]
    sel = mask.reshape(-1)
    hid = tgt.shape[-1]
    tgt_m = tgt.reshape(-1, hid)[sel]
    cached = _cached(batch, drafter, key, tok.shape[1], sel)
    with torch.no_grad():
        if cached is None:
            lp = processed_logprobs(tgt_m @ full_head.t(), *key)  # p̃ [N, V]
            p_d = (lp if drafter.d2t is None else lp[:, drafter.d2t]).exp()
            p_all_max, top_all = lp.exp().max(-1)
        else:
            p_d, p_all_max, top_all = cached
    pos = torch.arange(tok.shape[1], device=tok.device)[None].expand_as(tok).reshape(-1)[sel]
    row_first = first[:, None].expand_as(tok).reshape(-1)[sel]
    terms: dict = {k: [] for k in ("alpha", "kl", "tv", "hidden", "top1")}
    for j in range(passes):
        keep = pos >= row_first + j
        out_m = outs[j].reshape(-1, hid)[sel][keep]
        logits = (out_m @ head.t()).float()
        q_lp = processed_logprobs(logits, *key)
        pj = p_d[keep]
        alpha = torch.minimum(pj, q_lp.exp()).sum(-1)
        q_t = torch.log_softmax(logits / temp, dim=-1)
        terms["alpha"].append(alpha)
        terms["tv"].append(1.0 - alpha)
        terms["kl"].append((torch.xlogy(pj, pj) - pj * q_t.masked_fill(pj == 0, 0.0)).sum(-1))
        terms["hidden"].append(F.smooth_l1_loss(out_m.float(), tgt_m[keep].float(),
                                                reduction="none").mean(-1))
        with torch.no_grad():
            top_t = top_all[keep]
            top_d = logits.argmax(-1)
            if drafter.d2t is not None:
                top_d = drafter.d2t[top_d]
            terms["top1"].append((top_d == top_t).float())
    with torch.no_grad():
        terms["p_max"] = p_all_max
        terms["vocab_mass"] = p_d.sum(-1)
    return terms


def drafter_loss(drafter: EagleDrafter, runner, batch: Sequence, cfg: LossConfig
                 ) -> tuple[torch.Tensor, dict]:
    """The configured loss over a batch of ``DraftSample`` (mean over response
    positions, then over unrolled passes) and its parts as floats: ``loss``, ``alpha``
    (depth 1), ``kl``, ``tv``, ``hidden``, ``top1`` (depth 1), ``alpha_by_depth``,
    ``tokens``. Gradients reach only the drafter's parameters (the target's embedding,
    output layer and features are read without autograd)."""
    t = batch_terms(drafter, runner, batch, cfg)
    loss = 0.0
    for j in range(len(t["alpha"])):
        if not t["alpha"][j].numel():
            continue
        part = cfg.hidden * t["hidden"][j].mean()
        if cfg.kl:
            part = part + cfg.kl * t["kl"][j].mean()
        if cfg.tv:
            part = part + cfg.tv * t["tv"][j].mean()
        if cfg.log_accept:
            part = part - cfg.log_accept * torch.log(t["alpha"][j].clamp_min(1e-6)).mean()
        loss = loss + part / len(t["alpha"])
    if not torch.is_tensor(loss):  # no response positions in the batch
        loss = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0

    def mean(x):
        return float(x.detach().mean()) if x.numel() else float("nan")

    parts = {"loss": float(loss.detach()), "alpha": mean(t["alpha"][0]),
             "kl": mean(t["kl"][0]), "tv": mean(t["tv"][0]),
             "hidden": mean(t["hidden"][0]), "top1": mean(t["top1"][0]),
             "alpha_by_depth": [mean(a) for a in t["alpha"]],
             "tokens": int(t["alpha"][0].numel())}
    return loss, parts
