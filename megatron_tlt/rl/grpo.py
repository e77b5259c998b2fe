"""The GRPO loss family (GRPO, DAPO, Dr. GRPO) as plain torch functions.

Notation: response i of group g has reward R_i and, at response position t, the
log-probability logp[i, t] of its sampled token under the policy being trained,
old_logp under the policy that produced the step's samples (the pre-update model),
ref_logp under the frozen reference and rollout_logp as reported by the engine.

Nothing here talks to a process group except ``micro_batch_loss`` and
``vocab_parallel_entropy`` (the tensor-parallel group) and, when given one,
``loss_denominators`` (the group it is handed), all through ``collectives``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .. import collectives
from ..config import GRPOConfig

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# The metric that is a maximum, not a sum: all-reduce it with MAX, the others with SUM.
MAX_METRICS = ("ratio_max",)


# ---------------------------------------------------------------- rewards, advantages

def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size "
                         f"{group_size}, got shape {tuple(rewards.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    return rewards.view(-1, group_size)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [groups]: True where every reward of the group is equal (advantage 0).

    ``rewards`` [groups * group_size], groups consecutive (prompt-major).
    """
    r = _groups(rewards, group_size)
    return (r == r[:, :1]).all(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages, one per response, [N].

    A_i = (R_i - mean_g R) / (std_g R + eps)   (GRPO, ``norm_by_std``)
    A_i =  R_i - mean_g R                      (Dr. GRPO)

    std_g is the unbiased (Bessel-corrected, n - 1) standard deviation, torch.std's
    default, as GRPO and verl use. Groups whose rewards are all equal give exactly 0,
    and so does a group of one response: it has no baseline (verl returns R_i there,
    REINFORCE without a baseline; the config refuses grpo.group_size=1 instead).
    """
    r = _groups(rewards, group_size)
    flat = zero_std_groups(rewards, group_size).unsqueeze(1)
    centred = torch.where(flat, torch.zeros_like(r), r - r.mean(dim=1, keepdim=True))
    if norm_by_std and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term <= 0 per response.

    With L = max_new_tokens - buffer: 0 for len <= L, else -penalty * (len - L) / buffer,
    which falls linearly to -penalty at len = max_new_tokens and stays there beyond.
    """
    if buffer <= 0:
        raise ValueError(f"overlong buffer must be > 0, got {buffer}")
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0, max=buffer)
    return -penalty * excess / buffer


# ---------------------------------------------------------------- the policy loss

@dataclass
class LossDenominators:
    """Mini-batch-global denominators of the loss aggregations.

    tokens:    loss tokens in the whole mini-batch (all micro-batches, all DP ranks)
    sequences: sequences in the whole mini-batch (count the ones with >= 1 loss token:
               a fully masked sequence contributes nothing to the numerators)
    max_len:   the constant of seq-mean-token-sum-norm (max_new_tokens)
    """

    tokens: float
    sequences: float
    max_len: float


