"""Drafter training on the target's own sequences (self-distillation).

A sample is a token sequence s_0..s_{N-1} (prompt then response) with the target's
features h_0..h_{N-1} at every position (final hidden state after the final norm, or
the EAGLE-3 layer concatenation). The drafter sees, at position p, the pair

    (s_{p+1}, h_p)        -- ``drafter_pairs``; decoding feeds exactly this pair

and is trained to output the target's next hidden state h_{p+1} (smooth-L1, weight
1.0) and the target's next-token distribution softmax(output_layer(h_{p+1}))
(soft cross-entropy, weight 0.1), on positions whose prediction is a response token.
Embedding and output layer are the target's, frozen; only drafter weights train
(AdamW).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..models.drafter import EagleDrafter
from ..rollout.forward import ModelRunner
from ..rollout.kv_cache import KVCache

HIDDEN_WEIGHT = 1.0
CE_WEIGHT = 0.1


@dataclass
class DraftSample:
    tokens: list[int]  # prompt + response
    prompt_len: int
    features: torch.Tensor  # [len(tokens), feature_width] target features per position
    final_hidden: torch.Tensor  # [len(tokens), H] the target's final (post-norm) hidden


def drafter_pairs(tokens: Sequence[int], features: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter inputs of one sequence: for p = 0..N-2, (s_{p+1}, h_p). Returns
    (next tokens [N-1] long, features [N-1, F])."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    return ids[1:], features[:-1]


@torch.no_grad()
def target_features(runner: ModelRunner, sequences: Sequence[Sequence[int]],
                    feature_layers: Sequence[int] = (),
                    progress: Optional[Callable[[int], None]] = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features [N, F], final hidden [N, H]) of each sequence from one target forward
    per sequence (the rollout engine's own kernel, so features match decoding).
    ``progress(done)`` is called after each sequence."""
    out = []
    for seq in sequences:
        n = len(seq)
        cache = KVCache(num_layers=len(runner.layers), max_batch=1, kv_heads=runner.groups,
                        capacity=n, head_dim=runner.head_dim, dtype=runner.dtype,
                        device=runner.device)
        got: dict[int, torch.Tensor] = {}
        hook = (lambda i, x: got.__setitem__(i, x)) if feature_layers else None
        ids = torch.tensor([list(seq)], dtype=torch.long, device=runner.device)
        hidden = runner.extend(cache, slice(0, 1), ids,
                               torch.zeros(1, dtype=torch.long, device=runner.device),
                               capture=hook)[0]
        feats = torch.cat([got[i][0] for i in feature_layers], -1) if feature_layers else hidden
        out.append((feats.cpu(), hidden.cpu()))
        if progress is not None:
            progress(len(out))
    return out


