"""``tools/plan_tlt.py --recommend``: search the layout and the rollout's settings for
the fastest predicted step that the dry run's memory bound allows.

The search, for a recipe and a world size (each candidate is the recipe with
overrides, loaded and checked as a run would be):

1. layouts: TP (dividing the heads, at most 8: one node's NVLink), PP (dividing the
   layers, at most 4), EP for a mixture-of-experts model (dividing the experts and
   DP), DP the rest; each must pass the dry run's checks (``validation.validate``:
   every rule the launch runs) and, with the paged KV cache at
   the budget ``kv_budget.propose`` sizes for it, fit the device
   (``memory_model.estimate``'s peak); each is predicted once with the recipe's
   speculation settings;
2. on the ``refine`` fastest layouts: the KV budget (the proposal, and half of it),
   the speculation threshold (``THRESHOLDS``) and the drafter kinds (the one-layer
   drafter trained by the drafter group, the policy's 8-bit copy) are searched.

Every candidate is ranked by its predicted step with TLT; the report gives each its
overrides, its step times, its memory and why it wins (what it does better than the
recipe as it stands, or than the next one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError, load_config
from ..models.known import architecture
from ..rollout.speculative import drafters
from ..validation import validate
from . import kv_budget, memory_model
from .memory_model import GIB

THRESHOLDS = (16, 32, 64)
# the one-layer drafter trained by the drafter group, or the policy's 8-bit copy
KINDS = (("trained", {"rollout.speculative.drafter": "", "drafter_group.enable": "true"}),
         ("copy", {"rollout.speculative.drafter": "self", "drafter_group.enable": "false"}))


@dataclass
class Candidate:
    overrides: dict
    layout: str
    step_off: float = 0.0
    step_tlt: float = 0.0
    rollout_fraction: float = 0.0
    spec_share: float = 0.0
    rows: int = 0
    kv_gib: float = 0.0
    peak_gib: float = 0.0
    kind: str = ""
    threshold: int = 0
    reason: str = ""
    notes: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        """What the candidate runs (the same settings reached by two paths are one; two
        budgets that keep the same rows in flight predict the same step)."""
        return (self.layout, self.kind, self.threshold, self.rows)

    def to_dict(self) -> dict:
        return {"overrides": self.overrides, "layout": self.layout,
                "step_without_tlt_s": self.step_off, "step_with_tlt_s": self.step_tlt,
                "tlt_speedup": self.step_off / self.step_tlt if self.step_tlt else None,
                "rollout_fraction": self.rollout_fraction,
                "speculation_share": self.spec_share, "rows_in_flight": self.rows,
                "kv_cache_gib": self.kv_gib, "peak_gib": self.peak_gib,
                "drafter_kind": self.kind, "threshold": self.threshold,
                "reason": self.reason}


def _load(files, overrides: list, extra: dict):
    return load_config(files, list(overrides) + [f"{k}={v}" for k, v in extra.items()])


def check(cfg, arch, world_size: int) -> memory_model.Estimate:
    """The dry run's checks and its memory bound; raises ConfigError (or ValueError) when
    the candidate would not pass ``--dry-run``."""
    validate(cfg, arch, world_size)
    est = memory_model.estimate(cfg, arch, world_size)
    limit = memory_model.GPU_BYTES * memory_model.GPU_USABLE
    if est.settings.on_gpu and est.peak > limit:
        raise ConfigError(f"peak {est.peak / GIB:.1f} GiB > {limit / GIB:.1f} GiB usable")
    return est


def layouts(cfg, arch, world_size: int) -> list[dict]:
    """The (TP, PP, EP) overrides to try, the recipe's first."""
    par = cfg.parallel
    own = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
           par.expert_model_parallel_size)
    out = [own]
    for tp in (1, 2, 4, 8):
        if arch.num_attention_heads % tp or world_size % tp:
            continue
        for pp in (1, 2, 4):
            if arch.num_layers % pp or world_size % (tp * pp):
                continue
            dp = world_size // (tp * pp)
            eps = [e for e in (1, 2, 4, 8, 16) if dp % e == 0
                   and arch.num_experts % e == 0] if arch.is_moe else [1]
            out += [(tp, pp, ep) for ep in eps if (tp, pp, ep) not in out]
    g = cfg.grpo
    # with the paged cache max_batch_size only bounds the rows in flight: every response
    # of the replica (the EP group's) may be, the budget decides
    return [{"parallel.tensor_model_parallel_size": tp,
             "parallel.pipeline_model_parallel_size": pp,
             "parallel.expert_model_parallel_size": ep,
             "rollout.max_batch_size": max(1, g.prompts_per_step * g.group_size * ep
                                           // (world_size // (tp * pp)))}
            for tp, pp, ep in out]


def _evaluate(files, overrides, extra: dict, arch, world_size: int, *, steps: int,
              hardware: Optional[str], lengths, propose: bool = True,
              kv_scale: float = 1.0) -> Optional[Candidate]:
    from ..planner import predict_for_config

    extra = dict(extra, **{"rollout.kv_cache": "paged"})
    try:
        cfg = _load(files, overrides, extra)
        if propose and cfg.platform.device != "cpu":  # a CPU run has no device bound
            prop = kv_budget.propose(cfg, arch, world_size)
            if not prop.gib:
                return None
            gib = max(kv_budget.STEP_GIB,
                      round(prop.gib * kv_scale / kv_budget.STEP_GIB) * kv_budget.STEP_GIB)
            extra["rollout.kv_cache_gib"] = gib
            cfg.rollout.kv_cache_gib = gib
        est = check(cfg, arch, world_size)
    except (ConfigError, ValueError):
        return None
    pred = predict_for_config(cfg, world_size, hardware=hardware, lengths=lengths,
                              steps=steps, band=False, arch=arch)
    par, s = cfg.parallel, est.settings
    dp = world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    lay = (f"TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size}"
           + (f" x EP {par.expert_model_parallel_size}"
              if par.expert_model_parallel_size > 1 else "") + f" x DP {dp}")
    kind = "copy" if drafters.kind_of_value(cfg.rollout.speculative.drafter).copies_policy \
        else "trained"
    return Candidate(extra, lay, pred.off.step, pred.tlt.step, pred.tlt.rollout_fraction,
                     pred.tlt.spec_share, s.rollout_rows, cfg.rollout.kv_cache_gib,
                     est.peak / GIB, kind, cfg.rollout.speculative.threshold)


def recommend(files, overrides=(), world_size: int = 8, *, top: int = 3, steps: int = 2,
              refine: int = 1, hardware: Optional[str] = None, lengths=None) -> dict:
    """The ``top`` fastest candidates (``Candidate``) and the recipe as it stands."""
    from ..planner import predict_for_config

    base_cfg = load_config(files, list(overrides))
    arch = architecture(base_cfg)[0]
    base = predict_for_config(base_cfg, world_size, hardware=hardware, lengths=lengths,
                              steps=steps, band=False, arch=arch)
    first = [c for lay in layouts(base_cfg, arch, world_size)
             if (c := _evaluate(files, overrides, lay, arch, world_size, steps=steps,
                                hardware=hardware, lengths=lengths)) is not None]
    if not first:
        raise ConfigError(f"no layout of {world_size} GPUs passes the dry run for this "
                          "recipe (memory or divisibility): try more GPUs")
    first.sort(key=lambda c: c.step_tlt)
    found = list(first)
    seen = {c.key for c in found}
    for best in first[:refine]:
        lay = {k: v for k, v in best.overrides.items()
               if k.startswith("parallel.") or k == "rollout.max_batch_size"}
        for kind, kv in KINDS:
            for th in THRESHOLDS:
                for scale in (1.0, 0.5):
                    extra = dict(lay, **kv, **{"rollout.speculative.threshold": th})
                    c = _evaluate(files, overrides, extra, arch, world_size, steps=steps,
                                  hardware=hardware, lengths=lengths, kv_scale=scale)
                    if c is not None and c.key not in seen:
                        seen.add(c.key)
                        found.append(c)
    found.sort(key=lambda c: (round(c.step_tlt, 3), c.kv_gib))
    shown = found[:top]
    base_tlt = base.tlt.step
    for i, c in enumerate(shown):
        c.reason = _reason(c, shown[i + 1] if i + 1 < len(shown) else None, base_tlt,
                           base.scenario.engine, i == 0)
    return {"world_size": world_size, "searched": len(found),
            "recipe": {"step_without_tlt_s": base.off.step, "step_with_tlt_s": base_tlt,
                       "kv_cache": base_cfg.rollout.kv_cache},
            "recommendations": [c.to_dict() for c in shown], "_candidates": shown}


def _reason(c: Candidate, nxt: Optional[Candidate], base_tlt: float, base_engine,
            best: bool) -> str:
    why = [f"{base_tlt / c.step_tlt:.2f}x faster than the recipe as it stands "
           f"({base_tlt:.1f} s with TLT)"]
    if c.rows > base_engine.max_batch_size:
        why.append(f"{c.rows} rows in flight where the recipe's cache holds "
                   f"{base_engine.max_batch_size}")
    if nxt is not None:
        diff = [f"{n} {a} against {b}" for n, a, b in (
            ("layout", c.layout, nxt.layout), ("drafter", c.kind, nxt.kind),
            ("threshold", c.threshold, nxt.threshold),
            ("KV GiB", f"{c.kv_gib:g}", f"{nxt.kv_gib:g}")) if a != b]
        lead = (nxt.step_tlt - c.step_tlt) / nxt.step_tlt
        why.append((f"{lead:.1%} ahead of the next" if lead > 0 else "ties the next")
                   + (f" ({'; '.join(diff)})" if diff else ""))
    why.append(f"speculation on {c.spec_share:.0%} of tokens, rollout "
               f"{c.rollout_fraction:.0%} of the step")
    if "PP 1 " not in c.layout:
        why.append("PP > 1: the training's pipeline bubble is not modelled (optimistic)")
    return ("fastest: " if best else "") + "; ".join(why)


def lines(out: dict) -> list[str]:
    r = out["recipe"]
    res = [f"recipe as it stands ({r['kv_cache']} KV cache): {r['step_without_tlt_s']:.1f} s "
           f"without TLT, {r['step_with_tlt_s']:.1f} s with TLT; {out['searched']} "
           f"candidates on {out['world_size']} GPUs passed the dry run"]
    for i, c in enumerate(out["recommendations"], 1):
        ov = " ".join(f"{k}={v}" for k, v in c["overrides"].items())
        res += [f"{i}. {c['layout']}, {c['drafter_kind']}, threshold {c['threshold']}, "
                f"KV {c['kv_cache_gib']:g} GiB ({c['rows_in_flight']} rows): "
                f"{c['step_without_tlt_s']:.1f} s without TLT, {c['step_with_tlt_s']:.1f} s "
                f"with ({c['tlt_speedup']:.2f}x); peak {c['peak_gib']:.1f} GiB",
                f"   why: {c['reason']}", f"   overrides: {ov}"]
    return res
