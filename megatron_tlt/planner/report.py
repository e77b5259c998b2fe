"""A prediction: the three arms (no TLT, TLT, frozen drafter), the sensitivity band,
and what it assumed, as a dict (JSON) and as lines for the dry run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .sim import ArmResult, Scenario, simulate_arm, with_sensitivity

ACCEPT_BAND = 0.20  # +-20 % on every alpha
BANDWIDTH_BAND = 0.15  # +-15 % on memory bandwidth (decode step times)


@dataclass
class Prediction:
    scenario: Scenario
    off: ArmResult
    tlt: ArmResult
    frozen: Optional[ArmResult]
    band: tuple  # (low, high) TLT speedup over the sensitivity cases
    cases: dict  # case name -> speedup
    assumptions: list = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.off.step / self.tlt.step

    @property
    def rollout_speedup(self) -> float:
        return self.off.mean("rollout") / self.tlt.mean("rollout")

    def to_dict(self) -> dict:
        sc = self.scenario

        def arm(a: Optional[ArmResult]) -> Optional[dict]:
            if a is None:
                return None
            return {"step_s": a.step, "rollout_s": a.mean("rollout"),
                    "logprob_s": a.mean("logprob"), "update_s": a.mean("update"),
                    "rollout_fraction": a.rollout_fraction,
                    "idle_replica_seconds": a.mean("idle_replica_seconds"),
                    "idle_gpu_seconds": a.mean("idle_gpu_seconds"),
                    "speculation_share": a.spec_share,
                    "accept_len": a.mean("accept_len"),
                    "drafter_tokens_per_step": a.mean("drafter_tokens"),
                    "per_step_s": [s.step for s in a.steps]}

        return {
            "layout": {"tp": sc.layout.tp, "pp": sc.layout.pp, "dp": sc.layout.dp,
                       "gathered": sc.layout.gathered, "gpus": sc.layout.gpus},
            "workload": {"prompts_per_step": sc.prompts_per_step,
                         "group_size": sc.group_size, "prompt_tokens": sc.prompt_tokens,
                         "lengths": sc.lengths.source, "steps_simulated": sc.steps,
                         "seed": sc.seed},
            "without_tlt": arm(self.off), "with_tlt": arm(self.tlt),
            "frozen_drafter": arm(self.frozen),
            "speedup": self.speedup, "rollout_speedup": self.rollout_speedup,
            "speedup_band": list(self.band), "sensitivity": self.cases,
            "assumptions": self.assumptions,
        }

    def lines(self) -> list[str]:
        """The dry run's report lines: predicted, with its assumptions."""
        o, t = self.off, self.tlt
        lo, hi = self.band
        out = [
            "predicted step time (megatron_tlt.planner; a model, not a measurement):",
            f"  without TLT {o.step:9.1f} s/step (rollout {o.mean('rollout'):.1f} s, "
            f"{o.rollout_fraction:.0%} of the step; idle replica-seconds "
            f"{o.mean('idle_replica_seconds'):.0f})",
            f"  with TLT    {t.step:9.1f} s/step (rollout {t.mean('rollout'):.1f} s; "
            f"speculation on {t.spec_share:.0%} of decoded tokens, accept length "
            f"{_fmt(t.mean('accept_len'))})",
            f"  expected speedup {self.speedup:.2f}x [{lo:.2f}, {hi:.2f}] "
            f"(+-{ACCEPT_BAND:.0%} acceptance, +-{BANDWIDTH_BAND:.0%} bandwidth)",
        ]
        if self.frozen is not None:
            out.append(f"  frozen drafter (no drafter group): {self.off.step / self.frozen.step:.2f}x")
        out.append("  assumptions:")
        out += [f"    - {a}" for a in self.assumptions]
        return out


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def predict(sc: Scenario, assumptions: Optional[list] = None, *, band: bool = True,
            frozen: bool = True) -> Prediction:
    """The three arms and the sensitivity band (each of +-20 % acceptance and +-15 %
    bandwidth alone, the baseline re-simulated where bandwidth moves it)."""
    off, tlt = simulate_arm(sc, "off"), simulate_arm(sc, "tlt")
    fro = simulate_arm(sc, "frozen") if frozen and sc.acceptance is not None else None
    cases = {"nominal": off.step / tlt.step}
    if band and sc.acceptance is not None:
        for name, acc, bw in (("acceptance -20%", 1 - ACCEPT_BAND, 1.0),
                              ("acceptance +20%", 1 + ACCEPT_BAND, 1.0),
                              ("bandwidth -15%", 1.0, 1 - BANDWIDTH_BAND),
                              ("bandwidth +15%", 1.0, 1 + BANDWIDTH_BAND)):
            s2 = with_sensitivity(sc, acc, bw)
            base = off if bw == 1.0 else simulate_arm(s2, "off")
            cases[name] = base.step / simulate_arm(s2, "tlt").step
    vals = list(cases.values())
    return Prediction(sc, off, tlt, fro, (min(vals), max(vals)), cases,
                      list(assumptions or []))