class DrafterTrainer:
    """AdamW on the drafter's own parameters with the EAGLE loss.

    ``runner`` supplies the target's frozen embedding and output layer (and RoPE).
    """

    def __init__(self, drafter: EagleDrafter, runner: ModelRunner, *, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 20, total_steps: int = 1000,
                 min_lr_ratio: float = 0.1, grad_clip: float = 1.0, unroll: int = 1):
        self.drafter = drafter
        self.runner = runner
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay,
                                     betas=(0.9, 0.95))
        self.lr, self.warmup, self.total = lr, warmup_steps, max(total_steps, 1)
        self.min_lr_ratio, self.grad_clip = min_lr_ratio, grad_clip
        if unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {unroll}")
        self.unroll = unroll
        self.step_count = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def head(self) -> torch.Tensor:
        """Output-layer rows of the draft vocabulary (the full, unpadded vocabulary
        without pruning), frozen."""
        w = self.runner.output_w.detach()[: self.runner.arch.vocab_size]
        d2t = self.drafter.d2t
        return w if d2t is None else w[d2t]

    def loss(self, batch: Sequence[DraftSample]) -> tuple[torch.Tensor, dict]:
        """EAGLE loss over a padded batch of samples; returns (loss, parts)."""
        d = self.drafter
        dev, dtype = self.runner.device, self.runner.dtype
        n = max(len(s.tokens) for s in batch) - 1
        b, H = len(batch), d.config.hidden_size
        tok = torch.zeros(b, n, dtype=torch.long, device=dev)
        feat = torch.zeros(b, n, d.config.feature_width, dtype=dtype, device=dev)
        tgt = torch.zeros(b, n, H, dtype=dtype, device=dev)
        mask = torch.zeros(b, n, dtype=torch.bool, device=dev)
        for i, s in enumerate(batch):
            nt, f = drafter_pairs(s.tokens, s.features)
            m = nt.shape[0]
            tok[i, :m], feat[i, :m] = nt.to(dev), f.to(dev, dtype)
            tgt[i, :m] = s.final_hidden[1:].to(dev, dtype)  # h_{p+1}
            # the prediction at p is token s_{p+2}: keep it when that is a response token
            mask[i, max(s.prompt_len - 2, 0): m] = True
        with torch.no_grad():
            emb = F.embedding(tok, self.runner.embed_w)
        h_in = d.reduce_features(feat)
        rope = self.runner.model.rotary_pos_emb(n)
        sel = mask.reshape(-1)
        tgt_m = tgt.reshape(-1, H)[sel]
        head = self.head()
        with torch.no_grad():
            t_logits = tgt_m @ head.t()
            p = torch.softmax(t_logits.float(), dim=-1)
        loss, parts = 0.0, {}
        for k in range(self.unroll):
            # pass k > 0 feeds the drafter its own previous outputs as h (shifted by one
            # position, detached), as drafting k tokens ahead does
            out = d(emb, h_in, rope)
            out_m = out.reshape(-1, H)[sel]
            l_hidden = F.smooth_l1_loss(out_m.float(), tgt_m.float(), reduction="none").mean(-1)
            logq = torch.log_softmax((out_m @ head.t()).float(), dim=-1)
            l_ce = -(p * logq).sum(-1)
            loss = loss + (HIDDEN_WEIGHT * l_hidden.mean() + CE_WEIGHT * l_ce.mean()) / self.unroll
            if k == 0:
                with torch.no_grad():
                    top1 = (logq.argmax(-1) == t_logits.argmax(-1)).float().mean()
                parts = {"hidden": float(l_hidden.detach().mean()),
                         "ce": float(l_ce.detach().mean()), "top1": float(top1)}
            if k + 1 < self.unroll:
                h_in = torch.cat([h_in[:, :1], out[:, :-1].detach()], dim=1)
        parts.update(loss=float(loss.detach()), tokens=int(sel.sum()))
        return loss, parts

    def step(self, batch: Sequence[DraftSample]) -> dict:
        self.drafter.train()
        lr = self.lr_at(self.step_count)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss, parts = self.loss(batch)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.step_count += 1
        self.drafter.eval()
        parts["lr"] = lr
        return parts

    def fit(self, samples: Sequence[DraftSample], *, epochs: int, batch_tokens: int = 2048,
            seed: int = 0, log: Optional[Callable[[str], None]] = print,
            log_every: int = 10) -> list[dict]:
        """Epochs over ``samples`` in length-bucketed batches of about ``batch_tokens``
        padded tokens; returns the per-step metrics."""
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
        batches, cur = [], []
        for i in order:
            width = max([len(samples[j].tokens) for j in cur] + [len(samples[i].tokens)])
            if cur and (len(cur) + 1) * width > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        g = torch.Generator().manual_seed(seed)
        history = []
        t0 = time.perf_counter()
        total = epochs * len(batches)
        for epoch in range(epochs):
            for j in torch.randperm(len(batches), generator=g).tolist():
                parts = self.step([samples[i] for i in batches[j]])
                parts["epoch"] = epoch
                history.append(parts)
                k = len(history)
                if log and (k % log_every == 0 or k == total):
                    log(f"  step {k}/{total}  epoch {epoch + 1}/{epochs}  loss {parts['loss']:.4f}"
                        f"  hidden {parts['hidden']:.4f}  ce {parts['ce']:.3f}"
                        f"  top1 {parts['top1']:.3f}  lr {parts['lr']:.2e}"
                        f"  ({time.perf_counter() - t0:.0f}s)")
        return history


def draft_vocabulary(sequences: Sequence[Sequence[int]], size: int, vocab_size: int,
                     always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``sequences`` (ties: lower id), plus
    ``always`` (e.g. EOS), as a sorted d2t map; padded with the lowest unused ids when
    the data has fewer distinct tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(torch.as_tensor(list(s), dtype=torch.long), minlength=vocab_size)
    for t in always:
        counts[int(t)] = counts.max() + 1
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)