def loss_denominators(masks: Iterable[torch.Tensor], max_len: int,
                      group=None) -> LossDenominators:
    """``LossDenominators`` of a mini-batch from its micro-batches' [B, T] loss masks.

    Counts loss tokens and sequences with at least one loss token; with ``group``
    (the data-parallel group) the counts are summed over its ranks.
    """
    device = collectives.device_of(group) if group is not None else torch.device("cpu")
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mask in masks:
        n = mask.detach().float().sum(dim=-1)
        counts += torch.stack([n.sum(), (n > 0).sum()]).double().to(device)
    if group is not None:
        collectives.all_reduce(counts, group=group)
    return LossDenominators(tokens=float(counts[0]), sequences=float(counts[1]),
                            max_len=float(max_len))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    k1 = logp - ref_logp;  k3 = exp(d) - d - 1 with d = ref_logp - logp (>= 0, low
    variance; Schulman's estimator). Not clamped.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}: expected 'k1' or 'k3'")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: GRPOConfig, denoms: LossDenominators, *,
                ref_logp: Optional[torch.Tensor] = None,
                rollout_logp: Optional[torch.Tensor] = None,
                entropy: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mini-batch GRPO loss, and its metric sums.

    All [B, T] tensors are over response positions; ``mask`` (bool or 0/1) selects the
    loss tokens, ``advantages`` is [B]. Only ``logp`` (and ``entropy``) carry gradients.
    Per token, with r = exp(logp - old_logp) and A the sequence's advantage:

        pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))     clipped surrogate
        pg = min(pg, -c A)                 where A < 0            dual clip (c > 0)
        pg = pg * min(exp(old_logp - rollout_logp), tis_cap)      TIS (cap > 0), detached
        L  = pg + kl_beta * kl(logp, ref_logp) - entropy_coef * entropy

    Aggregation (m = mask, n_i = loss tokens of sequence i), with the mini-batch-global
    ``denoms`` so that summing the returned loss over micro-batches and DP ranks gives
    exactly the mini-batch loss:

        token-mean               sum_{i,t} L m / denoms.tokens
        seq-mean-token-mean      sum_i (sum_t L m / max(1, n_i)) / denoms.sequences
        seq-mean-token-sum-norm  sum_{i,t} L m / denoms.max_len / denoms.sequences

    Metrics (detached float scalars; SUMS over this micro-batch's loss tokens unless
    said otherwise, always all present, 0 where the input is absent):

        tokens, sequences           loss tokens; sequences with >= 1 loss token
        pg_loss_sum                 sum of pg (after dual clip and TIS)
        kl_sum                      sum of kl (whenever ref_logp is given)
        entropy_sum                 sum of entropy (whenever entropy is given)
        clip_low_count              A < 0 and r < 1 - eps_low (clipped: no gradient)
        clip_high_count             A > 0 and r > 1 + eps_high (clipped: no gradient)
        dual_clip_count             A < 0 and the dual clip -c A is active
        ratio_sum                   sum of r
        ratio_max                   max of r (a MAX: see MAX_METRICS)
        tis_weight_sum              sum of the TIS weight (when TIS is on)
        rollout_logp_abs_diff_sum   sum |old_logp - rollout_logp| (when rollout_logp given)

    Masked positions are zeroed in every input first, so padding may hold any value.
    """
    if cfg.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}: expected one of "
                         f"{LOSS_AGGREGATIONS}")
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError("grpo.kl_beta > 0 needs the reference log-probs (ref_logp)")
    on = mask.bool()
    m = on.to(logp.dtype)

    def clean(x):  # padding may hold inf/nan: keep it out of values and gradients
        return None if x is None else torch.where(on, x, torch.zeros_like(x))

    logp = clean(logp)
    old_logp, ref_logp, rollout_logp = (clean(x.detach()) if x is not None else None
                                        for x in (old_logp, ref_logp, rollout_logp))
    entropy = clean(entropy)
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)

    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.zeros_like(on)
    if cfg.dual_clip_c > 0:
        dual = (adv < 0) & (pg > -cfg.dual_clip_c * adv)
        pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip_c * adv), pg)
    tis = None
    if cfg.tis_cap > 0 and rollout_logp is not None:
        tis = torch.exp(old_logp - rollout_logp).clamp(max=cfg.tis_cap)
        pg = pg * tis

    token_loss = pg
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg.kl_type)
        if cfg.kl_beta > 0:
            token_loss = token_loss + cfg.kl_beta * kl
    if entropy is not None and cfg.entropy_coef:
        token_loss = token_loss - cfg.entropy_coef * entropy

    per_seq = (token_loss * m).sum(dim=1)
    n_tokens = m.sum(dim=1)
    if cfg.loss_agg == "token-mean":
        loss = per_seq.sum() / denoms.tokens
    elif cfg.loss_agg == "seq-mean-token-mean":
        loss = (per_seq / n_tokens.clamp(min=1)).sum() / denoms.sequences
    else:
        loss = per_seq.sum() / denoms.max_len / denoms.sequences

    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)

        def total(x):
            return zero if x is None else (x * m).sum().float()

        def count(b):
            return (b & on).sum().float()

        metrics = {
            "tokens": m.sum().float(),
            "sequences": (n_tokens > 0).sum().float(),
            "pg_loss_sum": total(pg),
            "kl_sum": total(kl),
            "entropy_sum": total(entropy),
            "clip_low_count": count((adv < 0) & (ratio < 1 - cfg.clip_eps_low)),
            "clip_high_count": count((adv > 0) & (ratio > 1 + cfg.clip_eps_high)),
            "dual_clip_count": count(dual),
            "ratio_sum": total(ratio),
            "ratio_max": (ratio.masked_fill(~on, 0).max().float() if on.any() else zero),
            "tis_weight_sum": total(tis),
            "rollout_logp_abs_diff_sum": (zero if rollout_logp is None
                                          else total((old_logp - rollout_logp).abs())),
        }
        metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, metrics


# ---------------------------------------------------------------- entropy

def vocab_parallel_entropy(local_logits: torch.Tensor,
                           vocab_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits) per position, [b, s], differentiable, in fp32.

    ``local_logits`` [b, s, v/tp] is this tensor-parallel rank's vocabulary slice
    (columns rank * v/tp onward); columns whose id is >= ``vocab_size`` are padding and
    are excluded (logit -inf). With M the global max, e = exp(x - M), S = sum_v e:

        H = log S - sum_v e (x - M) / S

    S and sum_v e (x - M) are summed over the TP group with megatron-core's
    autograd-aware all-reduce; M (a constant shift, no gradient) with an all-reduce MAX.
    At TP=1 nothing is communicated.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = local_logits.float()
    tp = ps.get_tensor_model_parallel_world_size()
    pad = None
    if vocab_size is not None:
        per_rank = x.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * per_rank
        first_pad = min(max(vocab_size - start, 0), per_rank)
        if first_pad < per_rank:
            pad = torch.arange(per_rank, device=x.device) >= first_pad
            x = x.masked_fill(pad, float("-inf"))

    shift = x.detach().max(dim=-1, keepdim=True).values
    collectives.all_reduce(shift, op="max", group=ps.get_tensor_model_parallel_group())
    shifted = x - shift
    e = torch.exp(shifted)
    if pad is not None:  # 0 * -inf is nan: padding columns contribute exactly 0
        shifted = shifted.masked_fill(pad, 0.0)
    sums = torch.stack([e.sum(dim=-1), (e * shifted).sum(dim=-1)])
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    return torch.log(sums[0]) - sums[1] / sums[0]


# ---------------------------------------------------------------- one micro-batch

def micro_batch_loss(mb, local_logits: torch.Tensor, cfg: GRPOConfig,
                     denoms: LossDenominators, *, vocab_size: int, chunk_tokens: int,
                     fused_old: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` of a ``samples.MicroBatch`` from its vocabulary-parallel logits
    [b, S, V/TP], and its metrics (plus ``mismatch_ratio_err_sum`` and ``loss``).

    Log-probs and entropies at the sampling temperature (softmax(logits / T), no
    top-k/top-p) at the loss positions only, ``chunk_tokens`` positions at a time
    (``token_stats``: no full-size fp32 copy of the logits). The entropy carries
    gradients only with ``entropy_coef`` > 0; otherwise it is a metric of the same
    pass. ``fused_old``: the pre-update log-probs are this forward's (one PPO epoch, no
    separate old-policy pass), so the ratio is exactly 1.
    """
    from .token_stats import token_stats

    logp, ent = token_stats(local_logits, mb.targets, mb.mask, vocab_size=vocab_size,
                            temperature=cfg.temperature, chunk_tokens=chunk_tokens,
                            entropy_grad=cfg.entropy_coef > 0 and torch.is_grad_enabled())
    old = logp.detach() if fused_old else mb.old_logprobs
    loss, met = policy_loss(logp, old, mb.advantages, mb.mask, cfg, denoms,
                            ref_logp=mb.ref_logprobs, rollout_logp=mb.rollout_logprobs,
                            entropy=ent)
    with torch.no_grad():  # train/rollout mismatch: |exp(diff) - 1|
        diff = (old - mb.rollout_logprobs) * mb.mask
        met = dict(met)
        met["mismatch_ratio_err_sum"] = ((diff.exp() - 1).abs() * mb.mask).sum()
        met["loss"] = loss.detach()
    return loss, met
