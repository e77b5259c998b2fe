"""Drafter training on the target's own sequences (self-distillation).

A sample is a token sequence s_0..s_{N-1} (prompt then response) with the target's
features h_0..h_{N-1} at every position (final hidden state after the final norm, or
the EAGLE-3 layer concatenation). The drafter sees, at position p, the pair

    (s_{p+1}, h_p)        -- ``drafter_pairs``; decoding feeds exactly this pair

and is trained on positions whose prediction is a response token with a loss of
``losses.LossConfig`` (forward KL against the target's processed next-token
distribution, acceptance terms, next-hidden-state regression, unrolled depths).
Embedding and output layer are the target's, frozen; only drafter weights train
(AdamW).

    trainer = DrafterTrainer(drafter, runner, lr=1e-3, total_steps=n, loss=LossConfig(...))
    parts = trainer.step(batch)      # batch: a list of DraftSample; one optimizer step
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .. import collectives
from ..models.drafter import EagleDrafter
from ..rollout.forward import ModelRunner
from ..rollout.kv_cache import KVCache
from .losses import LossConfig, drafter_loss


@dataclass
class DraftSample:
    tokens: list[int]  # prompt + response
    prompt_len: int
    features: torch.Tensor  # [len(tokens), feature_width] target features per position
    final_hidden: torch.Tensor  # [len(tokens), H] the target's final (post-norm) hidden
    # (settings, d2t, p̃ on the draft vocabulary, max p̃, top token) per position 1..N-1:
    # losses.cache_target_probs; None = computed from final_hidden when needed
    target_probs: Optional[tuple] = None


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
    """AdamW on the drafter's own parameters with a ``LossConfig`` loss (default: the
    EAGLE preset). ``step(batch)`` is the one training entry point (offline warm-up and
    online training alike): a list of ``DraftSample`` in, the loss parts out.

    ``runner`` supplies the target's frozen embedding and output layer (and RoPE).
    ``unroll`` overrides ``loss.unroll`` when given.
    """

    def __init__(self, drafter: EagleDrafter, runner: ModelRunner, *, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 20, total_steps: int = 1000,
                 min_lr_ratio: float = 0.1, grad_clip: float = 1.0,
                 unroll: Optional[int] = None, loss: Optional[LossConfig] = None):
        self.drafter = drafter
        self.runner = runner
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay,
                                     betas=(0.9, 0.95))
        self.lr, self.warmup, self.total = lr, warmup_steps, max(total_steps, 1)
        self.min_lr_ratio, self.grad_clip = min_lr_ratio, grad_clip
        loss = loss if loss is not None else LossConfig.preset("eagle")
        if unroll is not None:
            loss = dataclasses.replace(loss, unroll=unroll)  # (validates unroll >= 1)
        self.loss_config = loss
        self.unroll = loss.unroll
        self.step_count = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def loss(self, batch: Sequence[DraftSample]) -> tuple[torch.Tensor, dict]:
        """The configured loss over a padded batch of samples; returns (loss, parts)."""
        return drafter_loss(self.drafter, self.runner, batch, self.loss_config)

    def step(self, batch: Sequence[DraftSample], *, chunks: int = 1,
             stop: Optional[Callable[[], bool]] = None) -> dict:
        """One optimizer step on ``batch``. With ``chunks`` > 1 the batch's rows are
        split into that many chunks whose gradients accumulate (weighted by their
        response positions, so the step equals the whole batch's up to float rounding);
        ``stop()`` is asked before each chunk after the first, and a True answer steps
        on the chunks done (a smaller batch): a caller that must yield is held for one
        chunk, not one batch. ``parts["chunks"]`` says how many ran."""
        self.drafter.train()
        lr = self.lr_at(self.step_count)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        n = max(1, min(int(chunks), len(batch)))
        if n == 1:
            loss, parts = self.loss(batch)
            loss.backward()
            parts["chunks"] = 1
        else:
            parts = self._chunked_backward(batch, n, stop)
        if self.grad_clip:
            self._clip_grads()
        self.opt.step()
        self.step_count += 1
        self.drafter.eval()
        parts["lr"] = lr
        return parts

    def _clip_grads(self) -> None:
        """Clip by the norm of the whole drafter's gradient. Under TP the layer's
        linears are sharded over the runner's TP group: their squared norms are summed
        over it, the replicated parameters' counted once (TP rank 0's), so every TP
        rank scales by the same factor, the one TP = 1 would use."""
        group = getattr(self.runner, "tp_group", None)
        if group is None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            return
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self.params
                 if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
        sq = torch.zeros(1, dtype=torch.float32, device=self.params[0].device)
        if grads:
            sq += torch.nn.utils.get_total_norm(grads, 2.0).float() ** 2
        collectives.all_reduce(sq, group=group)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, sq.sqrt()[0])

    def _chunked_backward(self, batch, n: int, stop) -> dict:
        size = -(-len(batch) // n)
        tokens, weighted, ran, parts = 0, 0.0, 0, {}
        for j in range(0, len(batch), size):
            if j and stop is not None and stop():
                break
            chunk = batch[j:j + size]
            loss, parts = self.loss(chunk)
            w = parts.get("tokens") or len(chunk)  # (a custom loss may not count them)
            (loss * w).backward()
            tokens += w
            weighted += parts["loss"] * w
            ran += 1
        scale = 1.0 / max(tokens, 1)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        # the last chunk's diagnostics; loss and tokens over the chunks that ran
        return dict(parts, loss=weighted * scale if tokens else parts["loss"],
                    tokens=tokens, chunks=ran)

    def fit(self, samples: Sequence[DraftSample], *, epochs: int, batch_tokens: int = 2048,
            seed: int = 0, log: Optional[Callable[[str], None]] = print,
            log_every: int = 10) -> list[dict]:
        """Epochs over ``samples`` in length-bucketed batches of about ``batch_tokens``
        padded tokens; returns the per-step metrics."""
        batches = length_batches(samples, batch_tokens)
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
                        f"  alpha {parts['alpha']:.3f}  kl {parts['kl']:.3f}"
                        f"  hidden {parts['hidden']:.4f}  top1 {parts['top1']:.3f}"
                        f"  lr {parts['lr']:.2e}"
                        f"  ({time.perf_counter() - t0:.0f}s)")
        return history


def length_batches(samples: Sequence[DraftSample], batch_tokens: int) -> list[list[int]]:
    """Indices of ``samples`` in length-sorted batches of about ``batch_tokens`` padded
    tokens (at least one sample each)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(samples[i].tokens))
        if cur and (len(cur) + 1) * w > batch_tokens:
            batches.append(cur)
            cur, w = [], len(samples[i].tokens)
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches


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
