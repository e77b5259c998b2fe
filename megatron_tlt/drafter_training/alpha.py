"""An exact measure of how much speculative sampling will accept: α by draft depth.

On held-out responses sampled from the current policy, with p̃ and q̃ processed at the
rollout's temperature / top-k / top-p (``processed_logprobs``, as decoding does):

- ``alpha[d-1]`` = E[Σ_x min(p̃(x), q̃_d(x))], the probability that the depth-d draft
  of a chain is accepted given its prefix was, with the drafter fed its own outputs
  along the chain exactly as decoding feeds them (``losses.unrolled_forward``) and the
  chain's tokens taken from the held-out responses. No sampling: an expectation over
  every token, so two drafters compare exactly on the same data, however noisy the
  machine's timings;
- ``e_max_p`` = E[max p̃]: what drafting the target's own most likely token accepts per
  token (the bar a drafter must beat);
- ``vocab_mass`` = E[p̃(draft vocabulary)]: the most any drafter limited to its draft
  vocabulary can accept per token;
- ``predicted_accept_len`` = 1 + Σ_{d=1..k} Π_{j<=d} α_j: tokens per chain step of
  depth k (accepted drafts plus the bonus token), treating depths as independent;
  ``measured_accept_len`` runs the rollout engine to compare.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from .losses import LossConfig, batch_terms
from .trainer import DraftSample, length_batches

__all__ = ["AlphaReport", "measure_alpha", "measure_self_alpha", "predicted_accept_len",
           "measured_accept_len", "held_out_samples"]


@dataclass
class AlphaReport:
    alpha: list[float]  # depth 1..k
    e_max_p: float
    vocab_mass: float
    tokens: int  # depth-1 positions measured
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    measured_accept_len: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def predicted_accept_len(self) -> float:
        return predicted_accept_len(self.alpha)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["predicted_accept_len"] = self.predicted_accept_len
        return d

    def line(self) -> str:
        meas = ("" if self.measured_accept_len is None
                else f", measured {self.measured_accept_len:.2f}")
        return (f"alpha by depth {' '.join(f'{a:.3f}' for a in self.alpha)} at "
                f"T={self.temperature:g} (E[max p] {self.e_max_p:.3f}, draft-vocabulary "
                f"mass {self.vocab_mass:.3f}, {self.tokens} tokens); chain acceptance "
                f"length predicted {self.predicted_accept_len:.2f}{meas}")


def predicted_accept_len(alpha: Sequence[float]) -> float:
    """Expected tokens per step of a depth-k chain with per-depth acceptance ``alpha``."""
    total, run = 1.0, 1.0
    for a in alpha:
        run *= a
        total += run
    return total


@torch.no_grad()
def measure_alpha(drafter, runner, samples: Sequence[DraftSample], *, temperature: float,
                  top_k: int = 0, top_p: float = 1.0, depth: int = 4,
                  batch_tokens: int = 2048) -> AlphaReport:
    """α at depths 1..``depth`` and the bars beside it over ``samples`` (held-out
    responses with the target's features, ``trainer.target_features``)."""
    if not samples:
        raise ValueError("measure_alpha needs at least one held-out sample")
    cfg = LossConfig(kl=1.0, temperature=temperature, top_k=top_k, top_p=top_p,
                     unroll=depth)
    was_training = drafter.training
    drafter.eval()
    sums = [0.0] * depth
    counts = [0] * depth
    p_max = mass = 0.0
    for idx in length_batches(samples, batch_tokens):
        t = batch_terms(drafter, runner, [samples[i] for i in idx], cfg)
        for j, a in enumerate(t["alpha"]):
            sums[j] += float(a.double().sum())
            counts[j] += a.numel()
        p_max += float(t["p_max"].double().sum())
        mass += float(t["vocab_mass"].double().sum())
    drafter.train(was_training)
    n = max(counts[0], 1)
    return AlphaReport(alpha=[s / max(c, 1) for s, c in zip(sums, counts)], e_max_p=p_max / n,
                       vocab_mass=mass / n, tokens=counts[0], temperature=temperature,
                       top_k=top_k, top_p=top_p, extra={"tokens_by_depth": counts})


@torch.no_grad()
def measure_self_alpha(copy, runner, samples: Sequence[DraftSample], *, temperature: float,
                       top_k: int = 0, top_p: float = 1.0, depth: int = 4,
                       chunk: int = 64, target_kv: bool = True) -> AlphaReport:
    """α of the self-drafter's copy (``SelfDraftRunner``) on the same held-out data and
    with the same bars as ``measure_alpha``. The copy is fed tokens, not its own
    features: given that a chain's prefix was accepted, its draft at depth d is its
    distribution after those (held-out) tokens, whatever d. So α at depth d is
    E[Σ_x min(p̃(x), q̃(x))] over the response positions ``measure_alpha`` measures
    depth d at (all but the first d-1 of each response): the depths differ only by
    the positions they cover, and both kinds' columns cover the same ones.
    ``target_kv`` (as the engine drafts, ``SelfDraftDecoder.adopt``): at each response
    position the copy attends over the target's keys and values of the tokens before it
    (one copy step per position); False: over its own (one causal forward)."""
    from ..rollout.kv_cache import KVCache
    from ..rollout.sampling import processed_logprobs

    if not samples:
        raise ValueError("measure_self_alpha needs at least one held-out sample")
    key = (temperature or 1.0, top_k, top_p)
    sums = [0.0] * depth
    counts = [0] * depth
    p_max = mass = 0.0
    for s in samples:
        ids = torch.as_tensor(s.tokens, dtype=torch.long, device=copy.device)
        cache = KVCache(num_layers=len(copy.layers), max_batch=1, kv_heads=copy.groups,
                        capacity=ids.numel(), head_dim=copy.head_dim, dtype=copy.dtype,
                        device=copy.device)
        # the positions measure_alpha measures: from the last prompt token's (predicting
        # the first response token) to the last token's (the distribution after the
        # response)
        lo, hi = s.prompt_len - 1, ids.numel()
        if hi <= lo:
            continue
        if target_kv:
            hs = _copy_over_target_kv(copy, runner, ids, cache, lo, hi, chunk)
        else:
            hs = [copy.extend(cache, slice(0, 1), ids[None, i: i + chunk],
                              torch.tensor([i], device=copy.device))[0]
                  for i in range(0, ids.numel(), chunk)]  # chunks: the copy's GEMM kernels
        p = processed_logprobs(runner.logits(
            s.final_hidden[lo:hi].to(runner.device, runner.dtype)).float(), *key).exp()
        h_resp = torch.cat(hs)[lo:hi] if not target_kv else torch.cat(hs)
        q_d = processed_logprobs(copy.draft_logits(h_resp).float(), *key).exp()
        if copy.d2t is None:
            q = q_d
        else:
            q = torch.zeros_like(p)
            q[:, copy.d2t] = q_d
        a = torch.minimum(p, q).sum(-1).double()
        for j in range(depth):  # depth j+1: all but the response's first j positions
            sums[j] += float(a[j:].sum())
            counts[j] += max(a.numel() - j, 0)
        p_max += float(p.max(-1).values.double().sum())
        mass += float((p if copy.d2t is None else p[:, copy.d2t]).sum(-1).double().sum())
    n_ = max(counts[0], 1)
    return AlphaReport(alpha=[x / max(c, 1) for x, c in zip(sums, counts)],
                       e_max_p=p_max / n_, vocab_mass=mass / n_, tokens=counts[0],
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       extra={"tokens_by_depth": counts})


def _copy_over_target_kv(copy, runner, ids: torch.Tensor, cache, lo: int, hi: int,
                         chunk: int) -> list:
    """The copy's final hidden state at each position lo..hi-1 of ``ids`` when its cache
    holds the target's keys and values before that position (the engine's copy): the
    target's forward fills ``cache``, then per position one copy step writes its own
    entry, which is put back to the target's before the next."""
    dev = copy.device
    for i in range(0, ids.numel(), chunk):  # the target's keys and values
        runner.extend(cache, slice(0, 1), ids[None, i: i + chunk], torch.tensor([i], device=dev))
    out = []
    for t in range(lo, hi):
        k_t, v_t = cache.k[:, :, :, t].clone(), cache.v[:, :, :, t].clone()
        out.append(copy.extend(cache, slice(0, 1), ids[None, t: t + 1],
                               torch.tensor([t], device=dev))[0])
        cache.k[:, :, :, t], cache.v[:, :, :, t] = k_t, v_t
    return out


def held_out_samples(engine, prompts: Sequence[Sequence[int]], sampling, *,
                     per_prompt: int = 1, feature_layers: Sequence[int] = ()
                     ) -> list[DraftSample]:
    """``per_prompt`` responses of the target to each prompt, sampled with ``sampling``
    (a ``SamplingParams``), with the target's features: held-out data for
    ``measure_alpha``."""
    from .trainer import target_features

    reqs = [list(p) for p in prompts for _ in range(per_prompt)]
    seqs = [p + o.token_ids for p, o in zip(reqs, engine.generate(reqs, sampling))]
    return [DraftSample(s, len(p), f, h) for s, p, (f, h) in
            zip(seqs, reqs, target_features(engine.runner, seqs, feature_layers))]


def measured_accept_len(engine, drafter, prompts: Sequence[Sequence[int]], sampling,
                        depth: int) -> dict:
    """Speculative decoding of ``prompts`` with a depth-``depth`` chain (strategy
    ``{depth}_1_{depth}``, always on) at ``sampling``: the engine's measured acceptance
    length and per-position acceptance rates. Restores the engine's speculative config."""
    from ..config import SpeculativeConfig

    old = engine.config.speculative, engine.spec, engine.tuner
    engine.config.speculative = SpeculativeConfig(policy="fixed",
                                                  strategy=f"{depth}_1_{depth}",
                                                  threshold=1 << 30)
    try:
        engine.attach_drafter(drafter)
        engine.generate(list(prompts), sampling)
        summ = engine.last_stats.spec.summary()
    finally:
        engine.config.speculative, engine.spec, engine.tuner = old
    return {"accept_len": summ["accept_len"],
            "accept_rate_at_position": summ["accept_rate_at_position"]}
